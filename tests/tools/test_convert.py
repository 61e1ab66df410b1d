"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py, run as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _support.processes import REPO, child_env, cli_command, python_command
from megatron_rl.checkpoint.output_guard import MARKER

sys.path.insert(0, str(REPO / "tests" / "bridge"))
from test_bridge import family_configs, hf_logits, make_hf_model, read_checkpoint  # noqa: E402

pytestmark = pytest.mark.multiprocess


def tool(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = child_env()
    result = subprocess.run(python_command(REPO / "tools" / name, *args, preloaded=True, children=True),
                            env=env, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{name} {args} failed:\n{result.stderr[-5000:]}")
    return result


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    # vocab 600 pads to 640 rows at TP1 and 768 at TP2: the checkpoint must carry its padding.
    path = tmp_path_factory.mktemp("hf") / "llama"
    make_hf_model(dict(family_configs()["llama"], vocab_size=600), path)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    make_hf_model(family_configs()["qwen3_moe"], path)
    return path


def assert_same_checkpoint(a: Path, b: Path) -> None:
    left, right = read_checkpoint(a), read_checkpoint(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and torch.equal(left[name], right[name]), name


def test_tp2_checkpoint_converts_back_at_tp1(llama, tmp_path):
    tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(tmp_path / "mcore"), "--tp", "2")
    metadata = json.loads((tmp_path / "mcore" / "megatron_rl.json").read_text())
    assert metadata["padded_vocab_size"] == 768 and metadata["saved_layout"]["tp"] == 2
    tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"))
    assert_same_checkpoint(llama, tmp_path / "back")
    tokens = [1, 5, 599, 42, 7]
    assert torch.equal(hf_logits(tmp_path / "back", tokens), hf_logits(llama, tokens))


def test_moe_saved_at_ep2_pp2_converts_back_in_one_process(moe, tmp_path):
    tool("convert_hf_to_megatron.py", "--hf-dir", str(moe), "--out", str(tmp_path / "mcore"),
         "--ep", "2", "--pp", "2", "--etp", "1")
    tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"),
         "--hf-template", str(moe))
    assert_same_checkpoint(moe, tmp_path / "back")
    # The layout flags megatron-to-hf once took are refused by name, before anything is written.
    result = tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "again"),
                  "--tp", "2", check=False)
    assert result.returncode == 2 and "--tp is not needed" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("family, layout", [("deepseek_v3", ["--tp", "2", "--ep", "2", "--etp", "1"]),
                                            ("glm4_moe", ["--ep", "2", "--etp", "1"])])
def test_sigmoid_router_families_round_trip_through_ep2(tmp_path, family, layout):
    """HF -> torch_dist at EP2 (DeepSeek-V3 at TP2 too: MLA's projections are plain
    column-parallel weights, each rank's rows a slice of the whole tensor) -> HF, bit-exact:
    MLA / partial-rotary attention, shared experts, and the routers' e_score_correction_bias (a
    buffer, saved with the weights)."""
    hf = tmp_path / family
    make_hf_model(family_configs()[family], hf)
    tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(tmp_path / "mcore"), *layout)
    tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"))
    assert_same_checkpoint(hf, tmp_path / "back")
    biases = [t for name, t in read_checkpoint(tmp_path / "back").items() if name.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the non-zero bias made the trip


def test_cli_wrapper(llama, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(cli_command("convert", "hf-to-megatron", "--hf-dir", str(llama), "--out", str(tmp_path / "mcore"),
                                        preloaded=True, children=True),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "mcore" / "metadata.json").is_file()


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o"), check=False)
    assert result.returncode == 2
    assert "'GPT2LMHeadModel' is not supported; supported: Qwen3MoeForCausalLM" in result.stderr
    assert not (tmp_path / "o").exists()


def test_the_output_carries_the_marker_by_which_force_may_replace_it(llama, tmp_path):
    """What --force may replace is an earlier output of the same conversion, told by this marker
    (listed in the manifest); anything else it leaves alone (tests/checkpoint/test_output_guard.py)."""
    out = tmp_path / "mcore"
    tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(out))
    assert json.loads((out / MARKER).read_text()) == {"command": "megatron-rl convert hf-to-megatron"}
    assert MARKER in json.loads((out / "MANIFEST.json").read_text())["files"]
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(out), check=False)
    assert result.returncode == 2 and "already exists; pass --force" in result.stderr, result.stderr


def test_failed_conversion_leaves_no_partial_output(llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in llama.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            tensors.pop("model.layers.1.mlp.up_proj.weight")
            save_file(tensors, broken / file.name, metadata={"format": "pt"})
        else:
            (broken / file.name).write_bytes(file.read_bytes())
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(broken), "--out", str(tmp_path / "out"), "--tp", "2", check=False)
    assert result.returncode != 0
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no output, no staging left


# ---- interrupted conversions: SIGINT/SIGTERM stop every rank and publish nothing ----------------

HOOK = Path(__file__).parent / "pause_hook"  # sitecustomize.py: pauses a conversion at a known point
TOKENIZER_COPY = "megatron_rl.bridge.hf_checkpoint:copy_tokenizer_files"  # rank 0, inside the staging dir
# torch.distributed.checkpoint's writer about to write the weight files (checkpoint/format.py's
# streaming save; Megatron-Core's own writer, which started a multiprocessing Manager, is not used)
WEIGHTS_WRITE = "torch.distributed.checkpoint.filesystem:_write_files_from_queue"


def start_paused(name: str, args: list[str], pause: str, marker: Path, sleep: float) -> subprocess.Popen:
    env = child_env(PYTHONPATH=f"{HOOK}{os.pathsep}{REPO}",
                    CONVERT_TEST_PAUSE=pause, CONVERT_TEST_MARKER=str(marker), CONVERT_TEST_SLEEP=str(sleep))
    # Forked from the pre-imported server, its torchrun and ranks too; the hook runs in each of them
    # (tests/_support/zygote.py runs a sitecustomize.py of the run's PYTHONPATH).
    return subprocess.Popen(python_command(REPO / "tools" / name, *args, preloaded=True, children=True), env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def signal_when_paused(process: subprocess.Popen, marker: Path, number: int, delay: float = 0.0):
    """Send `number` to the conversion (its first process only) `delay` seconds after it reached
    the pause; wait for it to exit. Returns the exit code, stderr and the pids that were paused."""
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert process.poll() is None, f"ended before the pause:\n{process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "never reached the pause"
        time.sleep(0.01)
    time.sleep(delay)
    os.kill(process.pid, number)
    paused = [int(line) for line in marker.read_text().split()]
    try:
        _, err = process.communicate(timeout=90)  # also waits for every process holding its stderr
    except subprocess.TimeoutExpired:
        for pid in paused:
            os.kill(pid, signal.SIGKILL) if alive(pid) else None
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the conversion (or a process it started) still ran 90 s after {signal.Signals(number).name}")
    return process.returncode, err, paused


def assert_nothing_left(directory: Path, paused: list[int], expected: list[str]) -> None:
    """No process of the conversion still runs (orphaned ranks would publish later), no output,
    no staging directory."""
    deadline = time.monotonic() + 45  # torchrun kills ranks that ignore its signal after 30 s
    while any(alive(pid) for pid in paused) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in paused if alive(pid)]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"processes {orphans} kept running after the conversion exited"
    assert sorted(p.name for p in directory.iterdir()) == expected


def test_sigterm_stops_every_rank_of_a_tp2_conversion(llama, tmp_path):
    process = start_paused("convert_hf_to_megatron.py", ["--hf-dir", str(llama), "--out", str(tmp_path / "out"),
                                                          "--tp", "2"], TOKENIZER_COPY, tmp_path / "paused", 120)
    code, err, paused = signal_when_paused(process, tmp_path / "paused", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM; no output was published" in err
    assert_nothing_left(tmp_path, paused, ["paused"])


# SIGINT as the weight files are about to be written, SIGTERM while the output is half written.
@pytest.mark.parametrize("number, pause, sleep, delay", [(signal.SIGINT, WEIGHTS_WRITE, 120, 0.3),
                                                         (signal.SIGTERM, TOKENIZER_COPY, 120, 0)],
                         ids=["SIGINT-while-writing-the-weights", "SIGTERM-while-writing"])
def test_signal_stops_a_single_process_conversion(llama, tmp_path, number, pause, sleep, delay):
    process = start_paused("convert_hf_to_megatron.py", ["--hf-dir", str(llama), "--out", str(tmp_path / "out")],
                           pause, tmp_path / "paused", sleep)
    code, err, paused = signal_when_paused(process, tmp_path / "paused", number, delay)
    assert code == 128 + number, err[-3000:]
    assert f"stopped by {signal.Signals(number).name}" in err and "Traceback" not in err
    assert_nothing_left(tmp_path, paused, ["paused"])


# ---- damaged inputs: one line naming the file and what to do ------------------------------------


def damage(file: Path, how: str) -> None:
    """Truncate the file to half, or overwrite 64 bytes in its middle in place (same size) with
    0xff: NaN as float32/bf16. Neither format has checksums, so damage that keeps the values finite
    cannot be told from weights."""
    size = file.stat().st_size
    if how == "truncate":
        os.truncate(file, size // 2)
    else:
        with open(file, "r+b") as handle:
            handle.seek(size // 2)
            handle.write(b"\xff" * 64)
        assert file.stat().st_size == size


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("megatron-rl convert:")]
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_damaged_safetensors_is_named(llama, tmp_path, how):
    hf = tmp_path / "hf"
    shutil.copytree(llama, hf)
    damage(hf / "model.safetensors", how)
    result = tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(tmp_path / "out"), check=False)
    assert_one_line_error(result, str(hf / "model.safetensors"), "download the model again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.fixture(scope="module")
def llama_mcore(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "llama"
    tool("convert_hf_to_megatron.py", "--hf-dir", str(llama), "--out", str(out))
    return out


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_damaged_distcp_is_named(llama_mcore, tmp_path, how):
    ckpt = tmp_path / "mcore"
    shutil.copytree(llama_mcore, ckpt)
    damage(ckpt / "__0_0.distcp", how)  # the weights of rank 0 (one file per rank)
    result = tool("convert_megatron_to_hf.py", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"), check=False)
    named = str(ckpt / "__0_0.distcp") if how == "truncate" else str(ckpt)
    assert_one_line_error(result, named, "re-convert it, or use another checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mcore"]


def test_checkpoint_that_does_not_match_its_config_is_named(llama_mcore, tmp_path):
    """megatron-to-hf reads the checkpoint by the keys and shapes of the model its hf_config/
    describes: a config edited after the conversion (here a wider MLP) is refused by tensor and
    shapes, in one line, and nothing is written."""
    ckpt = tmp_path / "mcore"
    shutil.copytree(llama_mcore, ckpt)
    (ckpt / "MANIFEST.json").unlink()  # else the checksum of the edited config.json is what fails
    config = json.loads((ckpt / "hf_config" / "config.json").read_text())
    (ckpt / "hf_config" / "config.json").write_text(json.dumps(dict(config, intermediate_size=2 * config["intermediate_size"])))
    result = tool("convert_megatron_to_hf.py", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"), check=False)
    assert_one_line_error(result, str(ckpt), "linear_fc1.weight has shape", "re-convert it, or use another checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mcore"]


def test_run_directory_converts_its_latest_step(llama, llama_mcore, tmp_path):
    """A training run as the trainer lays it out: weights in step_*/weights/ (megatron_rl.json's
    weights_dir), `latest` naming the newest step. The older step is broken: it must not be read."""
    checkpoints = tmp_path / "run" / "checkpoints"
    step = checkpoints / "step_000020"
    shutil.copytree(llama_mcore, step / "weights", ignore=shutil.ignore_patterns("hf_config", "megatron_rl.json"))
    shutil.copytree(llama_mcore / "hf_config", step / "hf_config")
    metadata = json.loads((llama_mcore / "megatron_rl.json").read_text())
    (step / "megatron_rl.json").write_text(json.dumps(dict(metadata, weights_dir="weights")))
    (checkpoints / "step_000010").mkdir()
    (checkpoints / "latest").write_text("step_000020\n")
    result = tool("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "back"))
    assert f"reading checkpoint {step}" in result.stdout
    assert_same_checkpoint(llama, tmp_path / "back")
