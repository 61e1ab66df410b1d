"""Partial rollouts (rollout.partial): a sequence continued across a weight update.

A real vLLM CPU server serves the tiny Qwen3-MoE with weights A (version 0). The asynchronous
producer sends long requests; mid-generation the weights are replaced by B (version 1) the way
the trainer does it (engines paused with mode abort, a files push, resume). Checked against
Hugging Face transformers holding A and B:

* a continued sample carries both versions, and each token's behaviour logprob is the one of
  the version it records: A's before the update, B's after (and not A's);
* the loss of that sample weighs each token by its own behaviour logprob (token-level TIS, the
  decoupled objective's importance weight), equal to a float64 re-derivation.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch

pytest.importorskip("vllm")

from megatron_rl.algorithms import recipe  # noqa: E402
from megatron_rl.algorithms.loss import policy_loss  # noqa: E402
from megatron_rl.train.async_rollout import AsyncRollout  # noqa: E402
from megatron_rl.data import PromptSampler  # noqa: E402
from megatron_rl.rollout.pool import EnginePool  # noqa: E402
from megatron_rl.rollout.protocol import SamplingParams  # noqa: E402
from megatron_rl.rollout.auth import authorization_header, rollout_token  # noqa: E402
from megatron_rl.rollout.engines.vllm_server import VllmServerEngine  # noqa: E402
from megatron_rl.train.scoring import to_trajectories  # noqa: E402

pytestmark = pytest.mark.engine

PROMPT = [1, 17, 33, 49, 65]
MAX_TOKENS = 900  # with ignore_eos: seconds of generation, so the update lands mid-sequence


def running_requests(url: str) -> int:
    """The server's own count of requests being generated (vLLM's Prometheus gauge)."""
    request = urllib.request.Request(f"{url}/metrics", headers=authorization_header(rollout_token()))
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:num_requests_running")]
    assert values, f"{url}/metrics has no vllm:num_requests_running"
    return int(sum(values))


def wait_until_generating(url: str, requests: int, timeout_s: float = 120.0) -> None:
    """Until the server reports `requests` requests running: the abort must find them mid-sequence.
    A fixed sleep made the verdict depend on the machine (requests not yet running, or finished)."""
    deadline = time.monotonic() + timeout_s
    running = 0
    while time.monotonic() < deadline:
        running = running_requests(url)
        if running >= requests:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server did not run {requests} requests within {timeout_s:.0f} s (last: {running})")


def _hf_model(model_dir, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.2  # peaked distributions: the two versions differ clearly
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()


def _logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_a_sequence_continued_across_a_weight_update_carries_two_versions(tiny_vllm_server, tmp_path):
    url, model_dir = tiny_vllm_server  # the built-in tiny model's server, shared (tests/conftest.py)
    weights_a, weights_b = _hf_model(model_dir, 0), _hf_model(model_dir, 1)
    engine = VllmServerEngine(url, name="vllm-0", staging_dir=tmp_path / "staging")
    engine.update_weights(weights_a.state_dict().items())  # version 0
    pool = EnginePool([engine])
    producer = AsyncRollout(
        pool=pool, sampler=PromptSampler(1, 1, seed=0), encode=lambda index: list(PROMPT),
        score_group=lambda index, samples: (to_trajectories([samples], [1.0] * len(samples))[0], {}),
        params=SamplingParams(n=4, temperature=1.0, max_tokens=MAX_TOKENS, seed=3, partial=True, ignore_eos=True),
        wanted=1, max_staleness=1, partial=True, dynamic_sampling=False, max_groups=1, overgeneration=0,
        timeout_s=300, last_step=1)
    try:
        producer.start(1, version=0)
        wait_until_generating(url, requests=4)
        producer.before_push(1)  # partial: the engines abort their requests, which return what they have
        engine.update_weights(weights_b.state_dict().items())  # version 1
        pool.resume()
        producer.pushed(1)
        batch = producer.take(1)
    finally:
        producer.close()

    (group,) = batch.groups
    continued = [t for t in group if 0 in t.versions and 1 in t.versions]
    assert continued, f"no sample was continued across the update: {[sorted(set(t.versions)) for t in group]}"
    for t in group:
        assert len(t.versions) == len(t.response_ids) == len(t.rollout_logprobs)
        assert t.versions == sorted(t.versions)  # the old version's tokens first
        assert len(t.response_ids) == MAX_TOKENS and t.prompt_ids == PROMPT  # continued to the full budget

    t = continued[0]
    cut = t.versions.index(1)
    behaviour = torch.tensor(t.rollout_logprobs, dtype=torch.float64)
    under_a = _logprobs(weights_a, PROMPT, t.response_ids)
    under_b = _logprobs(weights_b, PROMPT, t.response_ids)
    # Each token's behaviour logprob is that of the version it records.
    assert (behaviour[:cut] - under_a[:cut]).abs().max() < 1e-3
    assert (behaviour[cut:] - under_b[cut:]).abs().max() < 1e-3
    assert (behaviour[cut:] - under_a[cut:]).abs().max() > 1e-2  # the versions really differ there

    # The loss with the trainer holding B (the proximal policy): each token weighed by its own
    # behaviour logprob, pi_B / pi_behaviour, truncated at 2 (token-level TIS).
    loss_config = recipe("dapo", tis_level="token", tis_upper=2.0).loss
    current = under_b.float()[None].requires_grad_()
    rollout = behaviour.float()[None]
    loss, metrics = policy_loss(current, current.detach(), torch.tensor([1.0]), torch.ones_like(rollout, dtype=torch.bool),
                                loss_config, rollout_logprobs=rollout)
    weights = torch.exp(under_b - behaviour).clamp(max=2.0)
    assert abs(float(loss) - float(-weights.mean())) < 1e-5  # ratio 1, advantage 1: -mean_t w_t
    assert (weights[cut:] - 1).abs().max() < 1e-3  # B's own tokens weigh 1
    flat = torch.exp(under_b - under_a).clamp(max=2.0)  # had every token counted as version 0 ...
    assert abs(float(loss) - float(-flat.mean())) > 1e-3  # ... the loss would differ
