#!/usr/bin/env bash
# The GPU verification kit in one command (README, "GPU verification kit"):
#
#   bash scripts/gpu_kit/run.sh RESULTS_DIR                  # on the GPU machine, with scripts/gpu_kit/packed
#   bash scripts/gpu_kit/run.sh --dry-run RESULTS_DIR        # stages a-c on CPU; installs nothing
#   bash scripts/gpu_kit/run.sh --install-only RESULTS_DIR   # only the install (checks a packed kit)
#   bash scripts/gpu_kit/run.sh --perf RESULTS_DIR           # the install, then the MoE performance sweep
#   bash scripts/gpu_kit/run.sh --perf --dry-run RESULTS_DIR # the sweep's pipeline on CPU; installs nothing
#
# --perf runs benchmarks/moe_perf.py instead of gpu_verify.py once TE's extension is built (it waits
# for it), within the same budget: RESULTS_DIR/moe_perf.jsonl (a line per case), moe_perf.md and
# step_times.jsonl (the measured cases as `megatron-rl plan --measured`'s table).
#
# On the GPU machine (Python 3.12, torch 2.11.0+cu130, nvcc 13, no network) it installs the packed
# kit without network into a scratch folder ($GPU_KIT_WORK, default a new folder under /tmp), in two
# parts put on PYTHONPATH: base/ (megatron-core, torchao, build tools) for every stage, te/
# (Transformer Engine) only for stages d-f; starts the build of TE's PyTorch extension in the
# background; and runs benchmarks/gpu_verify.py, which writes RESULTS_DIR/gpu_verify.md and .json
# stage by stage. Extra arguments go to gpu_verify.py (e.g. --stages abcd, --timeout e=200).
# The whole command keeps to $GPU_KIT_BUDGET_S seconds (default 530: one 9-minute command's margin).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
PACKED="${GPU_KIT_PACKED:-$HERE/packed}"
BUDGET_S="${GPU_KIT_BUDGET_S:-530}"
TE_VERSION=2.11.0
CORE_WHEEL="transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl"

usage() {
    echo "usage: bash scripts/gpu_kit/run.sh [--dry-run | --install-only | --perf [--dry-run]] RESULTS_DIR [options]" >&2
    exit 2
}

# --- vLLM parts and the engine stage (docs/gpu_engine.md) ----------------------------------------
#   bash scripts/gpu_kit/run.sh --receive scripts/gpu_kit/packed_vllm/partN   # one part per command
#   bash scripts/gpu_kit/run.sh --engine RESULTS_DIR [gpu_engine.py options]   # once all are there
# --receive checks the part against its manifest (sizes, sha256), unpacks it into $VLLM_RECEIVED
# (git-ignored, so it stays between the commands of a warm machine) and names the parts present
# and missing; --engine refuses, naming the missing parts, until all are there.
VLLM_RECEIVED="${GPU_KIT_VLLM_RECEIVED:-$HERE/received}"
case "${1:-}" in
    --receive)
        [[ $# -eq 2 ]] || { echo "usage: bash scripts/gpu_kit/run.sh --receive PART_DIR" >&2; exit 2; }
        exec "$PYTHON" "$HERE/vllm_receive.py" receive "$2" "$VLLM_RECEIVED"
        ;;
    --engine)
        [[ $# -ge 2 ]] || { echo "usage: bash scripts/gpu_kit/run.sh --engine RESULTS_DIR [gpu_engine.py options]" >&2; exit 2; }
        engine_started=$SECONDS
        "$PYTHON" "$HERE/vllm_receive.py" status "$VLLM_RECEIVED" || {
            echo "run: error: the engine stage needs every vLLM part: receive the missing ones first" \
                "(bash scripts/gpu_kit/run.sh --receive scripts/gpu_kit/packed_vllm/partN, carrying that folder)" >&2
            exit 1
        }
        export PYTHONPATH="$VLLM_RECEIVED/site${PYTHONPATH:+:$PYTHONPATH}"
        # No network; FlashInfer is not packed, and vLLM's FlashInfer sampler would import it.
        export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
        results="$2"
        shift 2
        exec "$PYTHON" "$ROOT/benchmarks/gpu_engine.py" --out "$results" \
            --deadline-s "$((BUDGET_S - (SECONDS - engine_started)))" "$@"
        ;;
esac
# --- end of the vLLM block -------------------------------------------------------------------------

mode=run
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    --install-only) mode=install; shift ;;
    --perf) mode=perf; shift; [[ ${1:-} == --dry-run ]] && { mode=perf_dry; shift; } ;;
    "" | -*) usage ;;
esac
[[ $# -ge 1 ]] || usage
RESULTS="$1"
shift
if [[ $mode == dry ]]; then
    exec "$PYTHON" "$ROOT/benchmarks/gpu_verify.py" --dry-run --out "$RESULTS" "$@"
fi
if [[ $mode == perf_dry ]]; then
    exec "$PYTHON" "$ROOT/benchmarks/moe_perf.py" --dry-run --out "$RESULTS" "$@"
fi

started=$SECONDS
say() { echo "run: [$((SECONDS - started))s] $*"; }
fail() { echo "run: error: $*" >&2; exit 1; }
WORK="${GPU_KIT_WORK:-$(mktemp -d /tmp/gpu-kit.XXXXXX)}"
LOGS="$RESULTS/logs"
mkdir -p "$LOGS" "$WORK"

"$PYTHON" "$HERE/kit.py" verify "$PACKED" \
    || fail "the packed kit ($PACKED) is missing or differs from its manifest: run scripts/gpu_kit/pack.sh on a machine with network and carry that folder"

# 1. Install, without network. --target: no virtual environment or system install is needed.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_BREAK_SYSTEM_PACKAGES=1
PIP=("$PYTHON" "$(ls "$PACKED"/pip/pip-*.whl)/pip")  # pip runs from its own wheel
pip_install() { "${PIP[@]}" install --no-index --no-deps --no-compile "$@" >> "$LOGS/install.log" 2>&1; }
base_wheels=()
for wheel in "$PACKED"/wheels/*.whl; do
    [[ $(basename "$wheel") == transformer_engine-* ]] || base_wheels+=("$wheel")
done
pip_install --target "$WORK/base" "${base_wheels[@]}" || fail "installing the base wheels failed: $LOGS/install.log"
"$PYTHON" "$HERE/kit.py" assemble-core "$PACKED/core/$CORE_WHEEL" "$PACKED/core/libtransformer_engine.so.xz" \
    "$WORK/$CORE_WHEEL" || fail "restoring Transformer Engine's core library failed"
pip_install --target "$WORK/te" "$PACKED"/wheels/transformer_engine-*.whl "$WORK/$CORE_WHEEL" \
    || fail "installing Transformer Engine failed: $LOGS/install.log"
rm -f "$WORK/$CORE_WHEEL"
export PYTHONPATH="$WORK/base${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$WORK/base/bin:$PATH"  # ninja: torch builds extensions in parallel only with it
say "installed into $WORK (base/, te/)"
[[ $mode == install ]] && exit 0

# 2. TE's PyTorch extension, built in the background while stages a-c run (d-f wait for it).
# The cuDNN headers come with torch's nvidia-cudnn package; the build needs them on the include path.
cudnn_include="$("$PYTHON" -c '
import glob, os, sys
found = [os.path.dirname(h) for p in sys.path for h in glob.glob(os.path.join(p, "nvidia", "**", "cudnn.h"), recursive=True)]
print(found[0] if found else "")')"
[[ -n $cudnn_include ]] || say "warning: no cudnn.h found in the nvidia packages; the extension build may fail"
# TE's build takes the toolkit's headers from CUDA_HOME, else from where `nvcc` is found, stripped of
# "/bin/nvcc" (a wrapper script in /usr/local/bin would give /usr/local): ask nvcc where it lives.
if [[ -z ${CUDA_HOME:-} ]] && command -v nvcc > /dev/null; then
    top="$(cd "$WORK" && nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
    [[ -n $top && -d $top ]] && export CUDA_HOME="$(cd "$top" && pwd -P)"
fi
tar -xzf "$PACKED/src/transformer_engine_torch-$TE_VERSION.tar.gz" -C "$WORK"
setsid bash "$HERE/build_te_torch.sh" "$PYTHON" "${PIP[1]%/pip}" "$WORK/transformer_engine_torch-$TE_VERSION" "$WORK/te" \
    "$LOGS/te_build.rc" "$cudnn_include" > "$LOGS/te_build.log" 2>&1 &
build_pid=$!
say "building transformer_engine_torch in the background (log: $LOGS/te_build.log)"

# 3. The stages (--perf: the MoE sweep, which waits for the extension), within what is left of the budget.
script="$ROOT/benchmarks/gpu_verify.py"
[[ $mode == perf ]] && script="$ROOT/benchmarks/moe_perf.py"
"$PYTHON" "$script" --out "$RESULTS" --deadline-s "$((BUDGET_S - (SECONDS - started)))" \
    --te-site "$WORK/te" --te-build-rc "$LOGS/te_build.rc" "$@"
status=$?
if kill -0 "$build_pid" 2> /dev/null; then
    kill -- "-$build_pid" 2> /dev/null  # the build's own process group (setsid), nothing else
    say "the extension build was still running and was stopped"
fi
say "done: $RESULTS/$(basename "$script" .py).md"
exit $status
