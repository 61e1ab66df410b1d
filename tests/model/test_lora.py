"""LoRA on the Megatron MoE policy (model/lora.py, bridge/lora_merge.py).

In-process: the config and its refusals by name, the targets per family. One two-rank job in the
module's rank pool (lora_worker.py): one LoRA linear in float64 against the hand computation
(column and row parallel, alone, split with sequence parallelism, and as an expert linear split
over expert-TP), then the tiny MoE at EP2: B = 0 gives the base model's logprobs exactly; the
base gets no gradient and the optimizer holds exactly the adapters; optimizer-state bytes against
full fine-tuning; one expert's adapter through SequentialMLP; the HF export merged.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config
from megatron_rl.model.layout_checks import check_divisibility, lora_targets

WORKER = Path(__file__).with_name("lora_worker.py")
F64 = 1e-12  # float64 against float64: only the order of the sums differs
FP32 = 2e-5  # the fp32 model against float64 by hand


def arch_of(preset: str):
    return parse_hf_config(*load_hf_config(preset))


# ---- config -----------------------------------------------------------------------------------

def test_lora_config_shape_and_defaults():
    config = load_config(None, ["model.lora.rank=16"])
    lora = config.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.targets, lora.init) == (16, 16.0, 0.0, None, "kaiming")
    assert load_config(None, []).model.lora is None  # off by default: full fine-tuning
    config = load_config(None, ["model.lora.targets=[qkv,experts,router]", "model.lora.init=gaussian"])
    assert config.model.lora.targets == ["qkv", "experts", "router"]


@pytest.mark.parametrize("override, named", [
    ("model.lora.rank=0", "model.lora.rank must be >= 1"),
    ("model.lora.rank=-4", "model.lora.rank must be >= 1"),
    ("model.lora.alpha=0", "model.lora.alpha must be a finite number > 0"),
    ("model.lora.alpha=-1", "model.lora.alpha must be a finite number > 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout must be in [0, 1)"),
    ("model.lora.targets=[qkv,mlp]", "model.lora.targets[1]: 'mlp' is not one of"),
    ("model.lora.targets=[]", "model.lora.targets is empty"),
    ("model.lora.targets=[qkv,qkv]", "names 'qkv' twice"),
    ("model.lora.init=zeros", "model.lora.init: 'zeros' is not one of"),
])
def test_bad_lora_settings_are_refused_by_name(override, named):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert named in str(info.value), str(info.value)


def test_targets_follow_the_family():
    lora = load_config(None, ["model.lora.rank=8"]).model.lora
    # The tiny Qwen3-MoE: every layer MoE, no shared experts, so no dense fc1 / fc2.
    assert lora_targets(lora, arch_of("tiny-qwen3-moe")) == ["qkv", "proj", "experts"]
    assert lora_targets(lora, arch_of("tiny-llama")) == ["qkv", "proj", "fc1", "fc2"]
    assert lora_targets(lora, arch_of("tiny-glm4-moe")) == ["qkv", "proj", "fc1", "fc2", "experts"]  # shared experts
    assert lora_targets(lora, arch_of("tiny-deepseek-v3")) == ["qkv", "proj", "fc1", "fc2", "experts"]


@pytest.mark.parametrize("preset, target, why", [
    ("tiny-llama", "experts", "it is a dense model (no experts)"),
    ("tiny-llama", "router", "it is a dense model (no router)"),
    ("tiny-qwen3-moe", "fc1", "no dense fc1/fc2"),
])
def test_targets_the_model_lacks_are_refused_before_building(preset, target, why):
    config = load_config(None, [f"model.hf_config={preset}", f"model.lora.targets=[proj,{target}]"])
    with pytest.raises(ConfigError) as info:
        check_divisibility(arch_of(preset), config)  # preflight's check_layout and the builder call it
    message = str(info.value)
    assert f"model.lora.targets: {arch_of(preset).architecture} has no {target!r}" in message and why in message


def test_converting_a_lora_checkpoint_to_hf_is_refused_by_name(tmp_path):
    """tools' megatron-to-hf reads the base weights only: a LoRA run's checkpoint (base and
    adapters side by side) would come out as the base model, so it is refused, naming a key."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_rl.bridge.streamed import write_hf_from_torch_dist
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index

    weights = tmp_path / "weights"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"decoder.layers.self_attention.linear_qkv.weight": torch.zeros(4, 2),
                  "decoder.layers.self_attention.linear_qkv.lora_A": torch.zeros(1, 2)},
                 storage_writer=dcp.FileSystemWriter(str(weights)), no_dist=True)
    with pytest.raises(ConfigError, match=r"holds LoRA adapters \(decoder.layers.self_attention.linear_qkv.lora_A"):
        write_hf_from_torch_dist(None, None, weights, read_torch_dist_index(weights), tmp_path / "out", precision="fp32")


def test_adapters_of_a_checkpoint_without_lora_are_refused_by_name(tmp_path):
    """convert megatron-to-peft / megatron-to-hf --merge-lora on a run without model.lora."""
    from megatron_rl.tools.convert_lora import recorded_model, require_lora

    (tmp_path / "trainer_state.json").write_text(json.dumps({"config": {"model": {"lora": None}}}))
    with pytest.raises(ConfigError, match=r"not a checkpoint of a LoRA run: its trainer_state.json names no "
                                          r"model.lora, so it holds no adapters to export"):
        require_lora(tmp_path, recorded_model(tmp_path).get("lora"), "export")
    assert require_lora(tmp_path, {"rank": 4}, "merge") == {"rank": 4}


def test_lora_with_fp8_training_or_transformer_engine_layers_is_refused():
    with pytest.raises(ConfigError, match="model.lora with FP8 training"):
        load_config(None, ["model.lora.rank=8", "model.precision=bf16", "model.fp8_recipe=blockwise"])
    with pytest.raises(ConfigError, match="model.lora is built on the local layer spec's linears"):
        load_config(None, ["model.lora.rank=8", "model.layer_spec=transformer_engine"])


# ---- two ranks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory, rank_pools) -> list[dict]:
    out = tmp_path_factory.mktemp("lora")
    result = rank_pools.run(WORKER, 2, "--out", str(out))
    assert result.returncode == 0, result.stderr[-6000:]
    return [dict(json.loads((out / f"rank{rank}.json").read_text()), out=str(out)) for rank in range(2)]


multiprocess = pytest.mark.multiprocess  # the two-rank job (pyproject marks)


@multiprocess
@pytest.mark.parametrize("case", ["column_1rank", "row_1rank", "column_tp2_sp", "row_tp2_sp",
                                  "column_etp2_expert", "row_etp2_expert"])
def test_one_lora_linear_against_the_hand_computation(results, case):
    for rank, result in enumerate(results):
        errors = result["linear"][case]
        assert errors.pop("weight_grad") is False, (rank, case)  # the frozen base
        assert max(errors.values()) <= F64, (rank, case, errors)


@multiprocess
def test_zero_b_gives_the_base_model_exactly(results):
    # the base loaded from a checkpoint without adapters (checkpoint.init_from's Policy.load_model):
    # every base tensor equal, the adapters untouched (before, torch_dist refused the missing keys)
    for result in results:
        assert result["missing_are_adapters"]
        assert result["b0_logprob_diff"] == 0.0, result["b0_logprob_diff"]


@multiprocess
def test_base_frozen_and_the_optimizer_holds_only_the_adapters(results):
    arch = arch_of("tiny-qwen3-moe")
    rank, hidden, heads, groups, dim = 4, arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    qkv = rank * hidden + (heads + 2 * groups) * dim * rank
    proj = rank * heads * dim + hidden * rank
    expert = (rank * hidden + 2 * arch.moe_ffn_hidden_size * rank) + (rank * arch.moe_ffn_hidden_size + hidden * rank)
    local_experts = arch.num_experts // 2  # EP2
    expected = arch.num_layers * (qkv + proj + local_experts * expert)
    for result in results:
        assert result["lora_step_updated"] and result["b_nonzero_after_step"]
        assert result["base_requires_grad"] == [] and result["base_with_grad"] == []
        assert result["optimizer_is_adapters"]
        assert result["optimizer_numel"] == result["adapter_numel"] == expected, (result["optimizer_numel"], expected)
        assert all(".self_attention.linear_qkv." in n or ".self_attention.linear_proj." in n
                   or ".mlp.experts.local_experts." in n for n in result["adapter_names"])


@multiprocess
def test_optimizer_state_is_a_small_share_of_full_fine_tuning(results):
    # Adam's two moments over both ranks: 114,688 bytes for rank 4 against 1,711,616 for full
    # fine-tuning (6.7%; the tiny model's 64-wide layers make rank 4 a large share of them).
    state = results[0]["optimizer_state_bytes"]
    assert 0 < state["lora"] <= 0.1 * state["full"], state


@multiprocess
def test_one_experts_adapter_through_the_experts(results):
    for result in results:
        assert result["expert_max_error"] <= FP32, result["expert_max_error"]


@multiprocess
def test_hf_export_is_the_merged_weight(results):
    for result in results:
        # qkv (3 HF pieces) + proj per layer, fc1 (2) + fc2 per local and gathered expert checked locally
        assert result["export_merged_tensors"] >= 2 * (3 + 1 + 2 * 3), result["export_merged_tensors"]
        assert result["export_max_error"] <= FP32, result["export_max_error"]


@multiprocess
def test_a_checkpoint_refers_to_its_base_and_loads_over_it(results):
    """checkpoint.base_weights=referenced (the default under model.lora): the training checkpoint
    holds the adapters, their optimizer moments, the routers' state and the KL reference's
    adapters, no base weight; it names
    its base with every file's checksum; a policy with every weight moved, loaded from it, is the
    saved policy bit for bit (so its base came from the base, not from anywhere else); a base file
    with one byte changed is refused by name, before the run trains on anything. A base file
    rewritten (same size) after the check and before the load, a torch_dist one and a Hugging Face
    one (16 embedding values +1.0), is refused by the load that reads it: the CRC-32 is compared
    on the bytes loaded."""
    from megatron_rl.checkpoint.unpickling import read_torch_dist_index

    ckpt = Path(results[0]["referenced_ckpt"])
    keys = {index.fqn.split("/")[0] for index in read_torch_dist_index(ckpt / "weights").storage_data}
    model_keys = {k for k in keys if not k.startswith("optimizer.") and not k.endswith("._extra_state")}
    assert model_keys and all(k.endswith((".lora_A", ".lora_B", "router.expert_bias")) for k in model_keys), \
        sorted(k for k in model_keys if not k.endswith((".lora_A", ".lora_B")))[:5]
    assert {k.split(".", 2)[2] for k in keys if k.startswith("optimizer.")} <= model_keys
    base = json.loads((ckpt / "megatron_rl.json").read_text())["base"]
    assert base["path"] == "../base" and base["kind"] == "megatron"
    base_keys = {index.fqn.split("/")[0] for index in read_torch_dist_index(ckpt.parent / "base").storage_data}
    assert base_keys and not any(k.endswith((".lora_A", ".lora_B")) for k in base_keys)
    weights_bytes = sum(f.stat().st_size for f in (ckpt / "weights").glob("*.distcp"))
    base_bytes = sum(f.stat().st_size for f in (ckpt.parent / "base").glob("*.distcp"))
    assert weights_bytes < 0.6 * base_bytes, (weights_bytes, base_bytes)  # adapters + 2 moments vs the base
    out = Path(results[0]["out"])
    for result in results:
        assert result["loaded_equal"] and result["loaded_logprob_diff"] == 0.0, result["loaded_logprob_diff"]
        # the KL reference: the adapters only (the base is frozen, so the base), restored bit for bit
        assert result["reference_equal"] and result["reference_names"]
        assert all(name.endswith((".lora_A", ".lora_B")) for name in result["reference_names"])
        # checkpoint.init_from a Hugging Face directory: named by its absolute path, read from it
        assert result["hf_base"] == {"kind": "hf", "path": str((out / "base").resolve())}, result["hf_base"]
        assert result["hf_base_files"] == ["config.json", "model.safetensors"], result["hf_base_files"]
        assert result["hf_loaded_logprob_diff"] <= FP32, result["hf_loaded_logprob_diff"]
        refused = result["changed_base_refused"]
        assert refused is not None and "has changed" in refused and result["changed_file"] in refused, refused
        assert "CRC-32" in refused and str(ckpt) in refused
        for swapped, name in (("swapped_base_refused", result["changed_file"]),
                              ("swapped_hf_base_refused", "model.safetensors")):
            refused = result[swapped]
            assert refused is not None and f"has changed: {name} has CRC-32 " in refused, (swapped, refused)
            assert "when the run read it" in refused, refused


@multiprocess
def test_the_merged_export_of_a_checkpoint_on_a_hf_base_is_refused_by_name(results):
    """megatron-to-hf --merge-lora streams the base from torch_dist: a checkpoint whose base is a
    Hugging Face directory is refused, naming it and the three ways to a merged model."""
    from megatron_rl.checkpoint.format import read_metadata
    from megatron_rl.tools.convert_lora import base_weights_for_merge

    ckpt = Path(results[0]["referenced_hf_ckpt"])
    with pytest.raises(ConfigError, match="refers to its base, the Hugging Face model") as refused:
        base_weights_for_merge(ckpt, read_metadata(ckpt))
    assert "megatron-to-peft" in str(refused.value) and "hf_model/" in str(refused.value)


@multiprocess
def test_a_checkpoint_with_adapters_is_refused_by_a_model_without_them(results):
    """checkpoint.init_from (or a teacher) of a checkpoint holding LoRA adapters into a model built
    without model.lora would load the base alone: refused by name, from the adapters in the
    checkpoint's torch_dist index, whether or not the checkpoint records the run's model.lora.
    (Stand-in models: only their parameter names are read.)"""
    import torch

    from megatron_rl.checkpoint.format import _refuse_dropped_adapters, weights_path

    ckpt = Path(results[0]["out"]) / "ckpt"  # the EP2 LoRA policy after its step
    plain, adapted = torch.nn.Module(), torch.nn.Module()
    plain.weight = torch.nn.Parameter(torch.zeros(1))
    adapted.lora_A = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ConfigError, match="holds LoRA adapters, and the model built to load it has none"):
        _refuse_dropped_adapters(type("Plain", (), {"module": plain})(), ckpt, weights_path(ckpt))
    _refuse_dropped_adapters(type("Adapted", (), {"module": adapted})(), ckpt, weights_path(ckpt))
    base = Path(results[0]["referenced_ckpt"]).parent / "base"  # written without adapters
    _refuse_dropped_adapters(type("Plain", (), {"module": plain})(), base, weights_path(base))


def hf_logits(directory, tokens, adapter=None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@multiprocess
@pytest.mark.subprocess
def test_a_lora_checkpoint_converts_to_peft_and_to_the_merged_model(results, tmp_path):
    """`megatron-rl convert` on the worker's EP2 checkpoint after a step (B nonzero), in one
    process: megatron-to-peft --write-base's directory, loaded by peft on the base it wrote and
    names (the checkpoint holds its base), gives the live merged export's logits; megatron-to-hf
    --merge-lora writes the live merged export's tensors."""
    import subprocess

    from safetensors.torch import load_file

    from _support.processes import child_env, python_command

    pytest.importorskip("peft")
    out = Path(results[0]["out"])
    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    # The same step's training checkpoint that refers to its base (test above): merged from that base.
    referenced, merged_from_base = results[0]["referenced_ckpt"], tmp_path / "merged_from_base"
    script = ("import sys; from megatron_rl.tools.convert import main; "
              f"sys.exit(main(['megatron-to-peft', '--write-base', '--ckpt', {str(out / 'ckpt')!r}, '--out', "
              f"{str(peft_dir)!r}]) or "
              f"main(['megatron-to-hf', '--merge-lora', '--ckpt', {str(out / 'ckpt')!r}, '--out', {str(merged_dir)!r}])"
              f" or main(['megatron-to-hf', '--merge-lora', '--ckpt', {referenced!r}, '--out', {str(merged_from_base)!r}]))")
    done = subprocess.run(python_command("-c", script, preloaded=True), capture_output=True, text=True, env=child_env(),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    live = load_file(str(out / "merged" / "model.safetensors"))
    converted = {k: v for f in merged_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert converted.keys() == live.keys()
    assert max((converted[k].float() - live[k].float()).abs().max().item() for k in live) <= 1e-6
    from_base = {k: v for f in merged_from_base.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert from_base.keys() == live.keys()
    assert max((from_base[k].float() - live[k].float()).abs().max().item() for k in live) <= 1e-6
    tokens = [3, 17, 42, 99, 7, 120, 12, 5]
    merged = hf_logits(out / "merged", tokens)
    assert (merged - hf_logits(out / "base", tokens)).abs().max() > 1e-3  # the adapters moved the model
    # The checkpoint holds its base: --write-base writes it beside the adapter (peft_dir/base), named there.
    assert json.loads((peft_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str((peft_dir / "base").resolve())
    assert (hf_logits(peft_dir / "base", tokens, adapter=peft_dir) - merged).abs().max().item() <= 1e-4
    assert (hf_logits(out / "base", tokens, adapter=peft_dir) - merged).abs().max().item() <= 1e-4
