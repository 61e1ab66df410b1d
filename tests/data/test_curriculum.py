"""The prompt curriculum (data.sampler: curriculum): bands, weighted draws, pauses, retirement, the
exhausted-pool rule, exact resume; and the uniform sampler left as it was."""

from __future__ import annotations

import json
import random

import pytest

from megatron_rl.config import load_config

from megatron_rl.errors import ConfigError
from megatron_rl.data import CurriculumConfig, CurriculumSampler, DataConfig, PromptSampler, build_sampler
from megatron_rl.data.curriculum import band_of

BANDS = ["unseen", "0-10", "10-30", "30-70", "70-90", "90-100"]
SHARE_KEYS = [f"data/band_share/{band}" for band in BANDS]


def group(successes: int, size: int = 8) -> list[float]:
    return [1.0] * successes + [0.0] * (size - successes)


def sampler(num_prompts=10, batch_size=2, seed=0, **config) -> CurriculumSampler:
    return CurriculumSampler(num_prompts, batch_size, seed=seed, config=CurriculumConfig(**config))


@pytest.mark.parametrize("successes, samples, band", [
    (0, 10, "0-10"), (1, 11, "0-10"), (1, 10, "10-30"), (2, 10, "10-30"), (3, 10, "30-70"),
    (7, 11, "30-70"), (7, 10, "70-90"), (8, 10, "70-90"), (9, 10, "90-100"), (10, 10, "90-100"),
    (1, 8, "10-30"), (7, 8, "70-90"), (0, 0, "unseen")])
def test_band_edges_lower_inclusive(successes, samples, band):
    assert band_of(successes, samples) == band


def test_estimate_counts_from_min_samples_over_a_rolling_window():
    s = sampler(window=8, min_samples=8, pause_steps=0, retire=False)
    s.observe(0, group(3, 7))
    assert s.band_metrics([0])["data/band_share/unseen"] == 1.0  # 7 < min_samples outcomes
    s.observe(0, [1.0])
    assert s.band_metrics([0])["data/band_share/30-70"] == 1.0  # 4/8
    s.observe(0, [0.49, 0.5, 0.5, 0.5])  # successes are rewards >= 0.5; the 4 oldest leave
    assert s.state_dict()["windows"]["0"] == "00010111"  # oldest first
    assert s.band_metrics([0])["data/band_share/30-70"] == 1.0


def test_draws_favour_the_30_70_band_by_the_weights():
    s = sampler(num_prompts=40, batch_size=1, seed=3, pause_steps=0, retire=False)
    bands = {}
    for index in range(40):  # 10 prompts each: 10-30, 30-70, 70-90, unseen (weights 1, 4, 1, 1)
        kind = index % 4
        if kind < 3:
            s.observe(index, group((2, 4, 6)[kind]))
        bands[index] = ("10-30", "30-70", "70-90", "unseen")[kind]
    counts = dict.fromkeys(BANDS, 0)
    for _ in range(2000):
        (index,) = s.next_batch()
        counts[bands[index]] += 1
        s.step()
    assert counts["30-70"] / 2000 == pytest.approx(4 / 7, abs=0.04)
    for band in ("10-30", "70-90", "unseen"):
        assert counts[band] / 2000 == pytest.approx(1 / 7, abs=0.03)


def test_zero_to_ten_percent_prompts_pause_then_come_back_unseen():
    s = sampler(num_prompts=10, batch_size=3, pause_steps=3)
    s.observe(4, group(0))
    drawn = set()
    for _ in range(3):
        assert s.band_metrics([])["data/curriculum/paused_prompts"] == 1.0
        drawn.update(s.next_batch())
        s.step()
    assert 4 not in drawn and len(drawn) > 3
    state = s.state_dict()
    assert state["paused"] == {} and "4" not in state["windows"]  # back, with a fresh window
    assert any(4 in s.next_batch() for _ in range(20) if s.step() is None)


def test_pause_steps_null_is_one_epoch_and_zero_never_pauses():
    assert sampler(num_prompts=10, batch_size=3).pause_steps == 4
    s = sampler(pause_steps=0)
    s.observe(1, group(0))
    assert s.band_metrics([1])["data/curriculum/paused_prompts"] == 0.0


def test_ninety_to_hundred_percent_prompts_retire_for_good():
    s = sampler(num_prompts=10, batch_size=3)
    s.observe(7, group(8))
    s.observe(2, group(7))  # 87.5%: 70-90, stays
    for _ in range(40):
        assert 7 not in s.next_batch()
        s.step()
    assert s.state_dict()["retired"] == [7]


def test_exhausted_pool_unpauses_earliest_first_then_draws_retired_uniformly():
    s = sampler(num_prompts=5, batch_size=3, pause_steps=10)
    s.observe(0, group(8))  # retired
    s.observe(3, group(0))  # paused until step 10
    s.step()
    s.observe(1, group(0))  # paused until step 11
    s.observe(4, group(0))  # paused until step 11
    assert s.take(3)[0] == 2  # the only active prompt first, then the earliest pauses
    assert s.state_dict()["paused"] == {"4": 11}  # 3 (earliest) and 1 (tie: lower index) came back
    assert sorted(s.take(1)) == [4]
    assert s.take(1) == [0]  # only the retired prompt is left this step
    metrics = s.band_metrics([2, 3, 1, 4, 0])
    assert (metrics["data/curriculum/unpaused_early"], metrics["data/curriculum/fallback_draws"]) == (3.0, 1.0)
    assert metrics["data/band_share/unseen"] == 0.8 and metrics["data/band_share/90-100"] == 0.2
    assert metrics["data/curriculum/all_retired"] == 0.0 and s.pop_notices() == []


def test_every_prompt_retired_falls_back_to_uniform_and_says_so_once():
    s = sampler(num_prompts=4, batch_size=4)
    for index in range(4):
        s.observe(index, group(8))
    assert sorted(s.next_batch()) == [0, 1, 2, 3]
    (notice,) = s.pop_notices()
    assert "every one of the 4 prompts is retired" in notice
    assert s.band_metrics([0])["data/curriculum/all_retired"] == 1.0
    assert len(s.take(6)) == 6  # everything drawn this step: prompts repeat
    s.step()
    assert sorted(s.next_batch()) == [0, 1, 2, 3] and s.pop_notices() == []


def test_when_exhausted_uniform_keeps_pauses():
    s = sampler(num_prompts=3, batch_size=3, pause_steps=10, when_exhausted="uniform")
    s.observe(0, group(0))
    s.observe(1, group(8))
    assert sorted(s.next_batch()) == [0, 1, 2]
    state = s.state_dict()
    assert state["paused"] == {"0": 10} and state["retired"] == [1] and state["fallback_draws"] == 2


def run(s: CurriculumSampler, steps: int, rng: random.Random) -> list:
    """A trainer-like loop: a batch, a refill, every group observed, metrics, the step's end."""
    trace = []
    for _ in range(steps):
        indices = s.next_batch()
        indices += s.take(rng.randrange(3))
        for index in indices:
            p = (index % 11) / 10
            s.observe(index, [float(rng.random() < p) for _ in range(4)])
        trace.append((indices, s.band_metrics(indices)))
        s.step()
    return trace


def test_state_round_trip_mid_step_continues_exactly():
    config = dict(window=6, min_samples=4, pause_steps=3)
    original = sampler(num_prompts=30, batch_size=5, seed=11, **config)
    run(original, 12, random.Random(0))
    first = original.next_batch()
    original.observe(first[0], group(0, 4))  # mid-step: exclusion, drawn bands and a new pause pending
    state = json.loads(json.dumps(original.state_dict()))
    expected = (original.take(4), run(original, 15, random.Random(1)), original.state_dict())
    restored = sampler(num_prompts=30, batch_size=5, seed=999, **config)  # the state's seed wins
    restored.load_state_dict(state)
    assert (restored.take(4), run(restored, 15, random.Random(1)), restored.state_dict()) == expected
    assert any(m["data/curriculum/retired_prompts"] for _, m in expected[1])  # the run used every status
    assert any(m["data/curriculum/paused_prompts"] for _, m in expected[1])


def test_same_calls_same_draws_and_seed_dependence():
    traces = [run(sampler(num_prompts=50, batch_size=8, seed=seed), 6, random.Random(5)) for seed in (1, 1, 2)]
    assert traces[0] == traces[1] and traces[0] != traces[2]


def test_band_metrics_fixed_keys_sum_to_one():
    s = sampler(num_prompts=20, batch_size=6, pause_steps=2)
    for indices, metrics in run(s, 8, random.Random(2)):
        shares = [metrics[key] for key in SHARE_KEYS]
        assert sum(shares) == pytest.approx(1.0) and set(SHARE_KEYS) <= set(metrics)
    assert sum(s.band_metrics([])[key] for key in SHARE_KEYS) == 0.0


def test_uniform_sampler_unchanged_and_states_do_not_cross():
    uniform = build_sampler(DataConfig(), 10, 4, seed=0)
    assert type(uniform) is PromptSampler
    assert uniform.take(12) == [2, 9, 7, 4, 0, 1, 5, 6, 8, 3, 6, 7]  # the stream as it always was
    uniform.observe(3, group(8))
    uniform.step()
    assert uniform.band_metrics([1, 2]) == {} and uniform.pop_notices() == []
    old = {"version": 1, "seed": 0, "epoch": 1, "position": 2, "num_prompts": 10, "shuffle": True}
    assert uniform.state_dict() == old  # the state format older checkpoints hold
    uniform.load_state_dict(old)
    curriculum = build_sampler(DataConfig(sampler="curriculum", seed=5), 10, 4, seed=0)
    assert isinstance(curriculum, CurriculumSampler) and curriculum.seed == 5
    with pytest.raises(ConfigError, match="data.sampler=uniform"):
        uniform.load_state_dict(curriculum.state_dict())
    with pytest.raises(ConfigError, match="data.sampler=curriculum"):
        curriculum.load_state_dict(old)


def test_config_from_yaml_and_overrides_with_errors_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  sampler: curriculum\n  curriculum:\n    band_weights: {30-70: 8}\n")
    config = load_config(path, ["data.curriculum.window=8", "data.curriculum.pause_steps=5"])
    curriculum = config.data.curriculum
    assert (config.data.sampler, curriculum.window, curriculum.pause_steps) == ("curriculum", 8, 5)
    assert curriculum.band_weights == {"unseen": 1.0, "0-10": 0.1, "10-30": 1.0, "30-70": 8.0, "70-90": 1.0,
                                       "90-100": 0.1}
    for override, key in [("data.curriculum.min_samples=20", "data.curriculum.min_samples"),
                          ("data.curriculum.band_weights.30-60=2", "data.curriculum.band_weights"),
                          ("data.curriculum.band_weights.0-10=0", "data.curriculum.band_weights.0-10"),
                          ("data.curriculum.pause_steps=-1", "data.curriculum.pause_steps"),
                          ("data.shuffle=false", "data.shuffle"), ("data.sampler=weighted", "data.sampler")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(path, [override])
