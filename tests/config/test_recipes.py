"""The YAML recipes in configs/ load, and their parallel layouts fit the models they name at the
world sizes their comments state (the large ones are not run here: no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, python_command
from megatron_rl.config import load_config
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
from megatron_rl.train.preflight import check_layout_and_paths

CONFIGS = REPO / "configs"

def published(preset: str) -> dict:
    """A published model's config.json, as shipped with the package (megatron_rl/model/presets/)."""
    return load_hf_config(preset)[0]


DEEPSEEK_V3 = published("deepseek-v3")  # the FP8 download's config.json (DeepSeek-R1's has the same numbers)
DEEPSEEK_V3_BF16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
# recipe -> (config.json, world sizes its comments state)
MODELS = {
    "qwen3_30b_a3b.yaml": (published("qwen3-30b-a3b"), [32]),
    "qwen3_235b_a22b.yaml": (published("qwen3-235b-a22b"), [128]),
    # 32 nodes of 8 H100/H200, or 64 nodes with the same layout.
    "deepseek_v3.yaml": (DEEPSEEK_V3, [256, 512]),
    "glm_4_5.yaml": (published("glm-4.5"), [128]),
    "kimi_k2.yaml": (published("kimi-k2"), [512]),
}
# Recipes whose rollout servers span two nodes: the user starts them and lists rollout.server_urls.
USER_SERVERS = {"kimi_k2.yaml": ["rollout.server_urls=[http://rollout-a:8000,http://rollout-b:8000]"]}
CASES = [(name, world) for name, (_, worlds) in sorted(MODELS.items()) for world in worlds]


def test_tiny_default_recipe_equals_the_built_in_default():
    assert load_config(CONFIGS / "tiny_cpu.yaml") == load_config(None)


def recipe_for(name: str, raw: dict, directory: Path):
    (directory / "config.json").write_text(json.dumps(raw))
    return load_config(CONFIGS / name, [f"model.hf_config={directory}", "checkpoint.init_from=null",
                                        f"output_dir={directory / 'run'}"])


@pytest.mark.parametrize("name, world", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_large_recipe_layout_fits_its_model(tmp_path, monkeypatch, name, world):
    config = recipe_for(name, MODELS[name][0], tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    check_layout_and_paths(config)
    assert config.rollout.mode == "server"  # colocated TP over the whole world does not fit these


def test_deepseek_v3_recipe_reads_the_published_model_fp8_or_bf16(tmp_path, monkeypatch):
    """The recipe's model is what DeepSeek-V3's config.json describes, from either download."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "256")
    for raw, fp8_block in ((DEEPSEEK_V3, (128, 128)), (DEEPSEEK_V3_BF16, None)):
        directory = tmp_path / ("fp8" if fp8_block else "bf16")
        directory.mkdir()
        config = recipe_for("deepseek_v3.yaml", raw, directory)
        check_layout_and_paths(config)
        arch = parse_hf_config(*load_hf_config(config.model.hf_config))
        assert arch.fp8_block == fp8_block and arch.num_mtp_layers == 1
        assert (arch.num_layers, arch.num_attention_heads, arch.num_experts, arch.moe_top_k) == (61, 128, 256, 8)
        assert arch.mla is not None and arch.mla.qk_head_dim == 192 and arch.yarn is not None
        assert arch.moe_layer_pattern == (False,) * 3 + (True,) * 58 and arch.moe_shared_ffn_hidden_size == 2048
        assert (arch.moe_num_groups, arch.moe_group_topk, arch.moe_routed_scaling_factor) == (8, 4, 2.5)
        p = config.parallel
        assert (p.pp, p.pp_last_stage_layers, (arch.num_layers - p.pp_last_stage_layers) // (p.pp - 1)) == (4, 13, 16)
        assert config.model.precision == "bf16" and config.model.fp8_recipe == "blockwise"


# ---- rollout: the transport, the servers' layout, and the launch scripts in launch/ ---------------

LAUNCH = REPO / "launch"
GPUS_PER_NODE = 8  # the large recipes' nodes: 8 H100/H200


@pytest.mark.parametrize("name", sorted(MODELS))
def test_large_recipe_rollout_servers_and_weight_transport(tmp_path, name):
    """Servers on rollout nodes of their own, weights by the collective transport (NCCL on GPU),
    and a server size that splits an 8-GPU node and the model's attention heads."""
    from megatron_rl.launch.slurm import SlurmOptions, rollout_layout

    config = recipe_for(name, MODELS[name][0], tmp_path)
    rollout = config.rollout
    assert (rollout.engine, rollout.mode, rollout.weight_transport, rollout.server_urls) == (
        "vllm", "server", "collective", [])
    if name in USER_SERVERS:  # TP 16 over two nodes: servers the user starts
        assert rollout.server_tp == 2 * GPUS_PER_NODE
        assert parse_hf_config(MODELS[name][0]).num_attention_heads % rollout.server_tp == 0
    else:
        tp, per_node = rollout_layout(config, SlurmOptions(nodes=1, rollout_nodes=1, gpus_per_node=GPUS_PER_NODE))
        assert tp * per_node == GPUS_PER_NODE
    assert rollout.max_model_len >= config.rl.max_response_tokens + 1024  # room for the prompt


def launch_script_lines(path: Path) -> str:
    """The script with its continuation lines joined."""
    return path.read_text().replace("\\\n", " ")


def test_every_recipe_has_a_launch_script():
    assert sorted(path.stem for path in LAUNCH.glob("*.sh")) == sorted(path.stem for path in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("script", sorted(path.name for path in LAUNCH.glob("*.sh")))
def test_launch_script_renders_with_dry_run(tmp_path, script):
    """Executable, names its recipe, calls `megatron-rl launch`, and that command renders
    (--dry-run: the large recipes against their published model configs, nothing written)."""
    import os
    import re
    import subprocess
    import sys

    path = LAUNCH / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    text = launch_script_lines(path)
    (config_name,) = re.findall(r"--config (configs/\S+\.yaml)", text)
    assert config_name == f"configs/{path.stem}.yaml" and (REPO / config_name).is_file()
    assert re.search(r'exec "\$MEGATRON_RL" launch (local|slurm) ', text), text
    overrides = []
    if path.stem + ".yaml" in MODELS:
        (tmp_path / "config.json").write_text(json.dumps(MODELS[path.stem + ".yaml"][0]))
        for split in ("train", "heldout"):  # `launch slurm` refuses prompt files that are not there
            (tmp_path / f"{split}.parquet").touch()
        overrides = [f"model.hf_config={tmp_path}", "checkpoint.init_from=null", f"output_dir={tmp_path / 'run'}",
                     f"data.train={tmp_path / 'train.parquet'}", f"data.heldout={tmp_path / 'heldout.parquet'}",
                     *USER_SERVERS.get(path.stem + ".yaml", [])]
    env = dict(os.environ, MEGATRON_RL_VENV=sys.prefix, PYTHONPATH=str(REPO))
    result = subprocess.run(["bash", str(path), "--dry-run", *overrides], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    if "launch local" in text:
        assert f"-m megatron_rl.cli train --config configs/{path.stem}.yaml" in result.stdout
        return
    nodes = int(re.search(r"--nodes (\d+)", text).group(1))
    found = re.search(r"--rollout-nodes (\d+)", text)
    rollout_nodes = int(found.group(1)) if found else 0  # 0: servers the user started (USER_SERVERS)
    # The training nodes are those the recipe's comments state (its world sizes in MODELS).
    assert nodes * GPUS_PER_NODE in MODELS[path.stem + ".yaml"][1]
    script_text = result.stdout
    assert f"#SBATCH --nodes={nodes + rollout_nodes}" in script_text
    assert f"#SBATCH --gpus-per-node={GPUS_PER_NODE}" in script_text and "{{" not in script_text
    if rollout_nodes:
        assert "WEIGHT_TRANSPORT=collective" in script_text and "megatron_rl.launch.rollout_node" in script_text
    else:
        assert (path.stem + ".yaml") in USER_SERVERS and "megatron_rl.launch.rollout_node" not in script_text
    check = subprocess.run(["bash", "-n"], input=script_text, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert not (tmp_path / "run").exists(), "a dry run must not write anything"


# ---- the planner's table in every GPU recipe's header --------------------------------------------

def planned_header(text: str) -> tuple[str, str] | None:
    """(the command, the block) of a recipe's `megatron-rl plan` header, or None."""
    from megatron_rl.plan.report import HEADER_BEGIN, HEADER_END

    if HEADER_BEGIN not in text:
        return None
    start = text.index(HEADER_BEGIN)
    end = text.index(HEADER_END, start) + len(HEADER_END)
    command = text[start + len(HEADER_BEGIN):text.index("\n", start)]
    return command, text[start:end]


_SEPARATOR = "==== next recipe ===="


@pytest.mark.subprocess  # the planner over every recipe, in a child process
def test_recipe_headers_are_the_planners_tables_for_their_clusters():
    """Re-run the command each GPU recipe's header names (one process for all of them: the planner's
    imports are most of its time): the table must be what the planner says today, the recipe's
    own layout must fit, and the cluster must be the one the recipe states."""
    import subprocess

    headers = {}
    for name in sorted(MODELS):
        found = planned_header((CONFIGS / name).read_text())
        assert found is not None, f"{name}: no `megatron-rl plan` table in its header"
        command, _ = found
        assert f"--config configs/{name} " in command and f"--gpus {MODELS[name][1][0]} " in command
        headers[name] = found
    script = "\n".join(
        ["from megatron_rl.cli import main"]
        + [f"print({_SEPARATOR!r}); main(['plan', *{command.split()!r}, '--recipe-header', {command!r}])"
           for command, _ in headers.values()])
    env = child_env(OMP_NUM_THREADS="2")
    result = subprocess.run(python_command("-c", script, preloaded=True), capture_output=True, text=True, timeout=600,
                            env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [part.strip() for part in result.stdout.split(_SEPARATOR)[1:]]
    for (name, (_, block)), fresh in zip(headers.items(), printed, strict=True):
        assert fresh == block, f"{name}: its header is stale; regenerate it with megatron-rl plan --recipe-header"
        assert "fits (" in block.split("# This recipe: ")[1], name
