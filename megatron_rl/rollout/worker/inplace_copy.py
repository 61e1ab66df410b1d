"""In-place weight updates inside vLLM's CPU workers: after the first, full reload, every push
copies straight into the engine's parameters, in the kernels' own layouts.

vLLM's reload rebuilds every layer from fresh memory and copies the result back, and after it
every CPU MoE layer is packed again (measured: about 9-14 memory copies of the pushed bytes in
all). The first push takes that path and traces where each pushed tensor lands (`InPlacePlan.trace`,
recording the loaders' copies); every later push copies into the parameters and redoes only the
packing that the CPU kernels derive from them (linear layers' and the output layer's GEMM
weights; MoE experts are written directly in their packed layout). A model or layer the plan does
not know raises `_NoPlan` while tracing, and its pushes keep the full reload.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_rl.runtime.cpu.vllm_repairs import cpu_moe_kernels

logger = logging.getLogger(__name__)


def in_place_supported() -> bool:
    """Planned on vLLM's CPU build only, whose kernel layouts `InPlacePlan` was written from.

    On GPU builds every push runs vLLM's layer-wise reload: unquantized GPU kernels read the
    parameters as loaded, so a plan there would be all "direct" copies, but MLA's W_UK_T / W_UV
    are separate tensors on GPU and other kernels shuffle weights after loading; none of that is
    modelled or testable here."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


class _NoPlan(Exception):
    """Why a model's pushes cannot be copied in place (every push then runs the full reload)."""


@dataclass(eq=False)
class _Target:
    """One engine parameter that pushes write; tied parameters are one target."""

    live: torch.nn.Parameter
    holders: list  # the (module, parameter name) pairs that hold `live`
    kind: str  # "direct", "linear" or "moe" (see InPlacePlan)
    shape: tuple  # the checkpoint layout's shape (a "linear" target's live parameter is empty)
    dtype: torch.dtype
    blocks: int = 1  # dim-0 slices finished separately: the experts of a "moe" target
    block_numel: int = 0
    isa: str | None = None  # the CPU MoE kernel's packing ("moe")
    staged: bool = False  # written through a staging buffer ("linear"; "moe" unless copied packed)
    eager: list = field(default_factory=list)  # modules whose packed GEMM copy is rebuilt after a push
    lazy: list = field(default_factory=list)  # ... rebuilt when the copy is next used, if ever

    @property
    def staging_shape(self) -> tuple:
        return self.shape[1:] if self.kind == "moe" else self.shape


@dataclass(frozen=True, eq=False)
class _Copy:
    """One copy a weight loader made: pushed tensor (view) -> target (view)."""

    target: _Target
    block: int
    dst: tuple  # (size, stride, storage offset), relative to the target's (or its block's) start
    src: tuple | None  # the same within the pushed tensor (taken contiguous); None: all of it; or ("fill", value)
    numel: int
    packed: bool = False  # "moe": dst is the packed place of whole 16-row blocks, the source goes there transposed


class InPlacePlan:
    """Where every pushed tensor goes in the engine: learned once, replayed as plain copies.

    Traced after the first push (a full reload) by running the model's own `load_weights` on meta
    tensors: every parameter is swapped for a meta tensor in its checkpoint layout (vLLM records
    that layout when it builds a model, for its own reload) and a dispatch mode records each copy
    the weight loaders make from a pushed tensor into a parameter, tensor-parallel slicing and
    fused q/k/v or gate/up placement included. No data moves; the model is restored afterwards.
    Later pushes replay those copies straight into the engine's memory and redo only the
    post-load processing that derives something from what was written. The plan is refused, and
    every push runs vLLM's full reload, when a loader does anything but copy a view of a pushed
    tensor into a parameter, when a parameter is not written completely, or when a parameter's
    kernel layout is not one of these (read from vLLM's CPU build 0.32; the rollout tests compare
    the engine's logprobs with the trainer's and transformers' after every push):

    - "direct": the kernel reads the parameter as loaded (norms, biases, routers and their
      correction bias, embeddings, MLA's kv_b_proj, whose W_UK_T / W_UV are views of it and so
      change with it, ...): copied in place. The embedding method's packed GEMM copy of the
      weight is rebuilt after the push for output layers (ParallelLMHead, tied or not); for input
      embeddings it is rebuilt only if something ever calls it (vLLM looks embeddings up in the
      weight itself).
    - "linear": an unquantized linear layer (q/k/v, o, gate/up, down, routers, MLA's other
      projections) whose weight the CPU GEMM dispatch replaced by a packed copy (oneDNN or sgl),
      leaving an empty parameter: the loaders' copies fill a staging buffer in checkpoint layout,
      then the layer's own `process_weights_after_loading` packs it again. Buffers are pooled.
    - "moe": a CPU MoE layer's w13 / w2, which the kernel reads prepacked. Where the packing is
      blocks of 16 rows transposed (the portable kernels', checked on random data when planning)
      and every loader copy covers whole blocks (gate, up and down projections, tensor-parallel
      slices included), each copy goes straight into its packed place, transposed on the way:
      one pass, no packing step. Otherwise each expert is staged on its own and packed into its
      slice of the live parameter by the kernel's `prepack_moe_weight` (which packs experts
      independently, also checked).
    """

    def __init__(self, model: torch.nn.Module, targets: list[_Target], copies: dict[str, list[_Copy]],
                 shapes: dict[str, tuple], ignored: set[str]):
        import weakref

        self._model = weakref.ref(model)
        self.targets, self.copies, self.shapes, self.ignored = targets, copies, shapes, ignored
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self.stale = False

    # ---- planning -------------------------------------------------------------------------------

    @classmethod
    def trace(cls, model: torch.nn.Module, names: list[tuple[str, tuple, torch.dtype]]) -> InPlacePlan:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        module_names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
        lives: dict[int, torch.nn.Parameter] = {}
        holders: dict[int, list] = {}
        for module in model.modules():
            for pname, param in module._parameters.items():
                if param is not None:
                    lives[id(param)] = param
                    holders.setdefault(id(param), []).append((module, pname))
        metas: dict[int, torch.Tensor] = {}
        for key, held in holders.items():
            module, pname = held[0]
            info = LAYERWISE_INFO.get(module)
            original = info.restore_metadata[0].get(pname) if info is not None else None
            meta = restore_layer_refs(to_meta_tensor(original if original is not None else lives[key]), module)
            loader = getattr(meta, "weight_loader", None)
            while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
                loader = loader.__wrapped__  # vLLM's reload wrappers, if any were left behind
            if loader is not None:
                meta.weight_loader = loader
            metas[key] = meta

        sources: dict[str, torch.Tensor] = {}
        for name, shape, dtype in names:
            if name in sources:
                raise _NoPlan(f"{name} is pushed twice")
            sources[name] = torch.empty(shape, dtype=dtype, device="meta")
        recorder = _LoaderRecorder({_storage_key(t): name for name, t in sources.items()},
                                   {_storage_key(meta): key for key, meta in metas.items()},
                                   lambda key: ".".join(filter(None, (module_names.get(holders[key][0][0]),
                                                                      holders[key][0][1]))))
        for key, held in holders.items():
            for module, pname in held:
                module._parameters[pname] = metas[key]
        try:
            with torch.no_grad(), recorder:
                model.load_weights(iter(list(sources.items())))
        finally:
            for key, held in holders.items():
                for module, pname in held:
                    module._parameters[pname] = lives[key]
        if recorder.problems:
            raise _NoPlan("; ".join(sorted(set(recorder.problems))[:5]))

        describe = recorder.describe
        moe_isa = {module: experts.isa for module, experts in cpu_moe_kernels(model)}
        targets: dict[int, _Target] = {}
        for key in dict.fromkeys(key for _, _, key, _ in recorder.copies):
            targets[key] = _classify(model, lives[key], metas[key], holders[key], moe_isa, describe(key))

        copies: dict[str, list[_Copy]] = {name: [] for name in sources}
        written: dict[tuple[int, int], int] = {}
        for name, src, key, dst in recorder.copies:
            target, meta = targets[key], metas[key]
            size, stride, offset = dst
            offset -= meta.storage_offset()
            block = 0
            if target.kind == "moe":
                block, offset = divmod(offset, target.block_numel)
            end = offset + sum((s - 1) * st for s, st in zip(size, stride) if s > 0)
            if offset < 0 or end >= target.block_numel:
                raise _NoPlan(f"{describe(key)}: a loader writes across experts or outside the parameter")
            numel = 1
            for s in size:
                numel *= s
            whole = src == (tuple(sources[name].shape), sources[name].stride(), 0)
            copies[name].append(_Copy(target, block, (size, stride, offset), None if whole else src, numel))
            written[key, block] = written.get((key, block), 0) + numel

        for target in targets.values():
            if target.kind == "moe" and _packs_row_blocks(target.shape[1:], target.dtype, target.isa):
                mine = [(name, index) for name, planned in copies.items()
                        for index, copy in enumerate(planned) if copy.target is target]
                packed = [_packed_copy(copies[name][index]) for name, index in mine]
                if all(packed):
                    for (name, index), copy in zip(mine, packed):
                        copies[name][index] = copy
                    target.staged = False
        for key, target in targets.items():
            for block in range(target.blocks):
                if written.get((key, block), 0) != target.block_numel:
                    raise _NoPlan(f"{describe(key)}: the push writes {written.get((key, block), 0)} of "
                                  f"{target.block_numel} elements" + (f" of expert {block}" if target.blocks > 1 else ""))
        # Every other parameter must be derived from a pushed one in place (a view, like MLA's
        # W_UK_T / W_UV of kv_b_proj) or hold nothing (the emptied weights of packed layers).
        direct = {target.live.untyped_storage().data_ptr() for target in targets.values() if target.kind == "direct"}
        uncovered = [describe(key) for key, param in lives.items()
                     if key not in targets and param.numel() and param.untyped_storage().data_ptr() not in direct]
        if uncovered:
            raise _NoPlan(f"not written by the push: {', '.join(sorted(uncovered)[:5])}")
        ignored = {name for name, planned in copies.items() if not planned}
        plan = cls(model, list(targets.values()), {name: c for name, c in copies.items() if c},
                   {name: tuple(t.shape) for name, t in sources.items()}, ignored)
        logger.info("vLLM weight updates: in-place plan for %d tensors into %d parameters (%s)", len(plan.copies),
                    len(plan.targets), ", ".join(f"{kind} {sum(t.kind == kind for t in plan.targets)}"
                                                 for kind in ("direct", "linear", "moe")))
        return plan

    def current(self, model: torch.nn.Module) -> bool:
        """Still this model, with the very parameters the plan writes (a full reload replaces some)."""
        return (not self.stale and self._model() is model
                and all(module._parameters.get(pname) is target.live
                        for target in self.targets for module, pname in target.holders))

    # ---- pushing ------------------------------------------------------------------------------

    def apply(self, weights: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, dict]:
        started = time.perf_counter()
        wait_s = linear_s = head_s = pack_s = 0.0
        received: dict[tuple[_Target, int], int] = {}
        staged: dict[tuple[_Target, int], torch.Tensor] = {}
        count = 0
        items = iter(weights)
        with torch.no_grad():
            while True:
                asked = time.perf_counter()
                try:
                    name, tensor = next(items)
                except StopIteration:
                    wait_s += time.perf_counter() - asked
                    break
                wait_s += time.perf_counter() - asked
                count += 1
                copies = self.copies.get(name)
                if copies is None:
                    if name in self.ignored:
                        continue  # the model's loader skips it too (e.g. a tied lm_head)
                    raise RuntimeError(f"in-place weight update: {name!r} was not in the push this engine planned "
                                       f"from; the model is now partly updated, push the whole model again")
                if tuple(tensor.shape) != self.shapes[name]:
                    raise RuntimeError(f"in-place weight update: {name!r} has shape {tuple(tensor.shape)}, "
                                       f"planned for {self.shapes[name]}; push the whole model again")
                if not tensor.is_contiguous():
                    tensor = tensor.contiguous()
                for copy in copies:
                    target, key = copy.target, (copy.target, copy.block)
                    if not target.staged:
                        base = target.live.data
                    else:
                        base = staged.get(key)
                        if base is None:
                            base = staged[key] = self._take(target.staging_shape, target.dtype)
                    size, stride, offset = copy.dst
                    destination = base.as_strided(size, stride, base.storage_offset() + offset)
                    if copy.src is not None and copy.src[0] == "fill":
                        destination.fill_(copy.src[1])
                    else:
                        source = tensor if copy.src is None else tensor.as_strided(
                            copy.src[0], copy.src[1], tensor.storage_offset() + copy.src[2])
                        if copy.packed:
                            source = source.unflatten(0, (-1, 16)).permute(0, 2, 1)
                        destination.copy_(source)
                    done = received[key] = received.get(key, 0) + copy.numel
                    if done > target.block_numel:
                        raise RuntimeError(f"in-place weight update: {name!r} writes a parameter twice")
                    if done == target.block_numel:
                        finishing = time.perf_counter()
                        self._finish(target, copy.block, staged.pop(key, None))
                        finished = time.perf_counter() - finishing
                        if target.kind == "moe":
                            pack_s += finished
                        elif target.kind == "linear":
                            linear_s += finished
                        else:
                            head_s += finished
        untouched = partial = 0
        for target in self.targets:
            for block in range(target.blocks):
                done = received.get((target, block), 0)
                untouched += done == 0
                partial += 0 < done < target.block_numel
        if partial:
            raise RuntimeError(f"in-place weight update: {partial} parameters (or experts) were only partly pushed; "
                               f"push the whole model again")
        if untouched:
            logger.warning("vLLM weight updates: %d parameters (or experts) were not in this push and keep their "
                           "previous values", untouched)
        total_s = time.perf_counter() - started
        # copy: the in-place / staging copies (CPU MoE experts straight into their packed layout);
        # linear_repack: linear layers' GEMM packing redone; head_repack: the output layer's;
        # moe_pack: CPU MoE packing of staged experts (0 where the experts were copied packed).
        return count, {"path": "in_place", "tensors": count, "total_s": total_s, "stream_s": wait_s,
                       "copy_s": total_s - wait_s - linear_s - head_s - pack_s, "linear_repack_s": linear_s,
                       "head_repack_s": head_s, "moe_pack_s": pack_s}

    def _finish(self, target: _Target, block: int, staging: torch.Tensor | None) -> None:
        """Everything a target's new values need once all of it (or of one expert) arrived."""
        if target.kind == "moe" and staging is not None:
            torch.ops._C.prepack_moe_weight(staging.unsqueeze(0), target.live.data[block:block + 1], target.isa)
            self._give(staging)
        elif target.kind == "linear":
            (module, pname), = target.holders
            if _redispatch_gemm(module, pname, staging):
                self._give(staging)
            else:  # the dispatch kept the staged weight as the layer's own: plan again next time
                self.stale = True
        for module in target.eager:
            module.quant_method.process_weights_after_loading(module)
        for module in target.lazy:
            _rebuild_gemm_on_first_use(module)

    def _take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.get((shape, dtype))
        return free.pop() if free else torch.empty(shape, dtype=dtype)

    def _give(self, tensor: torch.Tensor) -> None:
        self._pool.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)


def _classify(model: torch.nn.Module, live: torch.nn.Parameter, meta: torch.Tensor, holders: list,
              moe_isa: dict, what: str) -> _Target:
    """The target for one written parameter, or _NoPlan when its kernel layout is not known here."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    kinds, eager, lazy, isa = set(), [], [], None
    for module, pname in holders:
        method = getattr(module, "quant_method", None)
        if method is None:
            if callable(getattr(module, "process_weights_after_loading", None)):
                raise _NoPlan(f"{what}: its module post-processes its parameters itself")
            kinds.add("direct")
        elif type(method) is UnquantizedLinearMethod:
            if pname == "weight" and live.numel() == 0 and meta.numel() > 0:
                if getattr(module, "_cpu_skip_gemm_dispatch", False) or len(holders) > 1:
                    raise _NoPlan(f"{what}: emptied by a kernel outside the layer, or shared")
                kinds.add("linear")
            else:
                kinds.add("direct")  # bias, correction bias, or a weight the layer reads as is
        elif type(method) is UnquantizedEmbeddingMethod:
            kinds.add("direct")
            if pname == "weight" and hasattr(module, "cpu_linear"):
                head = isinstance(module, ParallelLMHead) or getattr(model, "lm_head", None) is module
                (eager if head else lazy).append(module)
        elif type(method) is UnquantizedFusedMoEMethod and pname in ("w13_weight", "w2_weight"):
            if module not in moe_isa:
                raise _NoPlan(f"{what}: MoE kernel with an unknown weight layout")
            kinds.add("moe")
            isa = moe_isa[module]
        elif type(method) is UnquantizedFusedMoEMethod:
            kinds.add("direct")
        else:
            raise _NoPlan(f"{what}: {type(method).__name__} (no in-place update known for it)")
    if len(kinds) != 1:
        raise _NoPlan(f"{what}: held by layers of different kinds {sorted(kinds)}")
    kind = kinds.pop()
    shape = tuple(meta.shape)
    if meta.dtype != live.dtype:
        raise _NoPlan(f"{what}: loaded as {meta.dtype}, kept as {live.dtype}")
    if kind == "direct" and (tuple(live.shape) != shape or live.stride() != meta.stride()):
        raise _NoPlan(f"{what}: kept in a layout other than the loaded one")
    if kind in ("linear", "moe") and not meta.is_contiguous():
        raise _NoPlan(f"{what}: loaded into a non-contiguous layout")
    if kind == "moe":
        if len(shape) != 3 or tuple(live.shape) != shape or not live.is_contiguous():
            raise _NoPlan(f"{what}: packed experts of an unexpected shape")
        if not _packs_experts_apart(shape[1:], live.dtype, isa):
            raise _NoPlan(f"{what}: the MoE kernel does not pack experts independently")
        return _Target(live, holders, kind, shape, live.dtype, blocks=shape[0], block_numel=meta.stride()[0], isa=isa,
                       staged=True)
    return _Target(live, holders, kind, shape, meta.dtype, block_numel=meta.numel(), staged=kind == "linear",
                   eager=eager, lazy=lazy)


_PACKS_APART: dict[tuple, bool] = {}
_PACKS_ROW_BLOCKS: dict[tuple, bool] = {}


def _packs_row_blocks(shape: tuple, dtype: torch.dtype, isa: str) -> bool:
    """Whether the CPU MoE kernel's packing of one expert [N, K] is [N/16, K, 16]: each block of 16
    rows transposed (what the portable "vec" kernels do, fp32 and bf16 alike, in vLLM 0.32)."""
    key = (shape, dtype, isa)
    if key not in _PACKS_ROW_BLOCKS:
        rows, cols = shape
        expert = torch.randn((1, rows, cols), generator=torch.Generator().manual_seed(0)).to(dtype)
        packed = torch.empty_like(expert)
        torch.ops._C.prepack_moe_weight(expert, packed, isa)
        _PACKS_ROW_BLOCKS[key] = rows % 16 == 0 and torch.equal(
            packed.view(rows // 16, cols, 16), expert[0].view(rows // 16, 16, cols).permute(0, 2, 1))
    return _PACKS_ROW_BLOCKS[key]


def _packed_copy(copy: _Copy) -> _Copy | None:
    """`copy` written straight into a packed expert (see _packs_row_blocks), if it covers whole
    rows in whole blocks of 16 (each loader copy is a gate, up or down projection: it does)."""
    target = copy.target
    size, stride, offset = copy.dst
    cols = target.shape[2]
    if ((copy.src is not None and copy.src[0] == "fill") or len(size) != 2 or size[1] != cols
            or tuple(stride) != (cols, 1) or offset % (16 * cols) or size[0] % 16):
        return None
    start = copy.block * target.block_numel + offset
    return _Copy(target, copy.block, ((size[0] // 16, cols, 16), (16 * cols, 16, 1), start), copy.src, copy.numel,
                 packed=True)


def _packs_experts_apart(shape: tuple, dtype: torch.dtype, isa: str) -> bool:
    """Whether packing experts one by one gives the same bytes as packing them together."""
    key = (shape, dtype, isa)
    if key not in _PACKS_APART:
        experts = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0)).to(dtype)
        together, apart = torch.empty_like(experts), torch.empty_like(experts)
        torch.ops._C.prepack_moe_weight(experts, together, isa)
        for expert in range(2):
            torch.ops._C.prepack_moe_weight(experts[expert:expert + 1], apart[expert:expert + 1], isa)
        _PACKS_APART[key] = torch.equal(together, apart)
    return _PACKS_APART[key]


def _redispatch_gemm(module: torch.nn.Module, pname: str, weight: torch.Tensor) -> bool:
    """Pack `weight` for a linear layer's CPU GEMM as its first load did; False if the layer kept it.

    The layer's (empty) parameter object stays in place, as after vLLM's own reload."""
    emptied = module._parameters[pname]
    module._parameters[pname] = torch.nn.Parameter(weight, requires_grad=False)
    try:
        module.quant_method.process_weights_after_loading(module)
        kept = module._parameters[pname]
    finally:
        module._parameters[pname] = emptied
    if kept.numel():
        module._parameters[pname] = kept
        return False
    return True


def _rebuild_gemm_on_first_use(module: torch.nn.Module) -> None:
    """Drop an embedding's packed GEMM copy; rebuild it from the weight if a GEMM ever needs it."""
    method = module.quant_method

    def cpu_linear(x, weight, bias):
        method.process_weights_after_loading(module)  # installs the rebuilt module.cpu_linear
        if module.cpu_linear is cpu_linear:
            raise RuntimeError("CPU GEMM dispatch did not rebuild the embedding's packed weight")
        return module.cpu_linear(x, weight, bias)

    module.cpu_linear = cpu_linear


class _LoaderRecorder:
    """Records the copies weight loaders make from pushed (meta) tensors into parameters (meta)."""

    def __init__(self, sources: dict[int, str], params: dict[int, int], describe):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self
        self.sources, self.params, self.describe = sources, params, describe
        # (name, source view or ("fill", value), parameter key, destination view)
        self.copies: list[tuple[str, tuple, int, tuple]] = []
        self.problems: list[str] = []
        self._last_name: dict[int, str] = {}  # parameter key -> the pushed tensor last copied into it

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func._schema.is_mutable:
                    recorder._record(func, args, kwargs)
                return func(*args, **kwargs)

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def _record(self, func, args, kwargs) -> None:
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if not isinstance(value, torch.Tensor):
                continue
            key = self.params.get(_storage_key(value))
            if key is None or value.numel() == 0:
                continue
            if func is torch.ops.aten.copy_.default and index == 0:
                source = args[1]
                name = self.sources.get(_storage_key(source)) if isinstance(source, torch.Tensor) else None
                if name is not None:
                    self.copies.append((name, _geometry(source), key, _geometry(value)))
                    self._last_name[key] = name
                    continue
            elif func is torch.ops.aten.fill_.Scalar and index == 0 and key in self._last_name:
                # e.g. the vocabulary padding rows an embedding loader zeroes after its copy
                self.copies.append((self._last_name[key], ("fill", args[1]), key, _geometry(value)))
                continue
            self.problems.append(f"{self.describe(key)}: written by {func} from something other than a "
                                 f"pushed tensor")


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _geometry(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
