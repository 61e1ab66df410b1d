"""What an evaluation produces before any figure is computed: per set, per prompt, the n sampled
responses' outcomes and the greedy one's. The runner (evaluation/runner.py) fills these from the
project's engines and reward functions; the estimators and the report (evaluation/metrics.py,
evaluation/report.py) read only these, so a figure can be re-derived from eval.json alone.

A sample is *correct* when its reward reaches the set's threshold (rule rewards are 0 or 1; the
default 0.5 is the trainer's `CORRECT`); pass@k and greedy accuracy count correct samples, avg@n
averages the rewards themselves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SampleOutcome:
    reward: float
    correct: bool
    answer: str | None  # the extracted answer maj@k votes on (None: nothing extractable, never a vote)
    length: int  # response tokens
    truncated: bool  # finish reason "length": the token budget ended it
    text: str = ""  # the response, kept only for the samples written beside the table (else "")


@dataclass
class PromptOutcome:
    index: int  # the record's position in its set (the same prompts and seeds for every checkpoint)
    samples: list[SampleOutcome]  # n sampled responses, in sample order (seed = the prompt's seed + i)
    greedy: SampleOutcome | None = None  # temperature 0, one response (None: greedy not asked)
    prompt: str = ""  # kept only for the prompts whose responses are written beside the table


@dataclass
class SetOutcome:
    name: str  # the --set NAME (or rl.eval.sets' key)
    path: str
    n: int  # samples per prompt
    temperature: float
    top_p: float
    threshold: float  # reward >= threshold: correct
    prompts: list[PromptOutcome] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SetOutcome:
        def sample(d):
            return None if d is None else SampleOutcome(**d)

        prompts = [PromptOutcome(index=p["index"], samples=[sample(s) for s in p["samples"]],
                                 greedy=sample(p.get("greedy")), prompt=p.get("prompt", ""))
                   for p in data["prompts"]]
        return cls(**{k: v for k, v in data.items() if k != "prompts"}, prompts=prompts)
