"""benchmarks/seed_effects.py's runaway count (pad_runaway): the rule per run and both exact tests,
against independent re-derivations (every relabelling of the runs, every sign of the discordant
pairs, enumerated) and textbook values."""

import importlib.util
import itertools
import sys
from fractions import Fraction

import pytest

from _support.processes import REPO


def load():
    spec = importlib.util.spec_from_file_location("seed_effects", REPO / "benchmarks" / "seed_effects.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


seed_effects = load()


def fisher_by_relabelling(treatment_events, treatment_runs, reference_events, reference_runs):
    """Fisher's one-sided p from its definition: of all ways to call `treatment_runs` of the runs the
    treatment's (the events fixed), the share giving the treatment at least as many events."""
    runs = [1] * (treatment_events + reference_events) + [0] * (
        treatment_runs + reference_runs - treatment_events - reference_events)
    labellings = list(itertools.combinations(range(len(runs)), treatment_runs))
    extreme = sum(sum(runs[i] for i in chosen) >= treatment_events for chosen in labellings)
    return Fraction(extreme, len(labellings))


def mcnemar_by_signs(treatment_only, reference_only):
    """McNemar's exact one-sided p: under no effect each discordant pair is the treatment's with
    probability 1/2; the share of all sign assignments with at least as many for the treatment."""
    pairs = treatment_only + reference_only
    signs = list(itertools.product((0, 1), repeat=pairs))
    return Fraction(sum(sum(s) >= treatment_only for s in signs), len(signs))


@pytest.mark.parametrize("table", [(3, 4, 1, 4), (2, 6, 0, 6), (5, 8, 0, 8), (0, 5, 3, 5), (4, 6, 4, 6), (1, 3, 0, 7)])
def test_fisher_matches_the_relabelling_count(table):
    assert seed_effects.fisher_exact_greater(*table) == pytest.approx(float(fisher_by_relabelling(*table)), abs=1e-12)


def test_fisher_textbook_values():
    # Fisher's tea-tasting table [[3, 1], [1, 3]]: one-sided p = 17/70
    assert seed_effects.fisher_exact_greater(3, 4, 1, 4) == pytest.approx(17 / 70, abs=1e-12)
    # the length effect's first count, 2 of 6 against 0 of 6: C(10, 4) / C(12, 6) = 210/924
    assert seed_effects.fisher_exact_greater(2, 6, 0, 6) == pytest.approx(210 / 924, abs=1e-12)


@pytest.mark.parametrize("discordant", [(0, 0), (3, 0), (5, 1), (1, 5), (6, 2), (4, 4)])
def test_mcnemar_matches_the_sign_count(discordant):
    assert seed_effects.mcnemar_exact_greater(*discordant) == pytest.approx(float(mcnemar_by_signs(*discordant)),
                                                                              abs=1e-12)
    assert seed_effects.mcnemar_exact_greater(5, 0) == pytest.approx(1 / 32, abs=1e-12)


def test_runaway_rule_counts_runs_at_the_threshold_and_pairs_the_seeds():
    rule = seed_effects.Runaway("response/truncated_frac", 0.2, "truncated share >= 0.2")
    key = rule.key
    reference = {11: {key: 0.0}, 12: {key: 0.25}, 13: {key: 0.03}, 14: {key: 0.19}}
    treatment = {11: {key: 0.2}, 12: {key: 0.99}, 13: {key: 0.37}, 14: {key: 0.0}, 15: {key: 0.5}}
    count = seed_effects.runaway_counts(rule, reference, treatment)
    assert count["reference_events"] == [12] and count["reference_runs"] == 4
    assert count["treatment_events"] == [11, 12, 13, 15] and count["treatment_runs"] == 5
    # paired seeds 11-14: 11 and 13 ran away in the treatment only, none in the reference only;
    # seed 15 has no pair and stays out of McNemar's test
    assert count["discordant"] == [2, 0]
    assert count["mcnemar_p"] == pytest.approx(0.25)
    assert count["fisher_p"] == pytest.approx(float(fisher_by_relabelling(4, 5, 1, 4)))


def test_pad_runaway_runs_both_arms_on_sixteen_seeds_fixed_in_advance():
    effect = seed_effects.EXTRA_EFFECTS["pad_runaway"]
    assert effect.seed_list[:8] == seed_effects.SEEDS and len(set(effect.seed_list)) == 16
    for arm in effect.arms:
        assert seed_effects.seeds_of(effect, arm, smoke=False) == effect.seed_list
    assert effect.runaway.key == effect.primary
