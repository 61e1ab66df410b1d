"""The skip policy of the test suite, run on small generated suites (pytester):

- tests/conftest.py: with CI set, a skipped test fails (skip at collection, in a fixture, by a
  skipif marker or by pytest.skip), quoting the reason, unless the reason says it needs a GPU
  or an AMX CPU (hardware the machine lacks);
  without CI (unset, empty, "0", "false") every skip stays a skip;
- tests/launch/conftest.py: the SLURM fixture skips only where SLURM cannot run here (not
  installed and not installable, not root); an OSError or a failing start is an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest

def test_passes():
    pass

def test_skip_in_test():
    pytest.skip("pyarrow is not installed")

@pytest.mark.skipif(True, reason="math-verify is not installed")
def test_skipif_marker():
    pass

@pytest.fixture
def server():
    pytest.skip("vLLM is not installed")

def test_skip_in_fixture(server):
    pass

def test_gpu_skip():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.skipif(True, reason="requires CUDA (no GPU here)")
def test_gpu_skipif_marker():
    pass

@pytest.mark.skipif(True, reason="needs a CPU with Intel AMX tiles (amx_tile); this one has none")
def test_amx_skipif_marker():
    pass

@pytest.mark.xfail(reason="a known bug")
def test_expected_failure():
    assert False
"""


@pytest.fixture
def suite(pytester):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_skipping=SKIPPING)
    return pytester


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_under_ci_a_skip_fails_unless_it_needs_a_gpu(suite, monkeypatch, value):
    monkeypatch.setenv("CI", value)
    result = suite.runpytest("-rA")
    # A skip at setup time (fixture, skipif marker) becomes a setup error, in the test a failure.
    result.assert_outcomes(passed=1, failed=1, errors=2, skipped=3, xfailed=1)
    result.stdout.fnmatch_lines_random([
        "FAILED test_skipping.py::test_skip_in_test*",
        "ERROR test_skipping.py::test_skipif_marker*",
        "ERROR test_skipping.py::test_skip_in_fixture*",
        "SKIPPED * needs a CUDA GPU",
        "SKIPPED * requires CUDA (no GPU here)",
        "SKIPPED * needs a CPU with Intel AMX tiles*",
        "*skipped under CI*: pyarrow is not installed",
        "*skipped under CI*: math-verify is not installed",
        "*skipped under CI*: vLLM is not installed",
    ])


@pytest.mark.parametrize("value", [None, "", "0", "false", "False"])
def test_without_ci_every_skip_stays_a_skip(suite, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    result = suite.runpytest("-rA")
    result.assert_outcomes(passed=1, skipped=6, xfailed=1)


def test_under_ci_a_module_level_importorskip_fails_collection(pytester, monkeypatch):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_module="import pytest\n"
                                    "pytest.importorskip('no_such_module_here', reason='pyarrow is not installed')\n"
                                    "def test_never_runs():\n    pass\n")
    monkeypatch.setenv("CI", "1")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*skipped under CI*: pyarrow is not installed*"])
    monkeypatch.delenv("CI")
    pytester.runpytest().assert_outcomes(skipped=1)


@pytest.mark.parametrize("raised,ci,outcome", [
    ("ClusterUnavailable('SLURM is not installed and installing it needs root')", None, "skipped"),
    ("ClusterUnavailable('SLURM is not installed and installing it needs root')", "1", "errors"),
    ("PermissionError(13, 'Permission denied', '/run/munge')", None, "errors"),
    ("subprocess.CalledProcessError(1, ['sinfo'])", None, "errors"),
    ("ClusterFailed('slurmctld exited at start with code 1')", None, "errors"),
])
def test_slurm_fixture_skips_only_where_slurm_cannot_run(pytester, monkeypatch, raised, ci, outcome):
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    launch = pytester.mkdir("launch")
    # The real fixture, with start_cluster (looked up when the fixture runs) raising instead.
    (launch / "conftest.py").write_text((TESTS / "launch" / "conftest.py").read_text()
                                        + f"\n\ndef start_cluster(directory, nodes=2):\n    raise {raised}\n")
    (launch / "test_cluster.py").write_text("def test_uses_slurm(slurm_cluster):\n    pass\n")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    result = pytester.runpytest("-rA")
    result.assert_outcomes(**{outcome: 1})
    if outcome == "skipped":
        result.stdout.fnmatch_lines(["SKIPPED * no SLURM on this machine: SLURM is not installed*"])
