"""A served teacher (rl.teacher.mode: server) that fails during a run, and how its scoring is sent.

- killed (SIGKILL) after step 1: the run stops in one line naming the step, the exit and the
  server's log, with step 1's checkpoint written and named (the trainer state at the end of step 1,
  not step 2's), as a stop signal would (train/trainer.py Trainer._service_stop);
- answering HTTP 500, a body that is not JSON, or JSON that is not a completion: one line naming
  what it answered (TeacherFailed, a TrainingStopped);
- failing while it samples its held-out accuracy: the same, on every rank; in the trainer the
  warm start's weights are checkpointed as step 0;
- scoring: a step's sequences go in one request (or a few, by request_tokens), identical ones
  scored once, each choice matched by its index.

Fake servers (fake_teacher_server.py): the behaviour under test is the client's and the trainer's;
the served logprobs' exactness against transformers is tests/rollout/test_teacher_server.py's
(a real vLLM server). The trainer here is the real Trainer.run loop with stand-ins for the model,
the engines and the checkpoint files: a real run killed the same way is in docs/faults.md.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from _support.processes import free_port
from megatron_rl.config import load_config
from megatron_rl.errors import TrainingStopped
from megatron_rl.rollout.engines.server_process import ServerProcess
from megatron_rl.rollout.protocol import EngineUnavailable
from megatron_rl.rollout.teacher import TeacherServer
from megatron_rl.train.experience import Trajectory
from megatron_rl.train.teacher import ServerTeacher, TeacherFailed, _DriverEngine

sys.path.insert(0, str(Path(__file__).parent))
from fake_teacher_server import FakeTeacher, logprob  # noqa: E402


class OneProcess:
    """The runtime of a single process: the driver, which keeps what it hands out."""

    is_driver = True

    @staticmethod
    def from_driver(value):
        return value

    @staticmethod
    def any_rank(flag):
        return flag


def trajectories(count: int = 4, repeat: int = 1) -> list[Trajectory]:
    rows = []
    for index in range(count):
        prompt, response = [5, 6, 7 + index], [20 + index, 21, 22 + index % 2]
        rows += [Trajectory(index, prompt, list(response), [0.0] * 3, False, 0.0) for _ in range(repeat)]
    return rows


def expected(trajectory: Trajectory) -> list[float]:
    tokens = trajectory.prompt_ids + trajectory.response_ids
    return [logprob(tokens[p], p) for p in range(len(trajectory.prompt_ids), len(tokens))]


@pytest.fixture
def fake():
    servers = []

    def make(mode="ok"):
        servers.append(FakeTeacher(mode).start())
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_a_steps_sequences_are_scored_in_one_request_identical_ones_once(fake):
    server = fake()
    rows = trajectories(count=32, repeat=8)  # 256 sequences, 32 distinct: a group's samples that agree
    rows.append(Trajectory(99, [5, 6], [], [], False, 0.0))  # no response: nothing to score
    ServerTeacher(TeacherServer(server.url), OneProcess()).score([rows])
    assert server.requests == 1 and server.sequences == 32
    for row in rows:
        assert row.teacher_logprobs.tolist() == pytest.approx(expected(row), abs=1e-7)

    # A step larger than one request's tokens: several requests, the same values.
    split = fake()
    teacher = TeacherServer(split.url, request_tokens=40)  # 6 tokens a sequence: 6 per request
    values = teacher.logprobs([(row.prompt_ids, row.response_ids) for row in rows])
    assert split.requests == 6 and split.sequences == 32
    assert values == [row.teacher_logprobs.tolist() for row in rows]


@pytest.mark.parametrize("mode, says", [
    ("http500", "POST /v1/completions -> HTTP 500: {\"error\": \"EngineCore encountered an issue\"}"),
    ("garbage", "POST /v1/completions answered something that is not JSON"),
    ("no_choices", "POST /v1/completions answered no choices (NoneType) for 4 sequences"),
])
def test_a_teacher_answering_an_error_or_garbage_stops_in_one_line(fake, mode, says):
    server = fake(mode)
    teacher = ServerTeacher(TeacherServer(server.url, max_retries=0), OneProcess())
    with pytest.raises(TeacherFailed) as caught:
        teacher.score([trajectories()])
    message = str(caught.value)
    assert isinstance(caught.value, TrainingStopped) and "\n" not in message
    assert message.startswith("the teacher's server could not score the step's tokens: teacher: ") and says in message, \
        message


def test_a_teacher_failing_while_sampling_its_heldout_accuracy_stops_in_one_line():
    class Dead:
        def generate(self, prompts, params, timeout_s):
            raise EngineUnavailable("teacher: cannot reach http://127.0.0.1:9: [Errno 111] Connection refused")

    with pytest.raises(TeacherFailed, match=r"could not sample its held-out accuracy \(rl\.teacher\.eval\): "
                                            r"teacher: cannot reach .* Connection refused$"):
        _DriverEngine(Dead(), OneProcess(), 30).generate([[1, 2]], None)


# --------------------------------------------------------------------------- in the trainer

class Checkpoints:
    """The checkpoint manager's calls the loop makes; a save is a directory named as a real one."""

    def __init__(self, root: Path):
        self.root, self.saves, self.run_state = root, [], None

    def after_step(self, step, state, *, stop, last):
        self.saves.append((step, dict(state), stop))
        if not stop:
            return []
        path = self.root / f"step_{step:06d}"
        path.mkdir(parents=True)
        return [SimpleNamespace(path=path, bytes=0, write_s=0.0, checksum_s=0.0, blocked_s=0.0)]

    def record_run_state(self, step, finished):
        self.run_state = (step, finished)

    def close(self, clean):
        return []


class Collector:
    """The prompt cursor moves when a step takes its rollout, as the sampler's does."""

    def __init__(self):
        self.cursor = 0

    def start(self, next_step, state):
        pass

    def state_dict(self):
        return {"sampler": {"cursor": self.cursor}}

    def close(self):
        pass


def trainer_with(teacher, tmp_path, *overrides: str):
    """The real Trainer.run loop; the model, engines and files are stand-ins."""
    from megatron_rl.train.eval_sets import TrainingEvals
    from megatron_rl.train.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.config = load_config(None, ["warm_start.steps=0", "rl.steps=3", "rl.eval_every=0", "rl.teacher.source=x",
                                        "rl.teacher.eval=false", f"output_dir={tmp_path}", *overrides])
    trainer.runtime, trainer.teacher, trainer.resumed = OneProcess(), teacher, None
    trainer.checkpoints, trainer.collector = Checkpoints(tmp_path / "checkpoints"), Collector()
    trainer.stop_signals = mock.Mock(requested=lambda runtime: None)
    trainer.policy = mock.Mock(weight_norm=lambda: 1.0)
    trainer.heldout = trainer.encode = None
    for name in ("log", "rollout", "generation", "scorer"):
        setattr(trainer, name, mock.Mock())
    trainer.sync_weights = lambda *args, **kwargs: 0
    trainer.evaluate = dict
    trainer.evals = TrainingEvals(trainer.config, [], None, trainer.runtime)  # no rl.eval sets: nothing is run
    return trainer


def test_a_teacher_server_killed_after_step_1_stops_the_run_with_step_1s_checkpoint(tmp_path):
    log = tmp_path / "logs" / "teacher-vllm.log"
    port = free_port()
    process = ServerProcess.launch([sys.executable, str(Path(__file__).parent / "fake_teacher_server.py"), str(port)],
                                   env={}, url=f"http://127.0.0.1:{port}", log_path=log, name="teacher",
                                   startup_timeout_s=60)
    server = TeacherServer(process.url, process=process, max_retries=0)
    trainer = trainer_with(ServerTeacher(server, OneProcess()), tmp_path)
    scored = []

    def rl_step(step):
        trainer.collector.cursor = step  # the step's prompts taken
        if step == 2:
            process.process.send_signal(signal.SIGKILL)
            process.process.wait(30)
        rows = trajectories()
        trainer.teacher.score([rows])
        scored.append(step)
        return {}

    trainer.rl_step = rl_step
    with pytest.raises(TrainingStopped) as caught:
        trainer.run()
    message = str(caught.value)
    assert scored == [1]
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith("step 2: the teacher's server could not score the step's tokens: teacher: server process "
                              f"exited with code -9 (killed by SIGKILL); its log: {log}. Nothing was trained on it; "
                              f"checkpoint {tmp_path / 'checkpoints' / 'step_000001'} (step 1). Continue with the same "
                              f"command (checkpoint.resume=auto)"), message
    # Step 1's save with the trainer state at its end (the cursor of step 1, not step 2's).
    assert trainer.checkpoints.saves[-1] == (1, trainer.checkpoints.saves[0][1], True)
    assert trainer.checkpoints.saves[-1][1]["sampler"] == {"cursor": 1}
    assert (tmp_path / "checkpoints" / "step_000001").is_dir() and trainer.checkpoints.run_state == (1, False)
    assert server.process is None  # the trainer's shutdown stopped what was left of it


def test_a_step_whose_checkpoint_exists_is_not_saved_again_and_a_heldout_failure_keeps_step_0(tmp_path):
    from megatron_rl.train import trainer as trainer_module

    # Saved by checkpoint.every_steps already: named, not written twice.
    failing = mock.Mock()
    trainer = trainer_with(failing, tmp_path)
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)

    def rl_step(step):
        if step == 2:
            raise TeacherFailed("the teacher's server could not score the step's tokens: teacher: gone")
        return {}

    trainer.rl_step = rl_step
    with pytest.raises(TrainingStopped, match=r"^step 2: .*teacher: gone\. .*step_000001 \(step 1\)"):
        trainer.run()
    assert [stop for _, _, stop in trainer.checkpoints.saves] == [False]

    # The held-out accuracy sampled from the teacher's server, after the warm start: step 0 is kept.
    trainer = trainer_with(failing, tmp_path / "heldout")
    gone = TeacherFailed("the teacher's server could not sample its held-out accuracy (rl.teacher.eval): teacher: gone")
    with mock.patch.object(trainer_module, "teacher_heldout", side_effect=gone), \
            pytest.raises(TrainingStopped, match=r"^measuring the teacher's held-out accuracy: .*step_000000 \(step 0\)"):
        trainer.run()
    assert [(step, stop) for step, _, stop in trainer.checkpoints.saves] == [(0, True)]


def test_a_trainer_held_teacher_whose_weights_cannot_be_loaded_is_refused_naming_the_key(tmp_path, monkeypatch):
    """mode: trainer, a Hugging Face directory whose weights the importer refuses (none there, a
    truncated file, a tensor of another shape): its one line, prefixed with the key to change."""
    import megatron_rl.bridge
    import megatron_rl.model.teacher
    from megatron_rl.bridge.importer import CheckpointMismatch
    from megatron_rl.errors import ConfigError
    from megatron_rl.train.teacher import TeacherSource, TrainerTeacher

    source = TeacherSource(tmp_path, None)

    def no_weights(module, arch, directory):
        raise CheckpointMismatch(f"{directory} holds no *.safetensors files")

    monkeypatch.setattr(megatron_rl.model.teacher, "TeacherModel", lambda config, runtime: mock.Mock())
    monkeypatch.setattr(megatron_rl.bridge, "load_hf_weights", no_weights)
    monkeypatch.setattr("megatron_rl.train.teacher.teacher_run_config", lambda config, source: config)
    with pytest.raises(ConfigError, match=rf"^rl\.teacher\.source: the teacher's weights cannot be loaded: {tmp_path} "
                                          rf"holds no \*\.safetensors files$"):
        TrainerTeacher.build(None, OneProcess(), source)
