"""The PEFT import (bridge/peft_import.py, `megatron-rl convert peft-to-megatron`): the inverse of
the export (test_peft_export.py).

In process: adapters in Megatron's names (random, nonzero A and B, on the tiny random HF models of
the bridge tests) exported as a PEFT directory and read back are bit-identical to the originals,
with the model.lora they imply, for every family the export writes; what cannot be imported is
refused by name (A matrices that differ across a fused module, DoRA, rsLoRA, layers_to_transform,
exclude_modules and every other adapter_config.json setting that changes peft's model, an
initialization that changes the base, an unknown key, a target_modules peft would read otherwise,
an adapter named for another base, an unknown tensor, a pickled adapter_model.bin, a shape that
does not fit the base, a fused module or a target with a piece missing); every accepted setting
gives peft's own model; every field of the installed peft's LoraConfig is classified; a run whose
model.lora disagrees with the imported checkpoint's is refused by checkpoint.init_from.
In one forked process (peft_import_worker.py): an adapter written by peft itself (Qwen3) and an
exported one (Qwen3-MoE: experts and router too) converted by the command and loaded into the
LoRA policy give the PEFT model's logits, and the policy's adapters are the originals bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.bridge.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_tensors, write_peft_directory
from megatron_rl.bridge.peft_import import HONOURED, UNREPRESENTABLE, base_shapes, read_peft_adapter
from megatron_rl.bridge.peft_import import METADATA as HARMLESS_KEYS
from megatron_rl.checkpoint.format import FORMAT, METADATA, load_initial_weights
from megatron_rl.checkpoint.lora_record import check_run_lora
from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.model.hf_config import parse_hf_config

sys.path.insert(0, str(Path(__file__).parent))
from test_bridge import family_configs, hf_logits, make_hf_model  # noqa: E402
from test_peft_export import ALPHA, PEFT_TARGETS, RANK, peft_family_config, random_adapters, read_weights  # noqa: E402
from peft_import_worker import TOKENS  # noqa: E402

peft = pytest.importorskip("peft")

WORKER = Path(__file__).with_name("peft_import_worker.py")
TOL = 1e-4
Q = "base_model.model.model.layers.0.self_attn"


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """family -> (arch, tiny random HF base directory), each made once."""
    made = {}

    def base(name: str):
        if name not in made:
            raw = peft_family_config(name)
            directory = tmp_path_factory.mktemp(name) / "base"
            make_hf_model(raw, directory)
            made[name] = parse_hf_config(raw), directory
        return made[name]

    return base


def exported(arch, base: Path, targets: list[str], directory: Path) -> dict:
    """Random adapters (nonzero A and B) on `targets`, written by the export into `directory`."""
    adapters = {n: (a, b) for n, (_, a, b) in random_adapters(arch, read_weights(base), targets).items()}
    directory.mkdir(exist_ok=True)
    write_peft_directory(adapters, arch, RANK, ALPHA, 0.0, directory)
    return adapters


@pytest.mark.parametrize("name", list(PEFT_TARGETS))
def test_exported_adapters_import_back_bit_identical(hf_base, tmp_path, name):
    arch, base = hf_base(name)
    adapters = exported(arch, base, PEFT_TARGETS[name], tmp_path)
    imported = read_peft_adapter(tmp_path, arch, base_shapes(base))
    assert imported.lora == {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": PEFT_TARGETS[name]}
    assert sorted(imported.adapters) == sorted(adapters)
    for weight, (a, b) in adapters.items():
        assert torch.equal(imported.adapters[weight][0], a) and torch.equal(imported.adapters[weight][1], b), weight


# ---- refusals, by name ----------------------------------------------------------------------------

def edit_tensors(directory: Path, change) -> None:
    tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    change(tensors)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))


def edit_config(directory: Path, **values) -> None:
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    (directory / ADAPTER_CONFIG).write_text(json.dumps(dict(config, **values)))


def refused(arch, base: Path, directory: Path) -> str:
    with pytest.raises(ConfigError) as info:
        read_peft_adapter(directory, arch, base_shapes(base))
    return str(info.value)


def shifted(key: str, by: float):
    def change(tensors):
        tensors[key] = tensors[key] + by
    return change


def test_differing_a_matrices_of_a_fused_module_are_refused(hf_base, tmp_path):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv", "fc1"], tmp_path)
    edit_tensors(tmp_path, shifted(f"{Q}.k_proj.lora_A.weight", 0.25))
    message = refused(arch, base, tmp_path)
    assert "the lora_A of model.layers.0.self_attn.k_proj differs from that of model.layers.0.self_attn.q_proj" \
           in message and "largest difference 0.25" in message and "no exact form at rank 4" in message, message


def test_differing_gate_and_up_a_of_one_expert_are_refused(hf_base, tmp_path):
    arch, base = hf_base("qwen3_moe")
    exported(arch, base, ["experts"], tmp_path)
    expert = "base_model.model.model.layers.0.mlp.experts.3"
    edit_tensors(tmp_path, shifted(f"{expert}.up_proj.lora_A.weight", -0.5))
    message = refused(arch, base, tmp_path)
    assert "lora_A of model.layers.0.mlp.experts.3.up_proj differs from that of model.layers.0.mlp.experts.3.gate_proj" \
           in message and "largest difference 0.5" in message, message


# adapter_config.json, key by key (bridge/peft_import.py's tables): every setting that changes the
# model, at a value that does, refused naming the file, the key, the value and what to do.
NOT_DEFAULT = [("use_dora", True), ("use_rslora", True), ("modules_to_save", ["lm_head"]),
               ("rank_pattern", {"q_proj": 8}), ("alpha_pattern", {"q_proj": 4}),
               ("target_parameters", ["mlp.experts.gate_up_proj"]), ("bias", "all"), ("bias", "lora_only"),
               ("layers_to_transform", [0]), ("layers_to_transform", 0), ("layers_pattern", "layers"),
               ("exclude_modules", ["o_proj"]), ("exclude_modules", ".*o_proj"), ("lora_bias", True),
               ("fan_in_fan_out", True), ("layer_replication", [[0, 2], [1, 2]]), ("trainable_token_indices", [0, 1]),
               ("alora_invocation_tokens", [5, 6]), ("use_qalora", True), ("use_bdlora", {"nblocks": 2}),
               ("arrow_config", {"top_k": 2}), ("velora_config", {"num_groups": 2}),
               ("monteclora_config", {"num_samples": 2}), ("kasa_config", {"beta": 1.0}),
               # empty, yet on: peft makes a variant's {} its default config, and [] a selection of tokens
               ("kasa_config", {}), ("arrow_config", {}), ("use_bdlora", {}), ("trainable_token_indices", [])]


@pytest.mark.parametrize("key, value", NOT_DEFAULT, ids=[f"{k}={v!r}" for k, v in NOT_DEFAULT])
def test_settings_model_lora_cannot_represent_are_refused(hf_base, tmp_path, key, value):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv", "proj"], tmp_path)
    edit_config(tmp_path, **{key: value})
    message = refused(arch, base, tmp_path)
    assert message.startswith(f"{tmp_path / ADAPTER_CONFIG}: {key}={value!r} {UNREPRESENTABLE[key]}; "), message
    assert "merge_and_unload" in message, message


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "mica", "zeros", 1])
def test_an_initialization_that_changes_the_base_is_refused(hf_base, tmp_path, init):
    """peft runs init_lora_weights when it builds the model from the adapter: PiSSA, OLoRA, CorDA,
    LoftQ and LoRA-GA subtract the initial adapter from the base weights (or quantize them), MiCA
    is a variant; an unknown one is refused too."""
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv"], tmp_path)
    edit_config(tmp_path, init_lora_weights=init)
    message = refused(arch, base, tmp_path)
    assert message.startswith(f"{tmp_path / ADAPTER_CONFIG}: init_lora_weights={init!r} "), message
    changes = isinstance(init, str) and init != "zeros"
    assert ("changes the base weights" in message) == changes and "merge_and_unload" in message, message


def test_an_unknown_key_is_refused_by_name(hf_base, tmp_path):
    """peft ignores a key it does not know (a newer peft's setting): refused, not ignored."""
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv"], tmp_path)
    edit_config(tmp_path, use_future_variant=True)
    message = refused(arch, base, tmp_path)
    assert message.startswith(f"{tmp_path / ADAPTER_CONFIG}: use_future_variant=True is not a setting of peft's "
                              "LoraConfig that this import knows"), message
    assert f"remove it from {ADAPTER_CONFIG} if it does not change the forward" in message, message


def test_every_field_of_peft_lora_config_is_classified():
    """Each field of the installed peft's LoraConfig is honoured, metadata or refused unless at its
    default, in exactly one table; a peft that adds a field fails here until it is classified."""
    import dataclasses

    tables = [set(HONOURED), set(HARMLESS_KEYS), set(UNREPRESENTABLE)]
    assert all(not (a & b) for i, a in enumerate(tables) for b in tables[i + 1:])
    assert set().union(*tables) == {field.name for field in dataclasses.fields(peft.LoraConfig)}


def test_changing_settings_change_peft_s_model(hf_base, tmp_path):
    """Why they are refused, on the exported adapter (every layer's tensors in the file): peft's model
    with the setting is not the merged model (layers_to_transform: peft reads layer 0's tensors only)."""
    from transformers import AutoModelForCausalLM

    arch, base = hf_base("llama")
    adapters = exported(arch, base, ["qkv", "proj", "fc1", "fc2"], tmp_path / "adapter")
    merged = merged_logits(arch, base, adapters, tmp_path / "merged")
    assert (peft_logits(base, tmp_path / "adapter", TOKENS) - merged).abs().max().item() <= TOL
    for key, value in (("layers_to_transform", [0]), ("layers_to_transform", 0), ("exclude_modules", ["o_proj"]),
                       ("init_lora_weights", "pissa"), ("init_lora_weights", "olora")):
        edit_config(tmp_path / "adapter", **{key: value})
        assert (peft_logits(base, tmp_path / "adapter", TOKENS) - merged).abs().max().item() > 0.1, (key, value)
        edit_config(tmp_path / "adapter", **{key: None if key != "init_lora_weights" else True})


# Accepted: metadata at values other than the default, and settings at values with no effect.
HARMLESS = [("task_type", "SEQ_CLS"), ("task_type", None), ("revision", "main"), ("inference_mode", False),
            ("auto_mapping", {"base_model_class": "LlamaForCausalLM", "parent_library": "transformers"}),
            ("peft_version", "0.21.2"), ("megatron_core", "megatron.core"), ("megatron_config", {"hidden_size": 64}),
            ("runtime_config", {"ephemeral_gpu_offload": False}), ("loftq_config", {"loftq_bits": 4}),
            ("eva_config", {"rho": 2.0}), ("corda_config", {"corda_method": "kpm"}),
            ("lora_ga_config", {"direction": "ArB2r"}), ("qalora_group_size", 32), ("ensure_weight_tying", True),
            ("base_model_name_or_path", "meta-llama/Llama-3.2-1B"), ("init_lora_weights", "gaussian"),
            ("init_lora_weights", "eva"), ("init_lora_weights", False), ("init_lora_weights", "orthogonal"),
            ("rank_pattern", {"q_proj": RANK}), ("alpha_pattern", {"o_proj": ALPHA}), ("layers_to_transform", []),
            ("layers_pattern", None), ("layers_pattern", ""), ("exclude_modules", []), ("exclude_modules", ""),
            ("modules_to_save", []), ("bias", "none"), ("target_parameters", []), ("alora_invocation_tokens", []),
            ("layer_replication", []),
            ("lora_dropout", 0.05), ("target_modules", "all-linear"),
            ("target_modules", r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)")]


def merged_logits(arch, base: Path, adapters: dict, directory: Path) -> torch.Tensor:
    """The logits of W + (ALPHA / RANK) B A merged in Megatron's layout (what the imported
    checkpoint's model is), saved as an HF model in `directory`."""
    from test_peft_export import write_merged

    adapters_targets = ("qkv", "proj", "fc1", "fc2")

    weights = {n: w for n, (w, _, _) in random_adapters(arch, read_weights(base), list(adapters_targets)).items()}
    triples = {n: (weights[n], a, b) for n, (a, b) in adapters.items()}
    write_merged(arch, base, triples, directory)
    return hf_logits(directory, TOKENS)


def test_every_accepted_setting_gives_peft_s_own_model(hf_base, tmp_path):
    """Each accepted key and value (metadata, or a setting at a value with no effect): the import
    takes the adapter, and peft's own model from that adapter_config.json is the imported adapters'
    merged model within 1e-4."""
    import copy

    from transformers import AutoModelForCausalLM

    arch, base = hf_base("llama")
    adapters = exported(arch, base, ["qkv", "proj", "fc1", "fc2"], tmp_path / "adapter")
    merged = merged_logits(arch, base, adapters, tmp_path / "merged")
    original = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    hf_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for key, value in HARMLESS:
        (tmp_path / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(dict(original, **{key: value})))
        imported = read_peft_adapter(tmp_path / "adapter", arch, base_shapes(base))
        assert all(torch.equal(imported.adapters[n][0], a) and torch.equal(imported.adapters[n][1], b)
                   for n, (a, b) in adapters.items()), (key, value)
        model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), tmp_path / "adapter").eval()
        with torch.no_grad():
            difference = (model(torch.tensor([TOKENS])).logits[0] - merged).abs().max().item()
        assert difference <= TOL, (key, value, difference)


@pytest.mark.parametrize("edit, named", [
    ({"init_lora_weights": False, "target_modules": ".*_proj"}, "init_lora_weights=False starts the adapters"),
    ({"init_lora_weights": "orthogonal", "target_modules": "all-linear"}, "init_lora_weights='orthogonal' starts"),
    ({"target_modules": r".*\.(q|k|v)_proj"}, "does not match model.layers.0.self_attn.o_proj, which"),
    ({"target_modules": "(unclosed"}, "is not a regular expression"),
    ({"target_modules": None}, "must be a list of module names or a pattern"),
])
def test_target_modules_that_peft_would_read_otherwise_are_refused(hf_base, tmp_path, edit, named):
    """A pattern must match every module the tensors name (else peft leaves it unadapted); with an
    initialization that starts lora_B nonzero, a pattern could adapt modules without tensors at
    random: refused (a list on a dense model is checked module by module)."""
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv", "proj"], tmp_path)
    edit_config(tmp_path, **edit)
    message = refused(arch, base, tmp_path)
    assert message.startswith(f"{tmp_path / ADAPTER_CONFIG}: ") and named in message, message


def test_a_pattern_or_a_random_init_on_a_moe_model_is_refused(hf_base, tmp_path):
    arch, base = hf_base("qwen3_moe")
    exported(arch, base, ["qkv", "experts"], tmp_path)
    edit_config(tmp_path, target_modules=".*")
    message = refused(arch, base, tmp_path)
    assert "target_modules='.*' is a pattern, and which of a MoE model's expert and router modules" in message
    assert '"target_modules": ["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]' in message, message
    edit_config(tmp_path, target_modules=["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"],
                init_lora_weights=False)
    assert "init_lora_weights=False starts the adapters peft builds with a nonzero lora_B" in \
        refused(arch, base, tmp_path)


def test_an_adapter_named_for_another_base_is_refused(hf_base, tmp_path):
    """adapter_config.json's base_model_name_or_path names the base the adapter was trained on: a
    local directory whose weights differ from --hf's is refused by name; a copy of --hf, a Hub
    name or a path not on this machine pass (recorded only)."""
    import shutil

    from megatron_rl.tools.convert_lora import check_named_base

    _, base = hf_base("llama")
    other = tmp_path / "other"
    make_hf_model(peft_family_config("llama"), other, seed=7)
    with pytest.raises(ConfigError) as info:
        check_named_base(tmp_path / "adapter", str(other), base)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'adapter' / ADAPTER_CONFIG}: base_model_name_or_path={str(other)!r} "
                              "names the base the adapter was trained on, and its weights differ from those of "
                              f"--hf {base} (tensor lm_head.weight: largest difference "), message
    assert f"pass --hf {other}" in message
    shutil.copytree(base, tmp_path / "copy")
    for named in (str(tmp_path / "copy"), str(base), "meta-llama/Llama-3.2-1B", str(tmp_path / "absent"), None):
        check_named_base(tmp_path / "adapter", named, base)


@pytest.mark.parametrize("key, named", [
    (f"{Q}.q_proj.lora_magnitude_vector", "is not a LoRA adapter's lora_A or lora_B weight"),  # DoRA's
    (f"{Q}.q_proj.lora_embedding_A", "is not a LoRA adapter's lora_A or lora_B weight"),
    ("base_model.model.lm_head.lora_A.weight", "has no module lm_head that model.lora adapts"),
    ("base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight", "has no module model.layers.9.self_attn.q_proj"),
])
def test_an_unknown_tensor_is_refused_by_its_key(hf_base, tmp_path, key, named):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv"], tmp_path)
    edit_tensors(tmp_path, lambda tensors: tensors.update({key: torch.zeros(RANK, 64)}))
    message = refused(arch, base, tmp_path)
    assert f"tensor {key}" in message and named in message, message


def test_a_pickled_adapter_is_refused_unread(hf_base, tmp_path):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv"], tmp_path)
    (tmp_path / ADAPTER_WEIGHTS).rename(tmp_path / "adapter_model.bin")  # never opened: not even a pickle here
    message = refused(arch, base, tmp_path)
    assert f"{tmp_path / 'adapter_model.bin'} is a pickle" in message and "save the adapter as safetensors" in message


def test_a_shape_that_does_not_fit_the_base_is_refused_by_its_key(hf_base, tmp_path):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv", "proj"], tmp_path)
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    edit_tensors(tmp_path, lambda tensors: tensors.update({key: tensors[key][:-1]}))
    message = refused(arch, base, tmp_path)
    assert f"tensor {key} has shape [127, 4]" in message and "needs [128, 4]" in message, message
    edit_config(tmp_path, r=8)  # the adapter of another rank than adapter_config.json says
    assert "lora_A.weight has shape [4, 128]" in refused(arch, base, tmp_path)


def test_a_missing_piece_or_layer_is_refused(hf_base, tmp_path):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv", "proj"], tmp_path)
    edit_tensors(tmp_path, lambda t: [t.pop(f"{Q}.v_proj.lora_{x}.weight") for x in "AB"])
    edit_config(tmp_path, target_modules=["q_proj", "k_proj", "o_proj"])  # as PEFT's default q/v-only adapters do
    message = refused(arch, base, tmp_path)
    assert "has model.layers.0.self_attn.q_proj but not model.layers.0.self_attn.v_proj" in message, message
    edit_tensors(tmp_path, lambda t: [t.pop(f"{Q}.{p}.lora_{x}.weight") for p in ("q_proj", "k_proj") for x in "AB"])
    message = refused(arch, base, tmp_path)
    assert "no model.layers.0.self_attn.q_proj, but model.lora's target 'qkv' adapts every one" in message, message


def test_a_non_lora_adapter_and_a_foreign_target_list_are_refused(hf_base, tmp_path):
    arch, base = hf_base("llama")
    exported(arch, base, ["qkv"], tmp_path)
    edit_config(tmp_path, target_modules=["q_proj", "k_proj", "v_proj", "c_attn"])
    assert "target_modules names 'c_attn'" in refused(arch, base, tmp_path)
    edit_config(tmp_path, peft_type="IA3")
    assert "peft_type='IA3': only LoRA adapters" in refused(arch, base, tmp_path)


# ---- the run's model.lora against the checkpoint's ------------------------------------------------

@pytest.mark.parametrize("overrides, named", [
    (["model.lora.rank=8", "model.lora.alpha=8"], "model.lora.rank is 8, the checkpoint's 4"),
    (["model.lora.rank=4", "model.lora.alpha=16"], "model.lora.alpha is 16.0, the checkpoint's 8.0"),
    (["model.lora.rank=4", "model.lora.alpha=8"], "model.lora.targets is ['qkv', 'proj', 'fc1', 'fc2', 'experts'], "
                                                  "the checkpoint's ['qkv', 'proj', 'experts', 'router']"),
    ([], "holds LoRA adapters and the run has no model.lora"),
])
def test_a_run_whose_model_lora_disagrees_is_refused(tmp_path, overrides, named):
    """checkpoint.init_from (load_initial_weights) before anything is read: the default targets
    (null) of this Qwen3-MoE are every one it has but the router (its dense layer's fc1 and fc2 too)."""
    (tmp_path / METADATA).write_text(json.dumps({"format": FORMAT, "padded_vocab_size": 128, "precision": "fp32",
                                                 "lora": {
        "rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["qkv", "proj", "experts", "router"]}}))
    config = load_config(None, overrides)
    arch = parse_hf_config(family_configs()["qwen3_moe"])
    with pytest.raises(ConfigError) as info:
        load_initial_weights(SimpleNamespace(config=config, arch=arch), str(tmp_path))
    message = str(info.value)
    assert message.startswith("checkpoint.init_from: ") and named in message, message
    assert "set model.lora.rank=4 model.lora.alpha=8 model.lora.targets=[qkv,proj,experts,router]" in message


def test_a_lora_runs_checkpoint_is_checked_the_same_way(tmp_path):
    """A LoRA run's checkpoint records its model.lora in trainer_state.json (targets null: the
    family's default ones); as checkpoint.init_from it loads only into a run with the same one."""
    (tmp_path / METADATA).write_text(json.dumps({"format": FORMAT, "padded_vocab_size": 128, "precision": "fp32"}))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"config": {"model": {"lora": {
        "rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": None, "init": "kaiming"}}}}))
    arch = parse_hf_config(family_configs()["qwen3_moe"])
    check_run_lora(tmp_path, {}, load_config(None, ["model.lora.rank=8"]).model.lora, arch)  # the same: loads
    with pytest.raises(ConfigError, match=r"model.lora.rank is 4, the checkpoint's 8\); set model.lora.rank=8 "
                                          r"model.lora.alpha=16 model.lora.targets=\[qkv,proj,fc1,fc2,experts\]"):
        check_run_lora(tmp_path, {}, load_config(None, ["model.lora.rank=4"]).model.lora, arch)


# ---- converted and loaded into the policy -----------------------------------------------------------

def peft_written_adapter(base: Path, directory: Path) -> None:
    """peft.get_peft_model on the base, every B nonzero and the A matrices of q/k/v and gate/up
    made equal (so Megatron's fused adapters hold it exactly), saved by peft."""
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                b = module.lora_B["default"].weight
                b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
            for first, *others in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                   (layer.mlp.gate_proj, layer.mlp.up_proj)):
                for module in others:
                    module.lora_A["default"].weight.copy_(first.lora_A["default"].weight)
    model.save_pretrained(directory)


def peft_logits(base: Path, adapter: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.subprocess
def test_converted_adapters_load_into_the_policy_as_the_peft_model(hf_base, tmp_path):
    from _support.processes import child_env, python_command
    from peft_import_worker import TOKENS

    cases = {}
    for name, targets in (("qwen3", None), ("qwen3_moe", PEFT_TARGETS["qwen3_moe"])):
        arch, base = hf_base(name)
        case = tmp_path / name
        case.mkdir()
        (case / "base").symlink_to(base, target_is_directory=True)
        if targets is None:
            peft_written_adapter(base, case / "adapter")
            originals = load_file(str(case / "adapter" / ADAPTER_WEIGHTS))
            targets = ["qkv", "proj", "fc1", "fc2"]
        else:
            originals = exported(arch, base, targets, case / "adapter")
        overrides = ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets=[{','.join(targets)}]"]
        (case / "lora.json").write_text(json.dumps(overrides))
        cases[name] = (arch, case, originals)
    done = subprocess.run(python_command(WORKER, *(case for _, case, _ in cases.values()), preloaded=True),
                          capture_output=True, text=True, env=child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for name, (arch, case, originals) in cases.items():
        result = torch.load(case / "result.pt", weights_only=True)
        adapters = result["adapters"]
        if name == "qwen3":  # peft's own tensors, back in PEFT's names from the policy
            assert sorted(peft_tensors(adapters, arch)) == sorted(originals)
            assert all(torch.equal(t, originals[k]) for k, t in peft_tensors(adapters, arch).items()), name
        else:
            assert sorted(adapters) == sorted(originals)
            assert all(torch.equal(adapters[n][0], a) and torch.equal(adapters[n][1], b)
                       for n, (a, b) in originals.items()), name
        reference = peft_logits(case / "base", case / "adapter", TOKENS)
        assert (reference - hf_logits(case / "base", TOKENS)).abs().max() > 0.1  # the adapters move the model
        difference = (result["logits"] - reference).abs().max().item()
        print(f"{name}: max |Megatron - PEFT| logit difference {difference:.2e}")
        assert difference <= TOL, (name, difference)
