"""One rank of the grouped-GEMM expert check, started by torchrun.

Transformer Engine's modules cannot be built without CUDA, so the TE layout is reproduced on a
local-spec model: `TransformerEngineView` shows the same parameter storage under the names TE's
layer spec gives them (norms fused into the next linear, experts as TEGroupedMLP's
linear_fc1.weight0..N-1 / linear_fc2.weight0..N-1, in TE's order) and with the attributes TE
sets on them (every expert weight partition_dim=0 when Megatron does the expert communication,
fc2 included). Writes, from the stage leader:

  local.pt     HF tensors exported from the local layout
  grouped.pt   HF tensors exported through the TE view
  reloaded.pt  HF tensors exported from the local layout after zeroing every parameter and
               importing the HF checkpoint through the TE view
  hf_fp8/      an FP8 HF checkpoint written through the TE view

    python grouped_worker.py --hf HF_DIR --out OUT_DIR [--override k=v ...]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.atomic_dir import AtomicDirectory
from megatron_rl.bridge import export_hf_weights, load_hf_weights, owned_hf_names, quantize_fp8_blockwise
from megatron_rl.bridge.hf_checkpoint import write_hf_checkpoint
from megatron_rl.config import load_config
from megatron_rl.model.builder import build_model
from megatron_rl.runtime import start_runtime

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")


class TransformerEngineView:
    """The parameters of a local-spec GPTModel, named and tagged as the TE layer spec does."""

    def __init__(self, module, config):
        self.decoder = module.decoder
        self.module = module
        explicit_expert_comm = config.parallel.expert_tp > 1 or config.parallel.ep > 1
        dense_layers = {i for i, layer in enumerate(module.decoder.layers) if not hasattr(layer.mlp, "experts")}
        experts: dict[str, dict[str, list]] = {}  # experts module -> linear -> tagged weights in order
        entries = []  # (name, param), or an experts module whose grouped weights go here
        for name, param in module.named_parameters():
            match = _EXPERT.match(name)
            if match:
                prefix, linear = match.group(1), match.group(3)
                if prefix not in experts:
                    experts[prefix] = {"linear_fc1": [], "linear_fc2": []}
                    entries.append(prefix)
                assert int(match.group(2)) == len(experts[prefix][linear]), "experts are registered in order"
                experts[prefix][linear].append(self._tag(param, dict(
                    tensor_model_parallel=True, partition_stride=1, allreduce=not config.parallel.ep > 1,
                    # TE's GroupedLinear: dim 1 only when it runs row-parallel itself.
                    partition_dim=0 if explicit_expert_comm or linear == "linear_fc1" else 1,
                )))
                continue
            layer = re.match(r"decoder\.layers\.(\d+)\.", name)
            renamed = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
            if layer and int(layer.group(1)) in dense_layers:
                renamed = renamed.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
            entries.append((renamed, self._tag(param, {a: getattr(param, a) for a in _TE_ATTRS if hasattr(param, a)})))
        self.params = []
        for entry in entries:
            if isinstance(entry, str):
                # TEGroupedMLP registers all of linear_fc1's weights, then all of linear_fc2's.
                for linear in ("linear_fc1", "linear_fc2"):
                    self.params += [(f"{entry}.{linear}.weight{i}", w) for i, w in enumerate(experts[entry][linear])]
            else:
                self.params.append(entry)

    @staticmethod
    def _tag(param, attrs):
        view = torch.nn.Parameter(param.data, requires_grad=param.requires_grad)  # same storage
        for key, value in attrs.items():
            setattr(view, key, value)
        return view

    def named_parameters(self):
        return iter(self.params)

    def named_buffers(self):
        # TE names the routers' expert bias as the local spec does (model/state.py).
        return self.module.named_buffers()


def exported(module, arch) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in export_hf_weights(module, arch, bucket_bytes=1 << 14) for name, tensor in bucket}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    config = load_config(None, ["device=cpu", f"model.hf_config={args.hf}", *args.override])
    runtime = start_runtime(config)
    out = Path(args.out)
    built = build_model(config, runtime.device)
    module, arch = built.module, built.arch
    load_hf_weights(module, arch, args.hf)
    view = TransformerEngineView(module, config)
    names = [name for name, _ in view.named_parameters()]
    assert any(".mlp.experts.linear_fc2.weight" in n for n in names) and not any("local_experts" in n for n in names)
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)

    results = {"local": exported(module, arch), "grouped": exported(view, arch)}
    yielded = list(results["grouped"])
    assert sorted(yielded) == sorted(owned_hf_names(view, arch)), "owned_hf_names disagrees with the export"

    with AtomicDirectory(out / "hf") as staging:
        write_hf_checkpoint(module, arch, built.raw_hf_config, staging, bucket_bytes=1 << 14)
    with torch.no_grad():
        for _, param in module.named_parameters():
            param.zero_()
    load_hf_weights(view, arch, out / "hf")
    results["reloaded"] = exported(module, arch)

    fp8_names = [n for bucket in quantize_fp8_blockwise(export_hf_weights(view, arch), arch) for n, _ in bucket]
    assert sorted(fp8_names) == sorted(owned_hf_names(view, arch, fp8=True))
    with AtomicDirectory(out / "hf_fp8") as staging:
        write_hf_checkpoint(view, arch, built.raw_hf_config, staging, bucket_bytes=1 << 14, fp8=True)

    if dist.get_rank() == 0:
        for key, tensors in results.items():
            torch.save(tensors, out / f"{key}.pt")
    dist.barrier()
    runtime.shutdown()


if __name__ == "__main__":
    main()
