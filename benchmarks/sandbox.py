"""The sandbox's cost per call against a bare `subprocess.run` of the same snippet, same run.

All sides run the same file with the same interpreter (`python -I -S main.py`, the snippet's own
command inside the sandbox) in a fresh temporary directory per call. A cold sandbox call adds the
launcher (a second interpreter start), the namespaces, the jail's mounts, the limits and the
capped capture; a warm one (`Sandbox(warm=2)`, what the `python` tool uses) finds its jail built
ahead and pays only for the limits, the capture and the report. Alternating calls, medians over
`--calls` of each, for three snippets: an empty program (pure start-up), a small computation,
and one that writes 1 MB of output. Then the throughput of `--concurrency` calls in flight at
once (threads), bare vs warm sandbox.

    python benchmarks/sandbox.py                # ~1 min on 2 CPU cores
    python benchmarks/sandbox.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SNIPPETS = {
    "empty": "pass\n",
    "compute": "print(sum(i * i for i in range(200000)))\n",
    "output_1mb": "import sys\nsys.stdout.write('x' * (1 << 20))\n",
}


def bare(python: str, source: str) -> float:
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bare-work-")
    try:
        Path(work, "main.py").write_text(source)
        done = subprocess.run([python, "-I", "-S", "main.py"], cwd=work, capture_output=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"})
        if done.returncode != 0:
            raise SystemExit(f"bare run failed: {done.stderr[-500:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return time.perf_counter() - started


def sandboxed(box, source: str) -> float:
    started = time.perf_counter()
    result = box.run_python(source)
    if not result.ok:
        raise SystemExit(f"sandboxed run failed: {result}")
    return time.perf_counter() - started


def main() -> None:
    from megatron_rl.sandbox import Sandbox, SandboxLimits

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    limits = SandboxLimits(output_bytes=2 << 20)
    cold, warm = Sandbox(limits), Sandbox(limits, warm=2)
    python = cold.python
    results: dict = {"cpu_count": os.cpu_count(), "per_call": {}}
    for name, source in SNIPPETS.items():
        bare(python, source), sandboxed(cold, source), sandboxed(warm, source)  # warm the page cache
        times: dict[str, list[float]] = {"bare": [], "cold": [], "warm": []}
        for _ in range(args.calls):
            times["bare"].append(bare(python, source))
            times["cold"].append(sandboxed(cold, source))
            time.sleep(0.05)  # as between a program's calls: the warm pool rebuilds in the background
            times["warm"].append(sandboxed(warm, source))
        b, c, w = (statistics.median(times[key]) for key in ("bare", "cold", "warm"))
        results["per_call"][name] = {"bare_s": b, "cold_s": c, "warm_s": w, "cold_ratio": c / b, "warm_ratio": w / b}
        print(f"{name:11s} bare {b * 1000:6.1f} ms   sandbox cold {c * 1000:6.1f} ms (x{c / b:4.2f})   "
              f"warm {w * 1000:6.1f} ms (x{w / b:4.2f})   median of {args.calls}")

    source = SNIPPETS["compute"]
    calls = args.concurrency * 8
    for label, call in (("bare", lambda _: bare(python, source)), ("warm", lambda _: sandboxed(warm, source))):
        with ThreadPoolExecutor(args.concurrency) as pool:
            started = time.perf_counter()
            list(pool.map(call, range(calls)))
            results[f"throughput_{label}_per_s"] = calls / (time.perf_counter() - started)
    ratio = results["throughput_bare_per_s"] / results["throughput_warm_per_s"]
    results["throughput_ratio"] = ratio
    print(f"throughput, {args.concurrency} in flight, {calls} calls of 'compute': bare "
          f"{results['throughput_bare_per_s']:.1f}/s, warm sandbox {results['throughput_warm_per_s']:.1f}/s "
          f"(bare / sandbox {ratio:.2f}; on {os.cpu_count()} cores every jail's set-up competes with the programs)")
    cold.close(), warm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
