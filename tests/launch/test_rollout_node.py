"""The pieces of a disaggregated job that need no cluster (the job itself runs against a real SLURM
in test_slurm_launch.py):

- a rollout node starts vLLM ready for every weight transport (our worker extension and
  VLLM_SERVER_DEV_MODE=1, nothing transport-specific), at the tensor parallel size it is given,
  from the model directory the trainer writes for its own engines;
- several servers on one GPU node split its GPUs;
- `megatron-rl launch slurm --rollout-nodes` renders the servers' layout and the weight transport,
  and writes the config the job runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _support.processes import REPO
from megatron_rl.config import load_config

from megatron_rl.errors import ConfigError
from megatron_rl.launch import rollout_node
from megatron_rl.launch.slurm import SlurmOptions, prepare
from megatron_rl.rollout.engine_model import engine_config, write_engine_model_dir
from megatron_rl.rollout.factory import server_args

pytestmark = pytest.mark.subprocess  # runs a child process (pyproject's marks; scripts/test.sh --quick)


class Launched(Exception):
    """Raised by the stand-in for ServerProcess.launch: the command a server would run."""

    def __init__(self, command, env):
        super().__init__("launched")
        self.command, self.env = command, env


@pytest.fixture
def launched(monkeypatch):
    from megatron_rl.rollout.engines.vllm_server import VllmServerProcess

    def launch(cls, command, *, env, **kwargs):
        raise Launched(command, env)

    monkeypatch.setattr(VllmServerProcess, "launch", classmethod(launch))


def start(config, tp: int) -> Launched:
    with pytest.raises(Launched) as caught:
        rollout_node.start_server(config, index=1, port=18123, host="0.0.0.0", tensor_parallel_size=tp)
    return caught.value


def arg(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_server_is_ready_for_every_transport_at_its_tensor_parallel_size(tmp_path, launched):
    config = load_config(None, [f"output_dir={tmp_path}", "rollout.mode=server", "rollout.weight_transport=collective"])
    for tp in (1, 2):
        server = start(config, tp)
        command = server.command
        assert server.env["VLLM_SERVER_DEV_MODE"] == "1"  # POST /collective_rpc
        assert arg(command, "--worker-extension-cls") == "megatron_rl.rollout.worker.extension.WeightSyncWorker"
        assert arg(command, "--tensor-parallel-size") == str(tp)
        assert arg(command, "--load-format") == "dummy"  # the trainer pushes the weights
        assert arg(command, "--port") == "18123" and arg(command, "--seed") == str(config.seed + 1)
        assert not any(item.startswith("--weight-transfer") for item in command)
        # Logprobs after temperature: the distribution the trainer trains on (rl.temperature).
        assert arg(command, "--logprobs-mode") == "processed_logprobs"
        # Every route but /health needs the job's token, which travels in the environment only.
        assert arg(command, "--middleware") == "megatron_rl.rollout.auth.RolloutTokenMiddleware"
        assert server.env["MEGATRON_RL_ROLLOUT_TOKEN"] and server.env["MEGATRON_RL_ROLLOUT_TOKEN"] not in " ".join(command)
        model_dir = Path(arg(command, "--model"))
        assert model_dir == tmp_path / "rollout" / "vllm-1" / "model"
    assert "--distributed-executor-backend" not in command  # tp 2: vLLM's own multi-process workers


def test_rollout_node_writes_the_trainers_engine_model(tmp_path, launched):
    """The server's model directory is the trainer's OUTPUT_DIR/engine_model, byte for byte: the
    keys engines need that transformers implies (DeepSeek-V3's routing), no quantization_config of
    an FP8 source, and the FP8 one when the engines get FP8 weights."""
    source = json.loads((REPO / "megatron_rl/model/presets/tiny-deepseek-v3.json").read_text())
    source["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(source))
    for fp8 in (False, True):
        out = tmp_path / f"run-fp8-{fp8}"
        config = load_config(None, [f"output_dir={out}", f"model.hf_config={tmp_path / 'hf'}", "rollout.mode=server",
                                    "model.precision=bf16", f"model.export_fp8={str(fp8).lower()}"])
        trainer_dir = write_engine_model_dir(config, out / "engine_model")
        server_dir = Path(arg(start(config, 1).command, "--model"))
        names = sorted(path.name for path in trainer_dir.iterdir())
        assert names == sorted(path.name for path in server_dir.iterdir()) and "tokenizer.json" in names
        for name in names:
            assert (trainer_dir / name).read_bytes() == (server_dir / name).read_bytes(), name
        written = json.loads((server_dir / "config.json").read_text())
        assert written == engine_config(config)
        assert (written["topk_method"], written["scoring_func"]) == ("noaux_tc", "sigmoid")
        if fp8:
            assert written["quantization_config"]["weight_block_size"] == [128, 128]
        else:
            assert "quantization_config" not in written


def test_server_args_per_layout_and_routing_replay():
    """The flags of the servers the trainer starts and of the rollout nodes (one function)."""
    config = load_config(None, ["rollout.mode=server", "rl.routing_replay=rollout"])
    assert server_args(config, 1, cuda=False) == [
        "--tensor-parallel-size", "1", "--distributed-executor-backend", "uni"]
    # R3 on GPU: vLLM's own route capture (ours cannot run inside CUDA graphs).
    assert server_args(config, 8, cuda=True) == ["--tensor-parallel-size", "8",
                                                              "--enable-return-routed-experts"]
    assert "--enable-return-routed-experts" not in server_args(
        load_config(None, ["rollout.mode=server"]), 8, cuda=True)


def test_servers_split_the_nodes_gpus():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert rollout_node.device_groups(4, 2, environ) == ["0,1", "2,3", "4,5", "6,7"]
    assert rollout_node.device_groups(1, 8, environ) == ["0,1,2,3,4,5,6,7"]
    with pytest.raises(ConfigError, match="need 16 GPUs; this node has 8"):
        rollout_node.device_groups(2, 8, environ)


def test_refused_engine_exits_with_a_configuration_error(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path), "rollout": {
        "engine": "sglang", "mode": "server", "weight_transport": "files"}}))
    result = subprocess.run([sys.executable, "-m", "megatron_rl.launch.rollout_node", "--config", str(config),
                             "--port", "1"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO), MEGATRON_RL_ROLLOUT_TOKEN="job-secret"))
    assert result.returncode == 2 and "rollout nodes run vLLM servers only" in result.stderr, result.stderr


def test_rollout_node_without_the_jobs_token_is_refused_before_starting(tmp_path):
    """An open server let anyone replace its weights: a node without the job's token never starts one."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path), "rollout": {"mode": "server"}}))
    env = {key: value for key, value in os.environ.items() if key != "MEGATRON_RL_ROLLOUT_TOKEN"}
    result = subprocess.run([sys.executable, "-m", "megatron_rl.launch.rollout_node", "--config", str(config),
                             "--port", "1"], capture_output=True, text=True, timeout=120,
                            env=dict(env, PYTHONPATH=str(REPO)))
    assert result.returncode == 2 and "MEGATRON_RL_ROLLOUT_TOKEN is not set" in result.stderr, result.stderr
    assert not (tmp_path / "rollout").exists()


def disaggregated(tmp_path, overrides: list[str], **options) -> tuple[str, dict]:
    options = SlurmOptions(**{"nodes": 1, "rollout_nodes": 2, **options})
    job = prepare(None, [f"output_dir={tmp_path / 'run'}", *overrides], options, write=True)
    return job.script, yaml.safe_load(job.config_path.read_text())


def test_launch_renders_the_rollout_layout_and_transport(tmp_path):
    script, config = disaggregated(tmp_path, [])
    assert "ROLLOUT_TP=1\nSERVERS_PER_NODE=1\nWEIGHT_TRANSPORT=collective\n" in script
    assert '--servers "$SERVERS_PER_NODE" --tensor-parallel-size "$ROLLOUT_TP"' in script
    assert '"rollout.weight_transport=$WEIGHT_TRANSPORT"' in script
    # The config copy is the one the job runs: servers, the transport resolved (auto -> collective).
    assert config["rollout"]["mode"] == "server" and config["rollout"]["weight_transport"] == "collective"
    assert config["rollout"]["server_urls"] == []
    # On GPU nodes: GPUs per node / rollout.server_tp servers per node (the tiny model has 4 heads).
    script, _ = disaggregated(tmp_path, ["rollout.server_tp=2"], gpus_per_node=4, procs_per_node=1)
    assert "ROLLOUT_TP=2\nSERVERS_PER_NODE=2\n" in script
    script, config = disaggregated(tmp_path, ["rollout.weight_transport=files"])
    assert "WEIGHT_TRANSPORT=files" in script and config["rollout"]["weight_transport"] == "files"


@pytest.mark.parametrize("overrides, options, message", [
    (["rollout.server_tp=3"], {"gpus_per_node": 4, "procs_per_node": 1}, "rollout.server_tp=3 must divide --gpus-per-node=4"),
    (["rollout.server_tp=8"], {"gpus_per_node": 8, "procs_per_node": 1}, "must divide the model's 4 attention heads"),
    (["rollout.engine=sglang", "rollout.weight_transport=files"], {}, "--rollout-nodes starts vLLM servers only"),
])
def test_launch_refuses_a_rollout_layout_that_does_not_fit(tmp_path, overrides, options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        disaggregated(tmp_path, overrides, **options)
    assert not (tmp_path / "run").exists()
