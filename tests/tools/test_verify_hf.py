"""`megatron-rl verify-hf`, run as a user runs it, on tiny random HF models made by transformers.

- Megatron's logits match transformers' within 1e-4 at TP1, TP2 (under a torchrun the user
  started), PP2 and EP2 (MoE), tied embeddings at PP2 and PP2 x TP2, and the verdict is the last line;
- the same at TP1, TP2, EP2 and PP2 for DeepSeek-V3 and GLM-4.5 configurations unlike the bridge
  tests' (other head dims, group-limited top-3 of 8 experts, a non-zero score-correction bias,
  MLA without and with a q LoRA, YaRN with mscale/mscale_all_dim, GLM's partial rotary with q/k/v
  bias and qk-norm);
- when transformers computes something else, the comparison fails: exit 1, FAILED last, and no
  torchrun traceback after it;
- bad input is one line on stderr and exit 2, before any process starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _support.processes import REPO, child_env, cli_command, torchrun_command

sys.path.insert(0, str(REPO / "tests" / "bridge"))
from test_bridge import VOCAB, family_configs, make_hf_model  # noqa: E402

pytestmark = pytest.mark.multiprocess

VERDICT = re.compile(r"^verify-hf: max \|logit diff\| = (\S+) over (\d+) tokens \(tolerance (\S+)\): (ok|FAILED)$")
TOLERANCE = 1e-4

# Makes transformers (only) compute with rms_norm_eps=1.0 when VERIFY_HF_TEST_EPS is set, in every
# process (torchrun ranks included): Megatron, reading the same config.json, keeps the real one.
# A config.json edit cannot do this: Megatron is built from the same file.
EPS_HOOK = '''
import importlib.abc, importlib.util, os, sys

MODULE = "transformers.models.auto.modeling_auto"

def _patch(module):
    auto = module.AutoModelForCausalLM
    original = auto.from_pretrained.__func__
    eps = float(os.environ["VERIFY_HF_TEST_EPS"])
    auto.from_pretrained = classmethod(lambda cls, *a, **k: original(cls, *a, rms_norm_eps=eps, **k))

class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("VERIFY_HF_TEST_EPS"):
    if MODULE in sys.modules:  # forked from the tests' pre-imported server, which imported it
        _patch(sys.modules[MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport())
'''


def verify(*args: str, torchrun: int = 0, env: dict[str, str] | None = None,
           pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """`python -m megatron_rl.cli verify-hf ARGS`, or under `torchrun --nproc-per-node=N` when given.
    A `pythonpath` with a sitecustomize hook: it runs in every process, the ranks verify-hf starts
    included (forked from the pre-imported server, which runs it as `site` would)."""
    command = (torchrun_command("megatron_rl.cli", torchrun, "verify-hf", *args, module=True, preloaded=True) if torchrun
               else cli_command("verify-hf", *args, preloaded=True, children=True))
    environment = child_env(PYTHONPATH=pythonpath or str(REPO), **(env or {}))
    for name in ("RANK", "WORLD_SIZE", "MEGATRON_RL_VERBOSE", "MEGATRON_RL_VERIFY_REPORT"):
        if name not in (env or {}):
            environment.pop(name, None)
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)


def verdict(result: subprocess.CompletedProcess) -> tuple[float, int, str]:
    """(max diff, tokens, ok/FAILED) from the last stdout line, which must be the verdict."""
    lines = result.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{result.stderr[-4000:]}"
    match = VERDICT.match(lines[-1])
    assert match, f"last line is not the verdict: {lines[-1]!r}\nstderr:\n{result.stderr[-4000:]}"
    return float(match.group(1)), int(match.group(2)), match.group(4)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    configs = family_configs()
    dirs = {}
    configs["qwen2_tied"] = dict(configs["qwen2"], tie_word_embeddings=True)
    for name in ("llama", "qwen3", "qwen3_moe", "qwen2_tied"):
        make_hf_model(configs[name], root / name)
        dirs[name] = root / name
    return dirs


# Unlike tests/bridge's tiny configs: 4 layers (even pipeline stages), hidden 96, top-3 of 8 experts
# in 4 groups of which 2 are chosen, two shared experts, other head dims and RoPE settings.
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=96,
    intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=24, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=4, topk_group=2,
    routed_scaling_factor=1.8, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=2048,
    rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0,
    # mscale != mscale_all_dim: cos/sin and the softmax scale are both rescaled
    rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=256,
                         beta_fast=32, beta_slow=1, mscale=0.8, mscale_all_dim=0.6),
)
# With a q LoRA (q_a_proj -> q_a_layernorm -> q_b_proj), a wider rotary part, and YaRN with
# mscale_all_dim only (transformers then scales cos/sin by 0.1 ln(factor) + 1).
DEEPSEEK_V3_Q_LORA = dict(
    DEEPSEEK_V3, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=32,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512,
                         beta_fast=16, beta_slow=2, mscale_all_dim=1.0),
)
GLM4_MOE = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=VOCAB, hidden_size=96,
    intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
    n_group=4, topk_group=2, routed_scaling_factor=2.0, first_k_dense_replace=1, norm_topk_prob=True,
    attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0, partial_rotary_factor=0.5),
    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=0,
)
SIGMOID_ROUTED = {"deepseek_v3": DEEPSEEK_V3, "deepseek_v3_q_lora": DEEPSEEK_V3_Q_LORA, "glm4_moe": GLM4_MOE}


@pytest.fixture(scope="module")
def sigmoid_models(tmp_path_factory) -> dict[str, Path]:
    """The models above, each router's e_score_correction_bias set to non-zero values (transformers
    initializes it to zero, which would hide a bias that is dropped or misplaced)."""
    import torch
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("hf_sigmoid")
    dirs = {}
    for index, (name, raw) in enumerate(SIGMOID_ROUTED.items()):
        make_hf_model(raw, root / name, seed=index + 1)
        tensors = load_file(next((root / name).glob("*.safetensors")))
        generator = torch.Generator().manual_seed(100 + index)
        for key in sorted(k for k in tensors if k.endswith("e_score_correction_bias")):
            # on the scale of the sigmoid scores: it changes which experts are chosen
            tensors[key] = 0.1 * torch.randn(tensors[key].shape, generator=generator)
        _save(tensors, root / name)
        dirs[name] = root / name
    return dirs


def _save(tensors: dict, directory: Path) -> None:
    from safetensors.torch import save_file

    biases = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(tensors[k].abs().min() > 0 for k in biases)  # 3 MoE layers of 4
    (file,) = directory.glob("*.safetensors")
    save_file(tensors, file, metadata={"format": "pt"})


LAYOUTS = {"tp1": [], "tp2": ["--tp", "2"], "ep2": ["--ep", "2", "--etp", "1"], "pp2": ["--pp", "2"],
           "pp2_uneven": ["--pp", "2", "--pp-first-stage-layers", "1"]}  # 4 layers: stages of 1 and 3
SIGMOID_CASES = [(family, layout) for family in ("deepseek_v3", "glm4_moe") for layout in ("tp1", "tp2", "ep2", "pp2")]
SIGMOID_CASES = [c if c != ("deepseek_v3", "pp2") else ("deepseek_v3", "pp2_uneven") for c in SIGMOID_CASES]
SIGMOID_CASES += [("deepseek_v3_q_lora", "tp1")]


@pytest.mark.parametrize("family, layout", SIGMOID_CASES, ids=[f"{f}-{l}" for f, l in SIGMOID_CASES])
def test_sigmoid_routed_families_match_transformers(sigmoid_models, family, layout):
    result = verify("--hf-dir", str(sigmoid_models[family]), *LAYOUTS[layout])
    assert result.returncode == 0, result.stderr[-4000:]
    diff, tokens, status = verdict(result)
    print(f"{family}-{layout}: max |logit diff| {diff:.3e}")
    assert status == "ok" and diff <= TOLERANCE and tokens == 96
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("verify-hf: ")  # the model and layout, then the verdict
    assert "Traceback" not in result.stderr  # also where verify-hf started torchrun itself


# (family, verify-hf layout arguments, processes of a torchrun the test starts itself: 0 = none)
OK_CASES = {
    "qwen3-tp1": ("qwen3", [], 0),  # tied embeddings, qk-norm
    "llama-tp2": ("llama", ["--tp", "2"], 2),  # under the user's torchrun
    # Tied embeddings at PP > 1: the last stage predicts through its own copy of the shared matrix,
    # which the import must fill (it was left at random: logit diff 1.5 before the fix).
    "qwen3-pp2": ("qwen3", ["--pp", "2"], 2),
    "qwen2_tied-pp2-tp2": ("qwen2_tied", ["--pp", "2", "--tp", "2"], 0),
}  # MoE, PP2 and EP2 with verify-hf starting torchrun itself: the DeepSeek-V3 / GLM-4.5 cases above


@pytest.mark.parametrize("case", list(OK_CASES))
def test_logits_match_transformers(models, case):
    family, layout, torchrun = OK_CASES[case]
    result = verify("--hf-dir", str(models[family]), *layout, torchrun=torchrun)
    assert result.returncode == 0, result.stderr[-4000:]
    diff, tokens, status = verdict(result)
    print(f"{case}: max |logit diff| {diff:.3e}")
    assert status == "ok" and diff <= TOLERANCE and tokens == 96
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("verify-hf: ")  # the model and layout, then the verdict
    assert "Traceback" not in result.stderr


def test_a_different_computation_fails(models, tmp_path):
    """transformers with rms_norm_eps=1.0 (set by a hook; Megatron keeps config.json's 1e-6): the
    logits differ, so FAILED, exit 1, and the verdict stays the last line although two ranks ran."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(EPS_HOOK)
    result = verify("--hf-dir", str(models["llama"]), "--tp", "2", "--tokens", "40", "--seed", "3",
                    env={"VERIFY_HF_TEST_EPS": "1.0"}, pythonpath=f"{tmp_path / 'hook'}{os.pathsep}{REPO}")
    assert result.returncode == 1, result.stderr[-4000:]
    diff, tokens, status = verdict(result)
    print(f"llama-tp2 with transformers' rms_norm_eps=1.0: max |logit diff| {diff:.3e}")
    assert status == "FAILED" and diff > 1e-2 and tokens == 40
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr


def _copy_with_config(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


@pytest.mark.parametrize("case", ["missing", "no_config", "no_weights", "unsupported", "layout", "experts", "world",
                                  "tokens"])
def test_bad_input_is_one_line_and_exit_2(models, tmp_path, case):
    llama, env = str(models["llama"]), None
    if case == "missing":
        args, message = ["--hf-dir", str(tmp_path / "nope")], f"--hf-dir {tmp_path / 'nope'} does not exist"
    elif case == "no_config":
        (tmp_path / "empty").mkdir()
        args, message = ["--hf-dir", str(tmp_path / "empty")], "holds no config.json"
    elif case == "no_weights":
        (tmp_path / "config_only").mkdir()
        shutil.copy(models["llama"] / "config.json", tmp_path / "config_only")
        args, message = ["--hf-dir", str(tmp_path / "config_only")], "holds no *.safetensors files"
    elif case == "unsupported":
        gpt2 = _copy_with_config(models["llama"], tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
        args, message = ["--hf-dir", str(gpt2)], "architecture 'GPT2LMHeadModel' is not supported; supported: "
    elif case == "layout":  # 4 attention heads
        args, message = ["--hf-dir", llama, "--tp", "3"], "num_attention_heads=4 is not divisible by parallel.tp=3"
    elif case == "experts":
        args, message = ["--hf-dir", str(models["qwen3_moe"]), "--ep", "3", "--etp", "1"], "ep=3 must divide"
    elif case == "world":  # as torchrun would start rank 0 of 4 for a layout needing 2
        args, env = ["--hf-dir", llama, "--tp", "2"], {"RANK": "0", "WORLD_SIZE": "4"}
        message = "started under torchrun with 4 processes, but --tp 2 --pp 1 --ep 1 --etp 2 needs 2"
    else:
        args, message = ["--hf-dir", llama, "--tokens", "0"], "--tokens 0"
    result = verify(*args, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr[-3000:])
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("megatron-rl verify-hf: "), result.stderr[-3000:]
    assert message in errors[0]
    assert result.stdout == ""
