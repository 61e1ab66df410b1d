"""`megatron-rl plan` with numbers beyond any cluster or model: refused by name in a second, in
this process (before: `--gpus 1000000000000` never returned from the divisor search, and
`num_hidden_layers: 1e30` in config.json took 60 s and 2.7 GB)."""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest

from megatron_rl import cli
from megatron_rl.model.hf_config import load_hf_config
from megatron_rl.plan.planner import _divisors


@contextmanager
def within(seconds: int):
    """TimeoutError from the block when it runs longer (what never returned before fails instead)."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_divisors_are_found_in_square_root_time():
    assert _divisors(1) == [1] and _divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and _divisors(97) == [1, 97]
    assert all(_divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 500))
    with within(10):  # a loop to 10^12 never returned
        assert len(_divisors(10**12)) == 169  # 2^12 x 5^12: 13 x 13 divisors


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "1000000000000"], "--gpus must be from 1 to 1048576, got 1000000000000"),
    (["--gpus", "8", "--gpus-per-node", "100000"], "--gpus-per-node must be from 1 to 4096, got 100000"),
    (["--gpus", "8", "--rollout-gpus", "1000000000000"], "--rollout-gpus must be from 0 to 1048576"),
])
def test_a_cluster_beyond_any_real_one_is_refused_by_name(capsys, flags, message):
    with within(30):
        assert cli.main(["plan", *flags, "--hf-config", "tiny-qwen3-moe", "device=cuda"]) == 2
    assert f"megatron-rl: configuration error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**30), ("num_experts", 10**12),
                                        ("vocab_size", 10**12), ("hidden_size", 2**40)])
def test_a_config_json_count_beyond_any_model_is_refused_by_name(tmp_path, capsys, key, value):
    raw, _ = load_hf_config("tiny-qwen3-moe")
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, **{key: value})))
    with within(30):
        assert cli.main(["plan", "--gpus", "8", "--hf-config", str(tmp_path), "device=cuda"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: {key}={value} is beyond " in err and "a typo or a damaged file" in err, err
