"""HF <-> Megatron bridge on tiny random models that transformers creates locally (no hub).

- round trip HF -> sharded Megatron -> HF directory is bit-exact (names, dtypes, values) at TP2,
  PP2 (tied, and uneven stages), EP2 and TP2 x EP2 (every family x layout: test_layout_matrix.py);
- Megatron logits equal transformers' logits (<= 1e-4, fp32) at TP2, EP2 and TP2 x EP2;
- after optimizer steps, the exported weights load into transformers and reproduce Megatron's logits;
- a checkpoint that does not fit is refused by name before anything is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from _support.processes import REPO, python_command
from _support.rank_pool import RankPools
from megatron_rl.model.hf_config import load_hf_config

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("bridge_worker.py")
LOGIT_TOL = 1e-4
# Megatron's fp32 forward and fp32 logprob kernel against transformers' float64 model and float64
# log_softmax (measured: at most 4e-6).
TEMPERED_TOL = 2e-5
VOCAB = 500  # not a multiple of 128: Megatron pads to 512, the bridge must trim and pad


def family_configs() -> dict[str, dict]:
    moe, _ = load_hf_config("tiny-qwen3-moe")
    qwen3, _ = load_hf_config("tiny-qwen3")
    llama, _ = load_hf_config("tiny-llama")
    return {
        # un-renormalized top-k (router pre-softmax) and one dense layer (mlp_only_layers)
        "qwen3_moe": dict(moe, vocab_size=VOCAB, norm_topk_prob=False, mlp_only_layers=[1]),
        "qwen3": dict(qwen3, vocab_size=VOCAB),  # tied embeddings, qk-norm
        "qwen2": dict(llama, vocab_size=VOCAB, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
        "llama": dict(llama, vocab_size=VOCAB),
        "mixtral": dict(llama, vocab_size=VOCAB, architectures=["MixtralForCausalLM"], model_type="mixtral",
                        num_local_experts=4, num_experts_per_tok=2),
        # MLA with a q LoRA, YaRN, one dense layer then MoE with a shared expert, sigmoid routing
        # over 4 groups (2 chosen) with a correction bias, routed_scaling_factor.
        "deepseek_v3": dict(
            architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64,
            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
            max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=512, beta_fast=32, beta_slow=1,
                                 mscale=1.0, mscale_all_dim=1.0),
            num_nextn_predict_layers=0,
        ),
        # Partial rotary, q/k/v bias and qk-norm, a dense first layer, shared expert, sigmoid routing.
        "glm4_moe": dict(
            architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=VOCAB, hidden_size=64,
            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            n_group=1, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=1, norm_topk_prob=True,
            attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
            max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
            num_nextn_predict_layers=0,
        ),
    }


MOE = {"qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"}
UNEVEN = {"deepseek_v3", "glm4_moe"}  # 3 layers: pipeline stages of 1 and 2


def make_hf_model(raw: dict, directory: Path, seed: int = 0) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norm weights away from 1 and biases away from 0, so a misplaced one changes the output.
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Non-zero, on the scale of the sigmoid scores, so it changes which experts are chosen.
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(directory)


def hf_logits(directory: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def run_worker(ranks: RankPools, mode: str, hf_dir: Path, out: Path, nproc: int, overrides: list[str],
               check: bool = True):
    out.mkdir(parents=True, exist_ok=True)
    args = [mode, "--hf", str(hf_dir), "--out", str(out)]
    for item in overrides:
        args += ["--override", item]
    result = ranks.run(WORKER, nproc, *args)
    if check and result.returncode != 0:
        raise AssertionError(f"{mode} {overrides} failed:\n{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name, raw in family_configs().items():
        make_hf_model(raw, root / name)
        dirs[name] = root / name
    return dirs


LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "ep2": (2, ["parallel.ep=2", "parallel.etp=1"]),
    "tp2ep2": (4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"]),  # expert TP and EP together
}
# Every family x tied/untied x layout is in test_layout_matrix.py (one torchrun per layout, the
# export checked in memory). These cells also write the HF directory (write_hf_checkpoint: shards,
# index, config.json) from sharded models: tied embeddings across pipeline stages, uneven stages
# (DeepSeek-V3's 3 layers as 1 + 2), experts over EP, expert TP with EP.
CASES = [("qwen3", "pp2"), ("deepseek_v3", "pp2"), ("mixtral", "ep2"), ("qwen3_moe", "tp2ep2"), ("llama", "tp2")]


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_round_trip_is_bit_exact_and_logits_match(models, rank_pools, tmp_path, family, layout):
    nproc, overrides = LAYOUTS[layout]
    if layout == "tp2" and family in MOE:
        overrides = overrides + ["parallel.etp=2"]
    if layout == "pp2" and family in UNEVEN:
        overrides = overrides + ["parallel.pp_first_stage_layers=1"]  # 3 layers: 1 + 2
    run_worker(rank_pools, "roundtrip", models[family], tmp_path, nproc, overrides)

    original, exported = read_checkpoint(models[family]), read_checkpoint(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), f"{name} differs after the round trip"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == \
        json.loads((models[family] / "config.json").read_text())["architectures"]

    if layout != "pp2":  # logits are read from a direct forward, which needs the whole model
        from bridge_worker import TOKENS

        megatron = torch.load(tmp_path / "megatron_logits.pt")
        reference = hf_logits(models[family], TOKENS)
        diff = (megatron - reference).abs().max().item()
        print(family, layout, "max |logits diff|", diff)
        assert diff <= LOGIT_TOL


TRAINED = [("qwen3_moe", "ep2"), ("llama", "tp2"), ("qwen3", "tp1")]


@pytest.fixture(scope="module")
def trained(models, rank_pools, tmp_path_factory):
    """run(family, layout): the train mode's output directory, the worker run once per cell for
    every test below that reads it."""
    outputs = {}

    def run(family: str, layout: str) -> Path:
        if (family, layout) not in outputs:
            out = tmp_path_factory.mktemp(f"train-{family}-{layout}")
            nproc, overrides = LAYOUTS[layout]
            run_worker(rank_pools, "train", models[family], out, nproc, overrides)
            outputs[family, layout] = out
        return outputs[family, layout]

    return run


@pytest.mark.parametrize("family, layout", TRAINED)
def test_exported_weights_after_training_reproduce_megatron_logits(models, trained, family, layout):
    out = trained(family, layout)
    from bridge_worker import TOKENS

    after = hf_logits(out / "hf", TOKENS)
    before = hf_logits(models[family], TOKENS)
    megatron = torch.load(out / "megatron_logits.pt")
    assert (after - before).abs().max().item() > 1e-3, "training did not change the weights"
    assert (after - megatron).abs().max().item() <= LOGIT_TOL


def tempered_oracle(logits: torch.Tensor, tokens: list[int], prompt: int,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-token logprobs and entropy of log_softmax(logits / temperature), in float64."""
    logp = torch.log_softmax(logits[prompt - 1: len(tokens) - 1].double() / temperature, dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens[prompt:]).unsqueeze(-1)).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("family, layout", TRAINED)
def test_trainer_logprobs_and_entropy_at_a_temperature_match_transformers(models, trained, family, layout):
    """The distribution the engines sample at rl.temperature is softmax(logits / T): the trainer's
    logprobs and entropy of packed samples (two share a micro-batch; TP2 shards the vocabulary)
    at T = 0.6, from Policy.logprobs and as the loss function of a training step sees them, equal
    transformers' model in float64 with log_softmax(logits / 0.6) in float64, on the same weights.
    Before, the trainer computed softmax(logits) whatever the temperature."""
    from transformers import AutoModelForCausalLM

    tempered = torch.load(trained(family, layout) / "tempered.pt")
    temperature = tempered["temperature"]
    assert temperature == 0.6
    # The eager expert loop: torch's grouped GEMM takes no float64.
    model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    worst = {"logprobs": 0.0, "entropy": 0.0, "train_logprobs": 0.0, "train_entropy": 0.0}
    untempered_gap = 0.0
    for index, (tokens, prompt) in enumerate(zip(tempered["samples"], tempered["prompts"])):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        logprobs, entropy = tempered_oracle(logits, tokens, prompt, temperature)
        expected = {"logprobs": logprobs, "entropy": entropy, "train_logprobs": logprobs, "train_entropy": entropy}
        for key in worst:
            ours = tempered[key][index].double()
            assert ours.shape == expected[key].shape, (key, index)
            worst[key] = max(worst[key], (ours - expected[key]).abs().max().item())
        at_one, _ = tempered_oracle(logits, tokens, prompt, 1.0)
        untempered_gap = max(untempered_gap, (at_one - logprobs).abs().max().item())
    print(family, layout, "max |diff| vs transformers float64 at T=0.6:", worst, "T=1 vs T=0.6:", untempered_gap)
    assert untempered_gap > 0.1  # the check tells the two distributions apart
    assert all(value <= TEMPERED_TOL for value in worst.values()), worst


def _edited_copy(source: Path, target: Path, edit) -> Path:
    target.mkdir()
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            edit(tensors)
            save_file(tensors, target / file.name, metadata={"format": "pt"})
        else:
            (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"),
         "tensor model.layers.0.self_attn.k_proj.weight is missing"),
        (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)),
         "tensor model.layers.0.extra.weight is not used by LlamaForCausalLM"),
        (lambda t: t.__setitem__("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 8)),
         "tensor model.layers.1.mlp.down_proj.weight has shape [64, 8] in the checkpoint but the model needs [128, 256]"),
    ],
    ids=["missing", "extra", "shape"],
)
def test_bad_checkpoints_are_refused_by_name(models, rank_pools, tmp_path, edit, message):
    bad = _edited_copy(models["llama"], tmp_path / "bad", edit)
    result = run_worker(rank_pools, "roundtrip", bad, tmp_path / "out", 2, ["parallel.tp=2"], check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "out" / "hf").exists()


def test_safetensors_metadata_names_are_checkpoint_format(models):
    with safe_open(str(next(models["qwen3_moe"].glob("*.safetensors"))), "pt") as handle:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in handle.keys()


def test_benchmark_quick_runs():
    """benchmarks/bridge_export.py --quick must keep working (it is not part of the suite otherwise)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = python_command(REPO / "benchmarks" / "bridge_export.py", "--quick", preloaded=True, children=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio export/memcpy throughput" in result.stdout and "ratio import/memcpy throughput" in result.stdout
