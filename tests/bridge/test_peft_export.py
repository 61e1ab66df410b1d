"""The PEFT export of LoRA adapters (bridge/peft_export.py): loaded by `peft` on the Hugging Face
base, it gives the merged model's logits (W + (alpha / rank) B A merged in Megatron's fused layout,
as the merged export does), for every family the bridge maps and LoRA can adapt: Qwen3-MoE,
Mixtral, DeepSeek-V3 and GLM-4.5 (attention, every expert, the router) and Llama, Qwen3 and Qwen2
(attention, MLP).
What PEFT cannot load (a MoE model's dense-layer MLP or shared experts) is refused by name.

In-process and without Megatron: the adapters are a state dict in Megatron's names, with random
nonzero A and B, on the weights of a tiny random HF model (the bridge tests' configs) read back in
Megatron's fused layout.

Which base adapter_config.json names (tools/convert_lora.trained_base), in one forked process
(peft_export_worker.py): `megatron-rl convert megatron-to-peft` on checkpoints the trainer's own
writers make (a run from random initialization, one from checkpoint.init_from, megatron-rl sft's,
peft-to-megatron's and a run from it, a MoE run whose expert bias moved): peft on the named base
gives the run's merged model, or the export is refused by name.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.bridge.layouts import merge, split
from megatron_rl.bridge.lora_merge import merged_weight
from megatron_rl.bridge.mappings import expand
from megatron_rl.bridge.peft_export import ADAPTER_CONFIG, lora_target, write_peft_directory
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import parse_hf_config
from megatron_rl.model.layout_checks import family_lora_targets

sys.path.insert(0, str(Path(__file__).parent))
from test_bridge import family_configs, make_hf_model  # noqa: E402

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
TOL = 1e-4
TOKENS = [[3, 17, 42, 99, 7, 250, 12, 5, 64, 31]]


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def adapted(name: str, targets: list[str]) -> bool:
    """Whether one of `targets` adapts Megatron weight `name` (peft_export's table of them)."""
    return lora_target(name) in targets


def random_adapters(arch, hf: dict[str, torch.Tensor], targets: list[str]):
    """{Megatron weight name: (fused W, A, B)} on every linear of `targets`, A and B nonzero."""
    generator = torch.Generator().manual_seed(1)
    out = {}
    for name, hf_names, layout in expand(arch):
        if adapted(name, targets):
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


# What a run on each family can adapt (model/layout_checks.py) and PEFT can load: a MoE family's
# dense MLP and shared experts (fc1, fc2) are refused below. Multi-latent attention's qkv is its
# q_a_proj, q_b_proj, kv_a_proj_with_mqa and kv_b_proj, or (q_lora_rank null, as DeepSeek-V2-Lite
# has) q_proj instead of the q pair.
PEFT_TARGETS = {
    "qwen3_moe": ["qkv", "proj", "experts", "router"],
    "mixtral": ["qkv", "proj", "experts", "router"],
    "deepseek_v3": ["qkv", "proj", "experts", "router"],
    "deepseek_v3_q_proj": ["qkv", "proj", "experts", "router"],
    "glm4_moe": ["qkv", "proj", "experts", "router"],
    "llama": ["qkv", "proj", "fc1", "fc2"],
    "qwen3": ["qkv", "proj", "fc1", "fc2"],  # tied embeddings, qk-norm
    "qwen2": ["qkv", "proj", "fc1", "fc2"],  # q/k/v biases
}


def peft_family_config(name: str) -> dict:
    """The tiny HF config of PEFT_TARGETS' `name` (the bridge tests' families, and DeepSeek-V3
    without q_lora_rank)."""
    if name == "deepseek_v3_q_proj":
        return dict(family_configs()["deepseek_v3"], q_lora_rank=None)
    return family_configs()[name]


@pytest.mark.parametrize("name", list(PEFT_TARGETS))
def test_peft_export_loads_as_the_merged_model(tmp_path, name):
    from transformers import AutoModelForCausalLM

    raw = peft_family_config(name)
    arch = parse_hf_config(raw)
    targets = PEFT_TARGETS[name]
    assert set(targets) == set(family_lora_targets(arch)) - ({"fc1", "fc2"} if arch.is_moe else set())
    base = tmp_path / "base"
    make_hf_model(raw, base)
    adapters = random_adapters(arch, read_weights(base), targets)
    for target in targets:  # every target has adapters
        assert any(adapted(n, [target]) for n in adapters), target
    write_merged(arch, base, adapters, tmp_path / "merged")
    exported = tmp_path / "peft"
    exported.mkdir()
    write_peft_directory({n: (a, b) for n, (_, a, b) in adapters.items()}, arch, RANK, ALPHA, 0.0, exported)

    config = json.loads((exported / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    if arch.mla is not None:  # every projection of multi-latent attention has its adapter
        modules = {key.split(".self_attn.")[1].split(".")[0]
                   for key in load_file(exported / "adapter_model.safetensors") if ".self_attn." in key}
        queries = {"q_proj"} if raw["q_lora_rank"] is None else {"q_a_proj", "q_b_proj"}
        assert modules == queries | {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}, modules
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32))
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    plain = logits(hf_base)
    loaded = logits(peft.PeftModel.from_pretrained(hf_base, exported))
    assert (merged - plain).abs().max() > 0.1  # the adapters change the output
    assert (loaded - merged).abs().max().item() <= TOL


# A dense layer's MLP (Qwen3-MoE's mlp_only_layers, GLM-4.5's first_k_dense_replace) and the
# shared experts (DeepSeek-V3) share the experts' module names, which PEFT fuses on load.
REFUSED = [("qwen3_moe", "decoder.layers.1.mlp.linear_fc1.weight", "gate_proj"),
           ("glm4_moe", "decoder.layers.0.mlp.linear_fc2.weight", "down_proj"),
           ("deepseek_v3", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "gate_proj")]


@pytest.mark.parametrize("name, weight, leaf", REFUSED, ids=[r[0] for r in REFUSED])
def test_dense_mlp_of_a_moe_model_is_refused_by_name(tmp_path, name, weight, leaf):
    arch = parse_hf_config(family_configs()[name])
    adapters = {weight: (torch.ones(RANK, 8), torch.ones(8, RANK))}
    with pytest.raises(ConfigError, match=rf"{weight.replace('.', '[.]')} .*{leaf}.*merged Hugging Face export"):
        write_peft_directory(adapters, arch, RANK, ALPHA, 0.0, tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


# ---- which base the export names: megatron-rl convert megatron-to-peft on a run's checkpoints --------

WORKER = Path(__file__).with_name("peft_export_worker.py")


def model_logits(directory: Path, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return logits(peft.PeftModel.from_pretrained(model, adapter) if adapter is not None else model)


@pytest.mark.subprocess
def test_the_export_names_the_base_the_adapters_were_trained_on(tmp_path):
    """A LoRA run's adapters mean what they mean on the base they were trained on (checkpoint/
    base_ref.py), which is not model.hf_config's weights unless the run loaded them. One process
    (peft_export_worker.py) writes a run's checkpoint from random initialization (its base in
    checkpoints/base/), one from checkpoint.init_from=hf/, and `megatron-rl sft`'s checkpoint (base
    and adapters together), with the live merged export of each policy; megatron-to-peft on each:
    peft on the base adapter_config.json names gives the run's merged model within 1e-4. A base
    that is no Hugging Face directory is refused by name without --write-base, and written as
    OUT/base/ with it. peft-to-megatron takes the adapter back on the base it names, and refuses
    hf/ (another base); its checkpoint of an adapter on hf/ exports again naming hf/, and so does a
    run started from that checkpoint."""
    from _support.processes import child_env, python_command

    make_hf_model(family_configs()["llama"], tmp_path / "hf")
    make_hf_model(family_configs()["glm4_moe"], tmp_path / "hf_moe")
    done = subprocess.run(python_command(WORKER, tmp_path, preloaded=True), capture_output=True, text=True,
                          env=child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    runs, paths, out, hf = result["runs"], result["paths"], tmp_path / "out", (tmp_path / "hf").resolve()

    # Refused by name without --write-base: the base is no Hugging Face directory, and nothing is written.
    random_base = (tmp_path / "random" / "checkpoints" / "base").resolve()
    for name, trained_on in (("random", f"trained on the megatron-rl checkpoint {random_base} (the run's initial "
                                        "weights (the frozen base of its LoRA adapters))"),
                             ("sft", f"trained on the base weights {tmp_path / 'sft'} holds beside them (from random "
                                     "init (seed ")):
        assert runs[name]["code"] == 2 and not (out / name).exists(), runs[name]
        message = runs[name]["error"][0]
        assert trained_on in message and f"pass --write-base to write that base as a Hugging Face directory " \
                                          f"{out / name / 'base'} beside the adapter" in message, message
    assert f"(the run's model.hf_config {tmp_path / 'hf'} gives only its architecture)" in runs["random"]["error"][0]

    merged = {run: model_logits(tmp_path / f"merged_{run}") for run in ("random", "init_from", "from_imported")}
    cases = [("random_write_base", "random", out / "random_write_base" / "base"),
             ("sft_write_base", "random", out / "sft_write_base" / "base"),
             ("init_from", "init_from", hf),
             ("init_from_write_base", "init_from", out / "init_from_write_base" / "base"),
             # peft-to-megatron's checkpoint holds hf/'s weights converted exactly (it records hf/ with its
             # checksums): exported again, and a run from it, name hf/.
             ("reexport", "init_from", hf),
             ("from_imported", "from_imported", hf)]
    assert runs["import_init_from"]["code"] == 0, runs["import_init_from"]
    for name, run, base in cases:
        assert runs[name]["code"] == 0, (name, runs[name])
        named = json.loads((out / name / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
        assert named == str(base.resolve()), (name, named)
        difference = (model_logits(Path(named), out / name) - merged[run]).abs().max().item()
        print(f"{name}: max |peft on {Path(named).name}/ - the run's merged model| = {difference:.2e}")
        assert difference <= TOL, (name, difference)
    assert (merged["random"] - model_logits(out / "random_write_base" / "base")).abs().max() > 0.1  # B is not 0
    # The export once named model.hf_config (hf/) for the random run: peft there is another model.
    wrong = (model_logits(hf, out / "random_write_base") - merged["random"]).abs().max().item()
    print(f"peft on model.hf_config's weights (the base once named) - the run's merged model: {wrong:.2f}")
    assert wrong > 0.5

    assert runs["import_named_base"]["code"] == 0, runs["import_named_base"]
    refused = runs["import_other_base"]
    assert refused["code"] == 2 and not (out / "import_other_base").exists()
    assert f"base_model_name_or_path='{out / 'random_write_base' / 'base'}' names the base the adapter was trained " \
           f"on, and its weights differ from those of --hf {tmp_path / 'hf'}" in refused["error"][0], refused

    # A run that moved its routers' expert bias: PEFT on the base would route as the base does.
    assert runs["moe_still"]["code"] == 0, runs["moe_still"]
    assert json.loads((out / "moe_still" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == \
        str((tmp_path / "hf_moe").resolve())
    moved = runs["moe_moved"]
    assert moved["code"] == 2 and not (out / "moe_moved").exists(), moved
    assert f"{paths['moe_moved']}: its decoder.layers.1.mlp.router.expert_bias (the router's expert bias, which the " \
           "run moved" in moved["error"][0] and "(largest difference 0.05)" in moved["error"][0], moved

    # The merged export of a checkpoint whose base is a megatron-rl checkpoint (checkpoints/base/,
    # written before the bias moved): the checkpoint's own expert bias, not the base's, so it is the
    # run's live merged export.
    assert runs["moe_merge"]["code"] == 0, runs["moe_merge"]
    live = load_file(str(tmp_path / "merged_moe_merge" / "model.safetensors"))
    converted = {k: v for f in (out / "moe_merge").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert converted.keys() == live.keys()
    loaded = {k: v for f in (tmp_path / "hf_moe").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.allclose(live[bias] - loaded[bias], torch.full_like(live[bias], 0.05))  # moved since the base
    for name in sorted(live):
        difference = (converted[name].double() - live[name].double()).abs().max().item()
        assert difference <= 1e-6, f"--merge-lora's {name} is {difference:.3g} away from the run's merged model"
