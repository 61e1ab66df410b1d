"""The PEFT export of LoRA adapters (bridge/peft_export.py): loaded by `peft` on the Hugging Face
base, it gives the merged model's logits (W + (alpha / rank) B A merged in Megatron's fused layout,
as the merged export does), for Qwen3-MoE (attention, every expert, the router) and Llama
(attention, MLP); what PEFT cannot load (a Qwen3-MoE dense layer's MLP) is refused by name.

In-process and without Megatron: the adapters are a state dict in Megatron's names, with random
nonzero A and B, on the weights of a tiny random HF model read back in Megatron's fused layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.bridge.layouts import merge, split
from megatron_rl.bridge.lora_merge import merged_weight
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.peft_export import ADAPTER_CONFIG, write_peft_directory
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import load_hf_config, parse_hf_config

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
TOL = 1e-4
ADAPTED = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight", ".linear_fc2.weight",
           ".mlp.router.weight")
TOKENS = [[3, 17, 42, 99, 7, 250, 12, 5, 64, 31]]


def family(name: str) -> dict:
    if name == "qwen3_moe":  # layer 1 dense (mlp_only_layers): its MLP has no PEFT form here
        raw, _ = load_hf_config("tiny-qwen3-moe")
        return dict(raw, vocab_size=300, norm_topk_prob=False, mlp_only_layers=[1])
    raw, _ = load_hf_config("tiny-llama")
    return dict(raw, vocab_size=300)


def make_hf_model(raw: dict, directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.08)
    model.save_pretrained(directory)


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def random_adapters(arch, hf: dict[str, torch.Tensor], dense_mlp: bool = True):
    """{Megatron weight name: (fused W, A, B)} on every adaptable linear (`dense_mlp`: with the
    non-expert MLP's), A and B nonzero."""
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, hf_names, layout in expand(arch):
        mlp = ".linear_fc" in name and ".local_experts." not in name
        if name.endswith(ADAPTED) and (dense_mlp or not mlp):
            weight = merge(layout, [hf[n] for n in hf_names], arch)
            a = torch.randn(RANK, weight.shape[1], generator=generator) * 0.3
            b = torch.randn(weight.shape[0], RANK, generator=generator) * 0.3
            out[name] = (weight, a, b)
    return out


def write_merged(arch, base: Path, adapters, out: Path) -> None:
    """The merged model: W + s B A in Megatron's fused layout, split into HF's pieces."""
    shutil.copytree(base, out)
    tensors = read_weights(base)
    table = {name: (hf, layout) for name, hf, layout in expand(arch)}
    for name, (weight, a, b) in adapters.items():
        hf_names, layout = table[name]
        merged = merged_weight(weight, (a, b, ALPHA / RANK))
        tensors.update(zip(hf_names, (p.contiguous() for p in split(layout, merged, arch))))
    for file in out.glob("*.safetensors*"):
        file.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits[0]


@pytest.mark.parametrize("name", ["qwen3_moe", "llama"])
def test_peft_export_loads_as_the_merged_model(tmp_path, name):
    from transformers import AutoModelForCausalLM

    raw = family(name)
    arch = parse_hf_config(raw)
    base = tmp_path / "base"
    make_hf_model(raw, base)
    adapters = random_adapters(arch, read_weights(base), dense_mlp=name != "qwen3_moe")
    assert any(".linear_qkv." in n for n in adapters) and any(".linear_fc1." in n for n in adapters)
    if name == "qwen3_moe":
        assert any(".local_experts." in n for n in adapters) and any(".router." in n for n in adapters)
    write_merged(arch, base, adapters, tmp_path / "merged")
    exported = tmp_path / "peft"
    exported.mkdir()
    write_peft_directory({n: (a, b) for n, (_, a, b) in adapters.items()}, arch, RANK, ALPHA, 0.0, exported)

    config = json.loads((exported / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32))
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    plain = logits(hf_base)
    loaded = logits(peft.PeftModel.from_pretrained(hf_base, exported))
    assert (merged - plain).abs().max() > 0.1  # the adapters change the output
    assert (loaded - merged).abs().max().item() <= TOL


def test_dense_mlp_of_a_moe_model_is_refused_by_name(tmp_path):
    arch = parse_hf_config(family("qwen3_moe"))
    dense = "decoder.layers.1.mlp.linear_fc1.weight"
    adapters = {dense: (torch.ones(RANK, arch.hidden_size), torch.ones(2 * arch.ffn_hidden_size, RANK))}
    with pytest.raises(ConfigError, match=r"decoder\.layers\.1\.mlp\.linear_fc1\.weight .*gate_proj"):
        write_peft_directory(adapters, arch, RANK, ALPHA, 0.0, tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything is written
