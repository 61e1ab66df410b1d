"""What the trainer tests read back from a run directory (imported by test_*.py here)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.observability.metrics_log import WALL_CLOCK


def metrics(out: Path) -> dict[int, dict]:
    """OUTPUT_DIR/metrics.jsonl by step; a step logged twice fails."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r for r in records}


def comparable(record: dict) -> dict:
    """Everything but wall-clock keys: phase times and each row's timestamp and elapsed run time."""
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in WALL_CLOCK}
