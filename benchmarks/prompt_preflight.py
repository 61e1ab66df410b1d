#!/usr/bin/env python
"""How long preflight's prompt-length check takes on a million prompts, against a plain tokenizer call.

    python benchmarks/prompt_preflight.py [--prompts 1000000] [--format raw|chat] [--tokenizer DIR] [--out FILE]

Writes --prompts synthetic prompts (text of 16 to --max-chars characters from the tiny default's
alphabet: words and numbers) as a JSONL file in a temporary directory, reads it with the run's
reader (`load_prompts`, timed: the read + parse reference) and then times, on the same records:

  check       megatron_rl.train.preflight.overlong_prompts: what preflight runs on every prompt
              (rendered as data.prompt_format renders it, counted in batches of LENGTH_BATCH
              through the tokenizer, the prompts over the limit collected)
  reference   the same texts through the tokenizer's own batch call, `tokenizer(batch)`, in the
              same batches, the lengths taken from its input_ids: the plain way to count tokens
              (with --format chat it gets the texts already rendered; the check renders them)

The tokenizer is the tiny default run's (the character tokenizer, loaded as the engine loads
it), or the one in --tokenizer DIR (a Hugging Face model or tokenizer directory). The limit is
set so that about 1 prompt in 20 is over it, so the check also collects some. Printed: prompts/s
and seconds per million prompts for each, and the ratio check/reference (goal <= 1.0: the check
costs no more than a bare tokenizer call over the same texts), and check against read + parse.
The two timed passes alternate --repeats times; the best of each is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

GOAL = 1.0
MIN_CHARS = 16


def write_prompts(path: Path, count: int, max_chars: int, seed: int) -> float:
    """`count` JSONL rows {"prompt", "answer"} of 16..max_chars characters; returns the mean length."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(2000)]
    words += [str(number) for number in range(200)] + ["+", "-", "*", "=", "?", "."]
    total = 0
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(count):
            length = rng.randint(MIN_CHARS, max_chars)
            text = " ".join(rng.choices(words, k=length // 3 + 1))[:length].strip() or "1+1="
            total += len(text)
            handle.write(json.dumps({"prompt": text, "answer": "1"}) + "\n")
    return total / count


def load_tokenizer(directory: str | None):
    """The tiny default run's tokenizer (as preflight and the engine get it), or DIR's."""
    from megatron_rl.config import load_config
    from megatron_rl.rollout.engine_model import load_engine_tokenizer
    from megatron_rl.train.preflight import run_tokenizer

    if directory:
        return load_engine_tokenizer(directory), directory
    return run_tokenizer(load_config(None)), "the tiny default's (character-level)"


def timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def reference_lengths(tokenizer, texts: list[str], batch: int, add_special_tokens: bool) -> list[int]:
    lengths = []
    for start in range(0, len(texts), batch):
        lengths += map(len, tokenizer(texts[start:start + batch], add_special_tokens=add_special_tokens)["input_ids"])
    return lengths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--max-chars", type=int, default=160, help="prompt lengths are uniform in 16..max-chars")
    parser.add_argument("--format", choices=("raw", "chat"), default="raw", help="data.prompt_format")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory (default: tiny default's)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the results as markdown")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_chars < MIN_CHARS or args.repeats < 1:
        parser.error(f"--prompts and --repeats must be >= 1 and --max-chars >= {MIN_CHARS}")
    os.environ.setdefault("OMP_NUM_THREADS", "2")

    from megatron_rl.observability.console import quiet_dependencies

    quiet_dependencies()
    from megatron_rl.data import DataConfig, load_prompts, render_prompt
    from megatron_rl.train.preflight import LENGTH_BATCH, overlong_prompts

    tokenizer, tokenizer_name = load_tokenizer(args.tokenizer)
    data = DataConfig(prompt_format=args.format)
    with tempfile.TemporaryDirectory(prefix="prompt-preflight-bench-") as work:
        path = Path(work) / "prompts.jsonl"
        mean_chars = write_prompts(path, args.prompts, args.max_chars, args.seed)
        read_s, dataset = timed(lambda: load_prompts(path))
    texts = [render_prompt(tokenizer, record.prompt, prompt_format=args.format) for record in dataset]
    add_special_tokens = args.format == "raw"

    # The reference pass comes first: its counts set the limit (about 5% of the prompts over it).
    check_s, reference_s = [], []
    for repeat in range(args.repeats):
        seconds, lengths = timed(lambda: reference_lengths(tokenizer, texts, LENGTH_BATCH, add_special_tokens))
        reference_s.append(seconds)
        if repeat == 0:
            limit = sorted(lengths)[int(len(lengths) * 0.95)]
        seconds, over = timed(lambda: overlong_prompts(dataset, tokenizer, data, limit))
        check_s.append(seconds)
    # The check must find exactly the prompts a plain count finds: a timing of another computation is meaningless.
    expected = [(index, count) for index, count in enumerate(lengths) if count > limit]
    if over != expected:
        print(f"AGREEMENT FAILED: the check found {len(over)} prompts over {limit} tokens, the reference "
              f"{len(expected)}", file=sys.stderr)
        return 1

    n = len(dataset)
    check, reference = min(check_s), min(reference_s)
    ratio = check / reference
    lines = [
        f"prompts: {n} ({MIN_CHARS}-{args.max_chars} characters, mean {mean_chars:.1f}; {sum(lengths) / n:.1f} tokens "
        f"on average), data.prompt_format={args.format}, tokenizer: {tokenizer_name}, batches of {LENGTH_BATCH}",
        f"read + parse (load_prompts): {read_s:.2f} s, {n / read_s:,.0f} prompts/s",
        f"length check (preflight.overlong_prompts): {check:.2f} s, {n / check:,.0f} prompts/s, "
        f"{check * 1e6 / n:.1f} s per 1M prompts; {len(over)} over {limit} tokens",
        f"reference, tokenizer(batch) over the same texts: {reference:.2f} s, {n / reference:,.0f} prompts/s, "
        f"{reference * 1e6 / n:.1f} s per 1M prompts",
        f"ratio check/reference: {ratio:.2f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'GOAL MISSED'}); "
        f"check/read+parse: {check / read_s:.2f}",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("# Prompt-length preflight on synthetic prompts\n\n`python benchmarks/prompt_preflight.py "
                                  + " ".join(sys.argv[1:]) + f"`, {os.cpu_count()} CPU cores.\n\n```\n"
                                  + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
