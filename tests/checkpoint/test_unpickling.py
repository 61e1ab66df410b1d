"""Nothing in a checkpoint is unpickled as code (checkpoint/unpickling.py): a crafted RNG state,
torch_dist index or pickled object among the weights is refused by name before anything loads,
and its payload never runs. In this process, on files of a few kilobytes: milliseconds each."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_rl.checkpoint.format import check_weight_files
from megatron_rl.checkpoint.manager import check_run_directory
from megatron_rl.checkpoint.store import STATE, STATE_VERSION, capture_rng, restore_rng, write_manifest
from megatron_rl.checkpoint.unpickling import read_rng_state
from megatron_rl.config import load_config, to_dict
from megatron_rl.errors import ConfigError


class Payload:
    """Unpickled, it calls open(path, "w"): the file appearing is the payload having run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def tiny_torch_dist(directory, **objects) -> None:
    """A torch_dist directory as torch.distributed.checkpoint writes it: a tensor, plus `objects`
    (pickled into the .distcp file, as Megatron-Core's extra states are)."""
    dcp.save({"weight": torch.arange(6.0), **objects}, checkpoint_id=str(directory), no_dist=True)


@pytest.fixture
def resumable(tmp_path):
    """A run directory whose one checkpoint would be resumed: a genuine RNG state and weights."""
    config = load_config(None, [f"output_dir={tmp_path / 'run'}"])
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    (step / "rng").mkdir(parents=True)
    torch.save(capture_rng(), step / "rng" / "rank_00000.pt")
    tiny_torch_dist(step / "weights", extra={"lr": 0.1})
    (step / STATE).write_text(json.dumps({"step": 2, "version": STATE_VERSION, "config": to_dict(config)}))
    write_manifest(step, step=2)  # the store's own manifest: checksums agree with the files
    return config, step


def test_a_crafted_rng_state_is_refused_on_resume_and_its_payload_never_runs(resumable, tmp_path):
    config, step = resumable
    check_run_directory(config)  # the genuine checkpoint resumes
    ran = tmp_path / "payload-ran"
    rng_file = step / "rng" / "rank_00000.pt"
    torch.save({**capture_rng(), "python": Payload(ran)}, rng_file)
    write_manifest(step, step=2)  # CRCs recomputed: the manifest cannot tell
    with pytest.raises(ConfigError, match=r"rank_00000\.pt: refused: it holds the callables \['\w+\.open'\]"):
        check_run_directory(config)
    with pytest.raises(ConfigError, match="refused"):
        read_rng_state(rng_file)  # what load_checkpoint reads it with
    assert not ran.exists()
    torch.load(rng_file, weights_only=False)  # how it was read before: the payload runs
    assert ran.exists()


@pytest.mark.parametrize("where", ["index", "pickled object"])
def test_a_torch_dist_naming_a_callable_is_refused_and_nothing_runs(tmp_path, where):
    weights, ran = tmp_path / "weights", tmp_path / "payload-ran"
    tiny_torch_dist(weights, extra={"lr": 0.1})
    check_weight_files(weights)  # genuine: accepted
    if where == "index":
        (weights / ".metadata").write_bytes(__import__("pickle").dumps(Payload(ran)))
        expected = r"\.metadata: refused: it holds the callable \w+\.open"
    else:
        tiny_torch_dist(weights, extra=Payload(ran))
        expected = r"__0_0\.distcp: refused: it holds an object extra naming the callables \['\w+\.open'\]"
    with pytest.raises(ConfigError, match=expected):
        check_weight_files(weights)
    assert not ran.exists()
    if where == "pickled object":  # torch.distributed.checkpoint's own load would have run it
        dcp.load({"weight": torch.empty(6), "extra": None}, checkpoint_id=str(weights), no_dist=True)
        assert ran.exists()


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _legacy_capture() -> dict:
    """The RNG state as checkpoints written before the plain format hold it (numpy's as arrays)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


@pytest.mark.parametrize("capture", [capture_rng, _legacy_capture])
def test_rng_state_round_trips_through_weights_only_loading(tmp_path, capture):
    torch.save(capture(), tmp_path / "rng.pt")
    expected = _draws()
    _draws()  # move every generator on
    restore_rng(read_rng_state(tmp_path / "rng.pt"))
    assert _draws() == expected
