"""`megatron-rl eval`: checkpoints on prompt sets, with pass@k, avg@n, maj@k and greedy accuracy.

    megatron-rl eval --ckpt runs/gsm8k --set gsm8k=data/gsm8k_test.jsonl --n 16 --out eval/gsm8k
    megatron-rl eval --ckpt runs/a --ckpt runs/b --set hard=data/hard.parquet set.hard.reward=math

Order: everything the command line names is checked first, without torch (`prepare`: the sets
read and their fields and rewards checked, every --ckpt told apart, the models compared, the
output directory tried); then one runtime and one rollout engine (the project's: vLLM colocated,
or rollout.server_urls), and per checkpoint a policy built and loaded as `checkpoint.init_from`
loads it, its weights pushed into the engine as the trainer pushes them, and every set run by
evaluation/runner.py with the same prompts and seeds. The report (evaluation/report.py) goes to
--out: eval.json, eval.md, pass_at_k.png (an earlier report there is replaced only with
--overwrite; a training run's directory is refused); the tables (and the differences from the
first checkpoint) are printed.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.checkpoints import CheckpointSource, check_same_model, checkpoint_config, identify
from megatron_rl.config.evaluation import HELDOUT, MAX_SAMPLES
from megatron_rl.evaluation.recorded_rewards import check_recorded_rewards
from megatron_rl.evaluation.set_rewards import set_rewards
from megatron_rl.evaluation.sets import (LoadedSet, SamplingDefaults, SetNaming, SetSpec, check_prompt_lengths,
                                         is_set_option, load_set, parse_sets)

DEFAULT_OUT = "eval"
REPORT_FILES = ("eval.json", "eval.md", "pass_at_k.png")


def add_parser(commands) -> None:
    """The `eval` subcommand on the CLI's subparsers (cli.py)."""
    sub = commands.add_parser(
        "eval", help="pass@k, avg@n, maj@k and greedy accuracy of checkpoints on prompt sets",
        description="Evaluate one or more checkpoints on prompt sets with the project's rollout engine and "
                    "reward functions. Several --ckpt: the same prompts and sample seeds for each, and their "
                    "differences with paired bootstrap intervals.")
    sub.add_argument("--ckpt", action="append", required=True, metavar="PATH",
                     help="a run directory (its latest checkpoint), a training checkpoint, a converted Megatron "
                          "checkpoint or a Hugging Face directory (repeatable: compared with the first)")
    sub.add_argument("--label", action="append", default=[], metavar="NAME",
                     help="the report's name for each --ckpt, in order (default: the directory's name)")
    sub.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=PATH",
                     help="a prompt set: .jsonl / .parquet / .json / .csv / .arrow file or a datasets save_to_disk "
                          "directory (repeatable); per-set options as set.NAME.OPTION=VALUE")
    sub.add_argument("--sets", dest="sets_file", metavar="FILE",
                     help="sets as YAML: {NAME: {path: PATH, OPTION: VALUE, ...}}")
    sub.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    sub.add_argument("--k", metavar="K[,K...]",
                     help="the ks of pass@k and maj@k of every set without its own set.NAME.k, each <= the set's n "
                          "(default: 1, 2, 4, ... below n, and n)")
    sub.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    sub.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p (default 1.0)")
    sub.add_argument("--max-tokens", type=int, help="response token budget (default: the run's rl.max_response_tokens)")
    sub.add_argument("--prompts", type=int, help="the first N prompts of each set only")
    sub.add_argument("--no-greedy", action="store_true", help="no greedy (temperature 0) response per prompt")
    sub.add_argument("--seed", type=int, default=1234,
                     help="base seed of the samples: prompt i of a set gets the same seed for every checkpoint")
    sub.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default: {DEFAULT_OUT}); one that holds "
                                                         "an earlier report is refused unless --overwrite")
    sub.add_argument("--overwrite", action="store_true",
                     help="replace the report an earlier evaluation wrote into --out")
    sub.add_argument("--trust-recorded-rewards", action="store_true",
                     help="score with each --ckpt's run's recorded rewards as they are (its reward functions, "
                          "params, weights and limits), which a set without its own reward uses; without it, "
                          "eval refuses recorded rewards that run code of their own or exceed its scoring bounds")
    sub.add_argument("--config", help="YAML recipe for a checkpoint no run wrote, and for the engine "
                                      "(default: the built-in tiny default)")
    sub.add_argument("overrides", nargs="*", metavar="key=value",
                     help="config overrides (rollout.*, data.*, rewards.*, ...; over a run's own) and per-set "
                          "options set.NAME.OPTION=VALUE (reward, reward_params.KEY, n, k, temperature, top_p, greedy, "
                          "max_tokens, prompts, threshold, split, prompt_key, answer_key, columns.FIELD, "
                          "other_columns, loader, prompt_format, system_prompt)")
    sub.add_argument("--verbose", action="store_true",
                     help="show dependencies' warnings and log lines (hidden by default)")


@dataclass
class EvalSet:
    """One set as every checkpoint runs it."""

    loaded: LoadedSet
    rewards: object  # rewards.RewardConfig
    max_tokens: int


@dataclass
class EvalPlan:
    """Everything checked before any engine starts."""

    sources: list[CheckpointSource]
    configs: list  # one RunConfig per checkpoint
    sets: list[EvalSet]
    ks: dict[str, list[int] | None]  # each set's ks of pass@k and maj@k by name (None: default_ks(n))
    seed: int
    out: Path
    record: dict  # the evaluation's settings, for eval.json


def run(args) -> int:
    plan = prepare(args)
    checkpoints = evaluate(plan)
    if checkpoints is None:  # not the driver
        return 0
    from megatron_rl.evaluation.report import render_markdown, write_report

    paths = write_report(plan.out, checkpoints, plan.record, plan.ks, seed=plan.seed)
    report = json.loads(Path(paths["json"]).read_text())
    print(render_markdown(report, examples=0).rstrip())  # the figures and, with several checkpoints, the differences
    print(f"report: {paths['md']} (figures: {paths['json']}; pass@k: {paths['png']})")
    return 0


# ---- before any engine ------------------------------------------------------------------------


def prepare(args) -> EvalPlan:
    """Every check that needs no engine, in milliseconds to seconds: ConfigError naming the set,
    the checkpoint, the option or the file otherwise."""
    from megatron_rl.config import load_config, to_dict

    ks = _parse_ks(args.k)
    defaults = SamplingDefaults(n=args.n, k=ks, temperature=args.temperature, top_p=args.top_p,
                                greedy=not args.no_greedy, max_tokens=args.max_tokens, prompts=args.prompts)
    for flag, value in (("--n", args.n), ("--max-tokens", args.max_tokens), ("--prompts", args.prompts)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.n > MAX_SAMPLES:  # rl.eval.n's bound: a typo's 10**8 samples per prompt reached the engine
        raise ConfigError(f"--n must be at most {MAX_SAMPLES} samples per prompt, got {args.n}")
    if args.seed < 0:  # numpy's bootstrap generator refused it, but only when the report was written
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    options = [item for item in args.overrides if is_set_option(item)]
    overrides = [item for item in args.overrides if not is_set_option(item)]
    specs = parse_sets(args.sets, args.sets_file, options, defaults)
    out = Path(args.out)
    _check_out(out, overwrite=args.overwrite)
    base = to_dict(load_config(args.config, overrides))
    labels = _labels(args.ckpt, args.label)
    sources = [identify(path, label) for path, label in zip(args.ckpt, labels)]
    configs = [checkpoint_config(source, base, overrides, str(out)) for source in sources]
    check_same_model(sources, configs)
    recorded = RecordedRewards(overrides, trusted=args.trust_recorded_rewards)
    sets = [_eval_set(_load_set(spec, sources, configs), sources, configs, recorded) for spec in specs]
    record = {"checkpoints": [dataclasses.asdict(s) | {"resolved": str(s.resolved)} for s in sources],
              "sets": [dataclasses.asdict(s.loaded.spec) | {"prompts_read": len(s.loaded.records),
                                                            "max_tokens": s.max_tokens,
                                                            "rewards": _json_ready(s.rewards)} for s in sets],
              "seed": args.seed, "ks": ks, "overrides": list(args.overrides), "config": args.config,
              "rollout": base["rollout"]}
    for entry in record["checkpoints"]:
        entry.pop("run_config", None)  # in the checkpoint itself; eval.json names it
    _check_finite(record)
    _check_engine(configs[0])  # last: it imports torch (seconds), the checks above do not
    _check_prompt_lengths(sets, configs)
    return EvalPlan(sources, configs, sets, {s.loaded.spec.name: s.loaded.spec.k for s in sets}, args.seed, out,
                    record)


def _check_finite(record: dict) -> None:
    """eval.json is strict JSON (no NaN or Infinity), written after every checkpoint is evaluated:
    a non-finite number among the settings it records (a set's reward_params, a run's reward
    params) failed the command only then, losing the evaluation. Refused now, by its place."""
    parts = [(f"set {entry['name']!r}: ", entry) for entry in record["sets"]]
    parts += [(f"--ckpt {entry['path']}: ", entry) for entry in record["checkpoints"]]
    parts.append(("", {key: value for key, value in record.items() if key not in ("sets", "checkpoints")}))
    for where, part in parts:
        found = _first_non_finite(part, "")
        if found is not None:
            place, value = found
            raise ConfigError(f"{where}{place} is {value}, not a finite number; the report (eval.json, strict JSON) "
                              "could not record it: give a finite value")


def _first_non_finite(value, place: str):
    if isinstance(value, float) and not math.isfinite(value):
        return place.lstrip("."), value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _first_non_finite(item, f"{place}[{key}]" if isinstance(key, int) else f"{place}.{key}")
        if found is not None:
            return found
    return None


def _parse_ks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--k {text!r} must be integers separated by commas, e.g. --k 1,4,16") from None


def _labels(paths: list[str], given: list[str]) -> list[str]:
    if given and len(given) != len(paths):
        raise ConfigError(f"--label is given {len(given)} time(s) for {len(paths)} --ckpt; give one per --ckpt or none")
    labels = list(given) or [Path(path.rstrip("/")).name or path for path in paths]
    if not given:  # the same directory name twice (runs/a/hf_model, runs/b/hf_model): with its parent's
        labels = [label if labels.count(label) == 1 else "/".join(Path(path.rstrip("/")).parts[-2:])
                  for label, path in zip(labels, paths)]
        labels = [label if labels.count(label) == 1 else f"{label}#{labels[:i + 1].count(label)}"
                  for i, label in enumerate(labels)]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--label: two checkpoints are both named {next(x for x in labels if labels.count(x) > 1)!r}")
    return labels


def _check_out(out: Path, overwrite: bool = False) -> None:
    """The report directory is eval's own and its files can be written (train/output_paths'
    probes). Nothing already written is lost: an earlier evaluation's report is replaced only
    with --overwrite (before, a second eval into the same --out replaced it without a word), and a
    training run's directory is refused even then (eval writes engine_model/, which is the run's:
    a live run reads its engine from there)."""
    from megatron_rl.train.output_paths import RUN_FILES, directory_problem, file_problem
    from megatron_rl.train.run_lock import LOCK

    if out.is_dir():
        run_files = [name for name in (*RUN_FILES, LOCK, "checkpoints") if (out / name).exists()]
        if run_files:
            raise ConfigError(f"--out {out} is a training run's directory (it holds {', '.join(run_files)}): eval "
                              f"would rewrite the run's engine_model/ there; give the report a directory of its own, "
                              f"e.g. --out {out / 'eval'} (--overwrite does not change that)")
        earlier = [name for name in REPORT_FILES if (out / name).exists()]
        if earlier and not overwrite:
            raise ConfigError(f"--out {out} already holds {', '.join(earlier)}, an earlier evaluation's report: pass "
                              "another --out to keep it, or --overwrite to replace it")
    for directory in (out, out / "engine_model"):
        problem = directory_problem(directory)
        if problem is not None:
            raise ConfigError(f"--out {out}: cannot write {directory}: {problem}; make it writable or pass another --out")
    for name in REPORT_FILES:
        problem = file_problem(out / name)
        if problem is not None:
            raise ConfigError(f"--out {out}: cannot write {out / name}: {problem}; pass another --out")


def _check_engine(config) -> None:
    from megatron_rl.rollout.factory import check_engine_installed
    from megatron_rl.train.preflight import check_layout_and_paths

    check_layout_and_paths(config)
    check_engine_installed(config)


def _check_prompt_lengths(sets: list[EvalSet], configs: list) -> None:
    """Every prompt of every set fits the engine's context with its response budget, encoded as
    each checkpoint's prompt format encodes it (train/preflight's count)."""
    from megatron_rl.train.preflight import run_tokenizer

    tokenizer, context = run_tokenizer(configs[0]), configs[0].rollout.max_model_len
    for item in sets:
        spec = item.loaded.spec
        formats = {(spec.prompt_format or c.data.prompt_format,
                    spec.system_prompt if spec.system_prompt is not None else c.data.system_prompt) for c in configs}
        for prompt_format, system_prompt in sorted(formats, key=str):
            data = dataclasses.replace(configs[0].data, prompt_format=prompt_format, system_prompt=system_prompt)
            check_prompt_lengths(item.loaded, tokenizer, data, context, item.max_tokens, SetNaming.command(spec.name))


def _load_set(spec: SetSpec, sources: list[CheckpointSource], configs: list) -> LoadedSet:
    """The set as the first checkpoint's run reads it. `heldout` is each checkpoint's run's
    held-out set, which must then be one set for all (the same prompts, answers and fields)."""
    loaded = load_set(spec, configs[0].data)
    if spec.path != HELDOUT:
        return loaded
    rows = [(r.prompt, r.answer, r.metadata) for r in loaded.records]
    for source, config in zip(sources[1:], configs[1:]):
        other = load_set(spec, config.data)
        if [(r.prompt, r.answer, r.metadata) for r in other.records] != rows:
            raise ConfigError(f"set {spec.name!r}: {HELDOUT!r} names each checkpoint's run's held-out set, and --ckpt "
                              f"{sources[0].path} ({loaded.source}, {len(loaded.records)} prompts) and --ckpt "
                              f"{source.path} ({other.source}, {len(other.records)} prompts) have different ones; "
                              "evaluate them on one set's file (--set NAME=PATH) or in separate runs")
    return loaded


@dataclass(frozen=True)
class RecordedRewards:
    """What the command says about the checkpoints' recorded rewards: its key=value overrides (a
    rewards.KEY of the user's is taken as it is) and --trust-recorded-rewards."""

    overrides: list[str]
    trusted: bool


def _eval_set(loaded: LoadedSet, sources: list[CheckpointSource], configs: list, recorded: RecordedRewards) -> EvalSet:
    """The set's reward (its own, its format's, else the checkpoints' run's, which must agree),
    what it takes from a checkpoint's recorded rewards checked before anything of them is
    resolved, resolved now, and its token budget."""
    spec = loaded.spec
    runs = spec.reward is None and loaded.rewards is None  # scored with the run's terms
    if runs:
        for source, config in zip(sources[1:], configs[1:]):
            if config.rewards != configs[0].rewards:
                raise ConfigError(f"set {spec.name!r}: --ckpt {sources[0].path} and --ckpt {source.path} come with "
                                  "different rewards (their runs' rewards.terms): name the set's with "
                                  f"set.{spec.name}.reward=NAME so that both are scored alike")
    # A HumanEval-format set without a reward of its own takes nothing of the run's rewards; an own reward its limits.
    if spec.reward is not None or loaded.rewards is None:
        for source, config in zip(sources, configs) if runs else [(sources[0], configs[0])]:
            check_recorded_rewards(source, config.rewards, recorded.overrides, spec.name, terms_used=runs,
                                   trusted=recorded.trusted)
    rewards = set_rewards(loaded, configs[0].rewards, SetNaming.command(spec.name))
    return EvalSet(loaded, rewards, spec.max_tokens or configs[0].rl.max_response_tokens)


def _json_ready(value):
    return json.loads(json.dumps(dataclasses.asdict(value), default=str))


# ---- the engine --------------------------------------------------------------------------------


def evaluate(plan: EvalPlan):
    """Collective: every checkpoint on every set, through one runtime and one engine. Returns the
    report's CheckpointEvals on the driver, None elsewhere."""
    from megatron_rl.runtime import start_runtime

    runtime = start_runtime(plan.configs[0])
    try:
        return _evaluate(plan, runtime)
    finally:
        runtime.shutdown()


def _evaluate(plan: EvalPlan, runtime):
    from megatron_rl.evaluation.report import CheckpointEval
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.engine_model import load_engine_tokenizer, write_engine_model_dir
    from megatron_rl.train.scoring import GroupScorer

    engine_dir = plan.out / "engine_model"
    if runtime.is_driver:
        write_engine_model_dir(plan.configs[0], engine_dir)
    runtime.barrier()
    tokenizer = load_engine_tokenizer(engine_dir)
    rollout = RolloutClient(plan.configs[0], engine_dir, master_addr=runtime.launch.master_addr,
                            local_rank=runtime.launch.local_rank, seed=plan.configs[0].seed)
    scorers = [GroupScorer(item.rewards, tokenizer, runtime) for item in plan.sets]
    evaluated = []
    try:
        for source, config in zip(plan.sources, plan.configs):
            _load_and_push(config, runtime, rollout)
            outcomes = [_run_set(item, scorer, source, config, plan, tokenizer, engine_dir, runtime, rollout)
                        for item, scorer in zip(plan.sets, scorers)]
            evaluated.append(CheckpointEval(source.label, source.path, source.run_dir, source.step, outcomes))
    finally:
        for scorer in scorers:
            scorer.close()
        rollout.shutdown()
    return evaluated if runtime.is_driver else None


def _load_and_push(config, runtime, rollout) -> None:
    """Collective: the checkpoint into a policy built for it (as checkpoint.init_from loads one,
    LoRA adapters included), its weights into the engine (merged), the policy released."""
    from megatron_rl.checkpoint.format import load_initial_weights, pin_checkpoint_vocab
    from megatron_rl.model.policy import Policy

    policy = Policy(pin_checkpoint_vocab(config), runtime, total_steps=1)
    load_initial_weights(policy, config.checkpoint.init_from)
    rollout.sync_weights(policy.module, policy.arch)
    del policy
    gc.collect()  # its weights and optimizer state before the next checkpoint's are built


def _run_set(item: EvalSet, scorer, source: CheckpointSource, config, plan: EvalPlan, tokenizer, engine_dir,
             runtime, rollout):
    from megatron_rl.data import encode_prompt
    from megatron_rl.evaluation.progress import PromptProgress
    from megatron_rl.evaluation.runner import evaluate_set
    from megatron_rl.rollout.protocol import SamplingParams
    from megatron_rl.train.generation import Generation

    spec = item.loaded.spec
    data = config.data  # the checkpoint's prompt format, unless the set names its own
    prompt_format = spec.prompt_format or data.prompt_format
    system_prompt = spec.system_prompt if spec.system_prompt is not None else data.system_prompt
    encode = functools.partial(encode_prompt, tokenizer, prompt_format=prompt_format, system_prompt=system_prompt)
    set_config = dataclasses.replace(config, data=dataclasses.replace(data, prompt_format=prompt_format,
                                                                      system_prompt=system_prompt))
    generation = Generation.build(set_config, tokenizer, engine_dir, runtime, rollout, encode)
    params = SamplingParams(n=spec.n, temperature=spec.temperature, top_p=spec.top_p, max_tokens=item.max_tokens,
                            seed=plan.seed)
    per_prompt = f"{spec.n} samples" + (" + greedy" if spec.greedy else "")
    progress = PromptProgress(source.label, spec.name, per_prompt, enabled=runtime.is_driver)
    try:
        outcome = evaluate_set(item.loaded.records, generation=generation, scorer=scorer, params=params,
                               name=spec.name, path=item.loaded.source, greedy=spec.greedy, threshold=spec.threshold,
                               keep_texts=3, progress=progress)
    finally:
        generation.close()
    progress.finish(len(item.loaded.records))
    return outcome

