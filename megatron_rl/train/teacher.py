"""On-policy distillation's teacher in a run (rl.teacher; config/teacher.py, algorithms/distill.py).

    check_teacher(config)                  # preflight: the source, its vocabulary, its context length
    teacher = build_teacher(config, runtime)           # None without rl.teacher
    teacher.score(rollout.groups, experience)  # each trajectory's teacher_logprobs (after pack_step)
    teacher.heldout_accuracy(...)          # once at start: the teacher's own held-out accuracy
    teacher.close()

Two homes for the teacher, one interface:
  server   a vLLM server of the teacher's weights (rollout/teacher.py), started by the driver from
           rl.teacher.source or reached at rl.teacher.server_url; the driver asks it for the
           logprobs of every sampled token of the step and hands them to every rank.
  trainer  a frozen Megatron model in the training ranks (model/teacher.py), any architecture that
           the run's layout divides, one forward over this rank's packed micro-batches, as the KL
           reference's forward is.

Both score at temperature 1 (the teacher's own distribution, the target the student is pulled
to), on every position after the prompt; only the loss mask's tokens (the model's own, not a
multi-turn trajectory's observations) enter the advantage.

A served teacher that fails during the run (its server died, or answered an error or something
that is not a completion) raises TeacherFailed on every rank at once, before the step trains: the
trainer keeps the last finished step's checkpoint and stops in one line (train/trainer.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_rl.errors import ConfigError, TrainingStopped
from megatron_rl.rollout.protocol import EngineError

KEY = "rl.teacher"


class TeacherFailed(TrainingStopped):
    """The teacher's server could not score (or sample for its held-out accuracy): it died, or
    answered an error or something that is not a completion. Raised on every rank at once; the
    trainer checkpoints the last finished step and stops with this one line."""


# --------------------------------------------------------------------------- the source

@dataclasses.dataclass(frozen=True)
class TeacherSource:
    """Where the teacher's config.json and tokenizer files are, and its weights."""

    config_dir: Path  # config.json and tokenizer files
    checkpoint: Path | None  # a megatron-rl checkpoint (its torch_dist weights); None: a HF directory

    @classmethod
    def resolve(cls, teacher) -> TeacherSource:
        """`teacher`: the TeacherConfig. Raises ConfigError naming rl.teacher.source."""
        from megatron_rl.checkpoint.format import names_megatron_checkpoint, resolve_checkpoint

        path = Path(teacher.source)
        if not path.exists():
            raise ConfigError(f"{KEY}.source: {path} does not exist")
        if names_megatron_checkpoint(path):
            if teacher.mode == "server":
                raise ConfigError(f"{KEY}.source: {path} is a megatron-rl checkpoint, which a vLLM server cannot load; "
                                  f"convert it (megatron-rl convert megatron-to-hf, or use a run's hf_model/ "
                                  f"directory), or set {KEY}.mode=trainer")
            try:
                checkpoint = resolve_checkpoint(path)
            except ConfigError as exc:
                raise ConfigError(f"{KEY}.source: {exc}") from None
            return cls(checkpoint / "hf_config", checkpoint)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{KEY}.source: {path} holds no config.json: pass a Hugging Face model directory or "
                              f"(mode: trainer) a megatron-rl checkpoint")
        return cls(path, None)

    def raw_config(self) -> dict:
        """The teacher's config.json, an object whose numeric keys are of their kind (it may be of
        an architecture only vLLM serves: not parsed further here)."""
        from megatron_rl.model.hf_config import check_value_types, load_hf_config

        try:
            raw, where = load_hf_config(self.config_dir)
            check_value_types(raw, where)
        except ConfigError as exc:
            raise ConfigError(f"{KEY}.source: {exc}") from None
        return raw


# --------------------------------------------------------------------------- start-up checks

def check_teacher(config, student_tokenizer) -> None:
    """Before any model or engine exists: the teacher's source, the same vocabulary as the
    student's tokenizer, and a context that holds the student's longest sequence
    (rollout.max_model_len: prompt + rl.max_response_tokens). Raises ConfigError naming the key.
    `student_tokenizer`: the run's (preflight.run_tokenizer: as the engines will load it)."""
    teacher = config.rl.teacher
    if teacher is None:
        return
    source = TeacherSource.resolve(teacher)
    check_teacher_length(config, source)
    check_same_vocabulary(student_tokenizer, teacher_tokenizer(source), source.config_dir)
    if teacher.mode == "trainer":
        check_no_adapters(source)
        check_trainer_layout(config, source)


def check_no_adapters(source: TeacherSource) -> None:
    """A trainer-held teacher is built from its config.json and loaded whole: a checkpoint of a
    LoRA run (adapters over a base) is refused by name, with the merged export as the way."""
    from megatron_rl.checkpoint.format import read_metadata
    from megatron_rl.checkpoint.lora_record import recorded_lora

    if source.checkpoint is None:
        return
    try:
        lora = recorded_lora(source.checkpoint, read_metadata(source.checkpoint))
    except ConfigError as exc:
        raise ConfigError(f"{KEY}.source: {exc}") from None
    if lora is not None:
        raise ConfigError(f"{KEY}.source: {source.checkpoint} holds a LoRA run's adapters (rank {lora.get('rank')}, "
                          f"alpha {lora.get('alpha')}), and the teacher is a whole model, loaded without them: "
                          f"export the merged model (`megatron-rl convert megatron-to-hf --merge-lora --ckpt "
                          f"{source.checkpoint} --out DIR`) and set {KEY}.source=DIR")


def teacher_tokenizer(source: TeacherSource):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.config_dir)
    except Exception as exc:  # noqa: BLE001 - any loader failure is the same user error
        raise ConfigError(f"{KEY}.source: no tokenizer could be loaded from {source.config_dir} ({exc}); the teacher "
                          f"must ship the student's tokenizer files") from None


def check_same_vocabulary(student, teacher, where: Path) -> None:
    """The same token for every id: the teacher's probability of token id k must be the student's
    token k, or the signal compares different strings."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    by_id_mine = {index: token for token, index in mine.items()}
    by_id_theirs = {index: token for token, index in theirs.items()}
    differ = sorted(i for i in set(by_id_mine) | set(by_id_theirs) if by_id_mine.get(i) != by_id_theirs.get(i))
    first = differ[0]
    raise ConfigError(
        f"{KEY}.source: the teacher's tokenizer ({where}) has another vocabulary than the student's: "
        f"{len(theirs)} vs {len(mine)} tokens, {len(differ)} ids differ (the first, id {first}: teacher "
        f"{by_id_theirs.get(first)!r}, student {by_id_mine.get(first)!r}). Distillation compares both models' "
        f"probabilities of the same token ids, so the teacher must use the student's tokenizer")


def student_sequence_length(config) -> int:
    """The longest sequence the student produces: rollout.max_model_len (preflight keeps every
    prompt within rollout.max_model_len - rl.max_response_tokens)."""
    return config.rollout.max_model_len


def _length_terms(config) -> str:
    return (f"the student's sequences reach rollout.max_model_len={config.rollout.max_model_len} tokens (prompt + "
            f"rl.max_response_tokens={config.rl.max_response_tokens})")


def check_teacher_length(config, source: TeacherSource) -> None:
    teacher, needed = config.rl.teacher, student_sequence_length(config)
    positions = source.raw_config().get("max_position_embeddings")
    if teacher.mode == "trainer" or teacher.server_url is None:
        if positions is not None and positions < needed:
            raise ConfigError(f"{KEY}.source: the teacher holds {positions} positions (max_position_embeddings of "
                              f"{source.config_dir / 'config.json'}), but {_length_terms(config)}; use a teacher with "
                              f"a longer context or lower rollout.max_model_len")
    if teacher.mode == "server" and teacher.server_url is None:
        served = server_context(config)
        if served < needed + 1:
            raise ConfigError(f"{KEY}.max_model_len={served} cannot hold the student's sequences: "
                              f"{_length_terms(config)}, and a prompt-logprobs request needs one token more; set it "
                              f"to at least {needed + 1} "
                              f"(or null)")


def server_context(config) -> int:
    teacher = config.rl.teacher
    return teacher.max_model_len if teacher.max_model_len is not None else student_sequence_length(config) + 1


def check_served_length(config, served: int | None) -> None:
    """A running teacher server (rl.teacher.server_url): the context it reports."""
    needed = student_sequence_length(config) + 1
    if served is not None and served < needed:
        raise ConfigError(f"{KEY}.server_url: the teacher server serves a context of {served} tokens, but "
                          f"{_length_terms(config)} and a prompt-logprobs request needs one token more ({needed}); "
                          f"restart it with --max-model-len {needed} or more")


def teacher_run_config(config, source: TeacherSource):
    """The run's config with the teacher's model: its config.json, its vocabulary padding (a
    checkpoint's recorded row count), no adapters (model.lora is the student's), an even pipeline
    split (the student's uneven one is counted in the student's layers)."""
    from megatron_rl.checkpoint.format import with_vocab_of

    model = dataclasses.replace(config.model, hf_config=str(source.config_dir), padded_vocab_size=None,
                                architecture=None, moe_router_bias_update_rate=0.0, lora=None)
    parallel = dataclasses.replace(config.parallel, pp_first_stage_layers=None, pp_last_stage_layers=None)
    teacher_config = dataclasses.replace(config, model=model, parallel=parallel)
    return with_vocab_of(teacher_config, source.checkpoint) if source.checkpoint is not None else teacher_config


def check_trainer_layout(config, source: TeacherSource) -> None:
    """A trainer-held teacher runs at the run's layout: its heads, experts and layers must divide."""
    from megatron_rl.model.hf_config import parse_hf_config
    from megatron_rl.model.layout_checks import check_divisibility

    teacher_config = teacher_run_config(config, source)
    arch = parse_hf_config(source.raw_config(), str(source.config_dir / "config.json"))
    try:
        teacher_config.parallel.validate_for_model("parallel", num_experts=arch.num_experts)
        check_divisibility(arch, teacher_config)
    except ConfigError as exc:
        raise ConfigError(f"{KEY}.mode=trainer: the teacher ({source.config_dir}) does not fit the run's parallel "
                          f"layout: {exc}; use {KEY}.mode=server") from None


# --------------------------------------------------------------------------- the teacher

def build_teacher(config, runtime, *, notify=print):
    """The run's teacher (None without rl.teacher). Collective for mode: trainer."""
    teacher = config.rl.teacher
    if teacher is None:
        return None
    source = TeacherSource.resolve(teacher)
    if teacher.mode == "trainer":
        return TrainerTeacher.build(config, runtime, source)
    return ServerTeacher.build(config, runtime, source, notify=notify)


def one_line(error: Exception) -> str:
    """An engine error's first line (a dead server's message continues with its log's last lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _store(trajectories, values) -> None:
    for trajectory, row in zip(trajectories, values):
        if len(row) != trajectory.length:
            raise ValueError(f"the teacher scored {len(row)} tokens of a {trajectory.length}-token response")
        trajectory.teacher_logprobs = torch.tensor(row, dtype=torch.float32)


class ServerTeacher:
    """The driver talks to the teacher's server; every rank receives the step's logprobs."""

    def __init__(self, server, runtime):
        self.server, self.runtime = server, runtime  # server: the driver's TeacherServer, None elsewhere

    @classmethod
    def build(cls, config, runtime, source: TeacherSource, *, notify=print) -> ServerTeacher:
        server = error = None
        if runtime.is_driver:
            try:
                server = _connect(config, source, notify)
            except ConfigError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait for the driver
                error = f"{KEY}: the teacher's server could not be used: {exc}"
        error = runtime.from_driver(error)
        if error is not None:
            raise ConfigError(error)
        return cls(server, runtime)

    def score(self, groups, experience=None) -> None:
        """Collective: every trajectory of `groups` gets its teacher_logprobs."""
        trajectories = [t for group in groups for t in group]
        values = None
        if self.server is not None:
            try:
                values = self.server.logprobs([(t.prompt_ids, t.response_ids) for t in trajectories])
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits for the driver
                values = exc
        values = self.runtime.from_driver(values)
        if isinstance(values, EngineError):
            raise TeacherFailed(f"the teacher's server could not score the step's tokens: {one_line(values)}") from None
        if isinstance(values, Exception):
            raise values
        _store(trajectories, values)

    def engine(self):
        """The driver's: the server as a sampling engine (held-out evaluation); None elsewhere."""
        return self.server.engine() if self.server is not None else None

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()


def _connect(config, source: TeacherSource, notify):
    from megatron_rl.rollout.factory import engine_dtype
    from megatron_rl.rollout.teacher import TeacherServer

    teacher = config.rl.teacher
    if teacher.server_url is not None:
        server = TeacherServer(teacher.server_url, request_timeout_s=teacher.request_timeout_s)
        check_served_length(config, server.max_model_len)
        return server
    from megatron_rl.runtime.distributed import free_port

    dtype = engine_dtype(config) if teacher.dtype == "auto" else teacher.dtype
    log = Path(config.output_dir) / "logs" / "teacher-vllm.log"
    notify(f"starting the teacher's vLLM server ({source.config_dir}); its log: {log}")
    return TeacherServer.start(source.config_dir, port=free_port(), log_path=log, max_model_len=server_context(config),
                               dtype=dtype, seed=config.seed, startup_timeout_s=teacher.startup_timeout_s,
                               request_timeout_s=teacher.request_timeout_s,
                               cpu_kv_cache_gib=config.rollout.cpu_kv_cache_gib,
                               gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                               extra_args=["--distributed-executor-backend", "uni"])


class TrainerTeacher:
    """A frozen model in the ranks; its forward runs over the step's packed micro-batches."""

    def __init__(self, model):
        self.model = model

    @classmethod
    def build(cls, config, runtime, source: TeacherSource) -> TrainerTeacher:
        from megatron_rl.model.teacher import TeacherModel

        model = TeacherModel(teacher_run_config(config, source), runtime)
        if source.checkpoint is not None:
            from megatron_rl.checkpoint.format import load_initial_weights

            load_initial_weights(model, str(source.checkpoint))  # resharded from the layout it was saved at
        else:
            from megatron_rl.bridge import load_hf_weights

            try:
                load_hf_weights(model.module, model.arch, source.config_dir)  # this rank's slices only
            except ConfigError as exc:  # raised on every rank together (the importer agrees first)
                raise ConfigError(f"{KEY}.source: the teacher's weights cannot be loaded: {exc}") from None
        return cls(model)

    def score(self, groups, experience) -> None:
        """Collective: this rank's trajectories of `experience` (a PackedStep) get teacher_logprobs
        (on the last pipeline stage, where the loss reads them)."""
        from megatron_rl.train.update import store_step_logprobs

        store_step_logprobs(self.model, experience, "teacher_logprobs", None, temperature=1.0)

    def engine(self):
        return None

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- held-out accuracy

class _DriverEngine:
    """A driver-only engine as a collective generate (what Generation calls): the driver samples,
    every rank receives the samples."""

    def __init__(self, engine, runtime, timeout_s: float):
        self.engine, self.runtime, self.timeout_s = engine, runtime, timeout_s

    def generate(self, prompts, params):
        samples = None
        if self.engine is not None:
            try:
                samples = self.engine.generate(prompts, params, timeout_s=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits for the driver
                samples = exc
        samples = self.runtime.from_driver(samples)
        if isinstance(samples, EngineError):
            raise TeacherFailed(f"the teacher's server could not sample its held-out accuracy ({KEY}.eval): "
                                f"{one_line(samples)}") from None
        if isinstance(samples, Exception):
            raise samples
        return samples


def teacher_heldout(teacher, config, heldout, encode, scorer, runtime) -> tuple[dict, str | None]:
    """Collective, once at the start: the teacher's held-out accuracy as `teacher/eval_accuracy`
    (and its reward and length), measured as the student's is (train/evaluate.py), by sampling
    from the teacher's own server. Returns (metrics, None), or ({}, why it is not measured)."""
    settings = config.rl.teacher
    if not settings.eval:
        return {}, f"{KEY}.eval is false"
    if settings.mode != "server":
        return {}, (f"{KEY}.mode=trainer: the teacher has no engine to sample from here (its held-out accuracy is "
                    f"the one measured where it was trained, or set {KEY}.mode=server)")
    if config.rollout.multi_turn:
        return {}, "a multi-turn run: the teacher's server would need the run's environments"
    if heldout is None or len(heldout) == 0:
        return {}, "the run has no held-out set"
    from megatron_rl.train.evaluate import evaluate
    from megatron_rl.train.generation import Generation

    engine = _DriverEngine(teacher.engine(), runtime, settings.request_timeout_s)
    metrics = evaluate(heldout, config.rl, config.seed, Generation(engine, encode, runtime), scorer)
    return {f"teacher/{key.removeprefix('eval/')}": value for key, value in metrics.items()
            if key in ("eval/accuracy", "eval/reward_mean", "eval/length_mean")}, None
