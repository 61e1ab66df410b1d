"""What the test suite asserts, counted, and which tests it has, compared with another revision.

A change that makes the suite faster must not make it weaker. This counts, statically (no test
runs), in every Python file under tests/ of the working tree and of a git revision:

- `assert` statements,
- `pytest.raises(...)` uses,
- tolerances: `atol=` / `rtol=` / `tol=` keywords, `pytest.approx(...)`, `math.isclose(...)` /
  `torch.allclose` / `np.allclose` / `assert_close` calls, and comparisons against a float
  literal written in scientific notation (`diff <= 1e-5`),

and lists the test node ids of both (`pytest --collect-only -q`, the revision checked out in a
temporary worktree), printing the ids that disappeared and those that appeared. A disappeared id
is either a rename (say which in the change's note) or a lost test.

    python scripts/suite_census.py --base <rev>          # counts and node ids, base vs working tree
    python scripts/suite_census.py --base <rev> --counts-only
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOLERANCE_KEYWORDS = {"atol", "rtol", "tol", "abs_tol", "rel_tol"}
CLOSE_CALLS = {"approx", "isclose", "allclose", "assert_close", "assert_allclose"}


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_sci_float(node: ast.AST, source: str) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, float)):
        return False
    text = ast.get_source_segment(source, node) or ""
    return "e" in text.lower()


def count_source(source: str) -> Counter:
    counts: Counter = Counter()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            counts["assert"] += 1
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name == "raises":
                counts["pytest.raises"] += 1
            if name in CLOSE_CALLS:
                counts["tolerance"] += 1
            counts["tolerance"] += sum(1 for keyword in node.keywords if keyword.arg in TOLERANCE_KEYWORDS)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops) and \
                    any(_is_sci_float(operand, source) for operand in operands):
                counts["tolerance"] += 1
    return counts


def count_tree(files: dict[str, str]) -> Counter:
    total: Counter = Counter()
    for source in files.values():
        total += count_source(source)
    total["files"] = len(files)
    return total


def working_tree_tests() -> dict[str, str]:
    return {str(path.relative_to(REPO)): path.read_text() for path in sorted((REPO / "tests").rglob("*.py"))}


def revision_tests(rev: str) -> dict[str, str]:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "tests"],
                             capture_output=True, check=True).stdout
    files = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                files[member.name] = tar.extractfile(member).read().decode()
    return files


def node_ids(checkout: Path) -> set[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                            cwd=checkout, capture_output=True, text=True)
    ids = {line.strip() for line in result.stdout.splitlines() if "::" in line}
    if not ids:
        raise SystemExit(f"no tests collected in {checkout}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return ids


def revision_node_ids(rev: str) -> set[str]:
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(worktree), rev], check=True)
        try:
            return node_ids(worktree)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare the working tree with")
    parser.add_argument("--counts-only", action="store_true", help="skip the node-id comparison (no collection)")
    args = parser.parse_args()

    before, after = count_tree(revision_tests(args.base)), count_tree(working_tree_tests())
    print(f"{'':16}{args.base[:12]:>14}{'working tree':>14}")
    for key in ("files", "assert", "pytest.raises", "tolerance"):
        print(f"{key:16}{before[key]:>14}{after[key]:>14}{after[key] - before[key]:>+8}")
    if args.counts_only:
        return
    old, new = revision_node_ids(args.base), node_ids(REPO)
    print(f"\nnode ids: {len(old)} at {args.base[:12]}, {len(new)} now")
    gone, added = sorted(old - new), sorted(new - old)
    print(f"disappeared ({len(gone)}):", *gone, sep="\n  ")
    print(f"appeared ({len(added)}):", *added, sep="\n  ")


if __name__ == "__main__":
    main()
