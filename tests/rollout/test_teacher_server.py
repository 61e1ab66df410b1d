"""On-policy distillation with the teacher behind a vLLM server (rl.teacher.mode: server): the
teacher's logprobs that every trajectory receives (train/teacher.py ServerTeacher over
rollout/teacher.py) equal transformers' logprobs of the teacher model on the same tokens.

The suite's shared tiny vLLM server (tests/conftest.py) is the teacher: it gets weights of its
own, and the student is another model, with one layer instead of two, that samples the responses.
A server whose context cannot hold the student's sequences is refused by name.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.errors import ConfigError  # noqa: E402
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine  # noqa: E402
from megatron_rl.rollout.teacher import TeacherServer  # noqa: E402
from megatron_rl.train.experience import Trajectory  # noqa: E402
from megatron_rl.train.teacher import ServerTeacher, check_served_length  # noqa: E402

pytestmark = pytest.mark.engine

PROMPTS = ["12+7=", "3+45=", "60+8="]


class OneProcess:
    """The runtime of a single process: the driver, which keeps what it hands out."""

    is_driver = True

    @staticmethod
    def from_driver(value):
        return value


def _model(model_dir, seed: int, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.2  # peaked distributions: teacher and student clearly differ
    for key, value in changes.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()


def push_checkpoint_tensors(url: str, model, tmp_path) -> None:
    """Pushes `model`'s weights under their names on disk (save_pretrained's: one tensor per
    expert), as the trainer's export does. The server is shared: the next module's trainer pushes
    in place against the names of the push before it, and transformers' in-memory names (its
    experts fused into one tensor) made that push fail in another module."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path / "teacher")
    tensors = {}
    for shard in sorted((tmp_path / "teacher").glob("*.safetensors")):
        tensors.update(load_file(shard))
    VllmServerEngine(url, name="vllm-0", staging_dir=tmp_path / "staging").update_weights(tensors.items())


def _logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_the_teacher_servers_logprobs_equal_transformers(tiny_vllm_server, tmp_path):
    from transformers import AutoTokenizer

    url, model_dir = tiny_vllm_server  # the built-in tiny model's server, shared (tests/conftest.py)
    teacher = _model(model_dir, seed=11)  # two layers
    push_checkpoint_tensors(url, teacher, tmp_path)
    student = _model(model_dir, seed=12, num_hidden_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    trajectories = []
    for index, text in enumerate(PROMPTS):
        prompt = tokenizer.encode(text)
        with torch.no_grad():
            sampled = student.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=6, min_new_tokens=6,
                                       pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        trajectories.append(Trajectory(index, prompt, sampled, [0.0] * len(sampled), False, 0.0))
    # The same sequence twice (scored once, both receive it), and three of 1004 tokens, more than
    # the server's engine step takes (2048 tokens): a prompt's logprobs come from two steps.
    first = trajectories[0]
    trajectories.append(Trajectory(3, first.prompt_ids, list(first.response_ids), [0.0] * 6, False, 0.0))
    generator = torch.Generator().manual_seed(5)
    for index in range(4, 7):
        trajectories.append(Trajectory(index, torch.randint(3, 400, (1000,), generator=generator).tolist(),
                                       [7, 8, index, 10], [0.0] * 4, False, 0.0))

    server = TeacherServer(url)
    ServerTeacher(server, OneProcess()).score([trajectories])
    worst = 0.0
    for trajectory in trajectories:
        want = _logprobs(teacher, trajectory.prompt_ids, trajectory.response_ids)
        assert trajectory.teacher_logprobs.shape == want.shape
        worst = max(worst, float((trajectory.teacher_logprobs.double() - want).abs().max()))
        student_lp = _logprobs(student, trajectory.prompt_ids, trajectory.response_ids)
        assert float((want - student_lp).abs().max()) > 0.05  # the teacher is not the student
    assert worst <= 1e-4, worst

    # The served context (1024) cannot hold a 1024-token student sequence plus the generated token.
    config = load_config(None, [f"rl.teacher.source={model_dir}", f"rl.teacher.server_url={url}"])
    assert server.max_model_len == 1024
    with pytest.raises(ConfigError, match=r"rl\.teacher\.server_url: the teacher server serves a context of 1024"):
        check_served_length(config, server.max_model_len)
    check_served_length(load_config(None, ["rollout.max_model_len=1023"]), server.max_model_len)
