#!/usr/bin/env bash
# Pack what the GPU machine needs and cannot download (it has no network) into one folder that a
# command on it can carry (at most 64 MiB): scripts/gpu_kit/packed/ (git-ignored).
#
#   bash scripts/gpu_kit/pack.sh          # idempotent: a second run downloads and compresses nothing
#
# The GPU machine: Python 3.12, torch 2.11.0+cu130 (with its nvidia-* CUDA 13 libraries), nvcc 13.
# Packed for it (versions pinned here; README "GPU verification kit"):
#   wheels/  megatron-core, transformer-engine (Python part), its pydantic stack, torchao, and the
#            build tools its PyTorch extension needs (ninja for a parallel build, setuptools, wheel)
#   core/    transformer_engine_cu13's wheel without its 463 MB library, and that library pruned to
#            sm_90 (Hopper) by prune_fatbin.py and xz-compressed; kit.py assemble-core rejoins them
#   src/     transformer_engine_torch's source (PyPI has no wheel of it: it is built on the GPU)
#   pip/     pip's wheel, which run.sh runs pip from (whatever pip the GPU machine has, if any)
#   manifest.json, MANIFEST.md: every file's package, version, size and sha256
# and, for the engine stage (docs/gpu_engine.md), scripts/gpu_kit/packed_vllm/ (git-ignored): vLLM
# 0.26.0 and the 137 wheels of vllm_requirements.txt, and the 12 of stage_requirements.txt (what
# the stage's own code imports beyond vLLM: megatron-core, matplotlib, math-verify), unpacked, their
# libraries pruned to sm_90, compressed and split by vllm_pack.py into part1/, part2/, ... of at
# most $GPU_KIT_VLLM_PART_MIB MiB each (default 54: a part and the working tree must fit one
# command's 64 MiB), each with its manifest.json (every file's size and sha256). GPU_KIT_VLLM=0 leaves them out.
# Downloads and the unpruned library stay in the cache ($GPU_KIT_CACHE, default ~/.cache/megatron_rl/gpu_kit).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PACKED="${GPU_KIT_PACKED:-$HERE/packed}"
CACHE="${GPU_KIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_rl/gpu_kit}"
PYTHON="${PYTHON:-python3}"
LIMIT_BYTES=$((60 * 1024 * 1024))
TE_VERSION=2.11.0
# The GPU machine's interpreter and platform, for pip download of binary wheels.
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any)
WHEELS=(
    megatron-core==0.16.1
    "transformer-engine==$TE_VERSION"
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    torchao==0.17.0
    ninja==1.13.0 setuptools==80.9.0 wheel==0.45.1
)
PIP_WHEEL=pip==25.3  # run from its wheel on the GPU machine: a known pip whatever the machine has
CORE_WHEEL="transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl"
# The sdist's sha256 as the registry serves it: pip checks the download against it.
TE_TORCH_SDIST="transformer-engine-torch==$TE_VERSION --hash=sha256:b58d6322bdf885dfab0646da572aff9cf090b332ad470559aa58883c231e1816"

say() { echo "pack: $*"; }
pip_download() { nice -n 19 "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps "$@"; }

mkdir -p "$CACHE/downloads" "$PACKED/wheels" "$PACKED/core" "$PACKED/src" "$PACKED/pip"

# 1. Binary wheels (pip skips a file already in the folder; nothing is fetched when all are there).
wheel_present() {  # a requirement name==version has its wheel in the cache
    local name="${1%%==*}" version="${1##*==}"
    compgen -G "$CACHE/downloads/${name//-/_}-$version-*.whl" > /dev/null
}
missing=()
for requirement in "${WHEELS[@]}" "$PIP_WHEEL" "transformer-engine-cu13==$TE_VERSION"; do
    wheel_present "$requirement" || missing+=("$requirement")
done
if ((${#missing[@]})); then
    say "downloading ${missing[*]}"
    pip_download "${TARGET[@]}" -d "$CACHE/downloads" "${missing[@]}"
fi
for requirement in "${WHEELS[@]}"; do
    name="${requirement%%==*}" version="${requirement##*==}"
    cp -u "$CACHE/downloads/${name//-/_}-$version-"*.whl "$PACKED/wheels/"
done
cp -u "$CACHE/downloads/pip-${PIP_WHEEL##*==}-"*.whl "$PACKED/pip/"

# 2. The core library: pruned to sm_90, compressed, and the wheel around it without it.
core_dir="$CACHE/core"
mkdir -p "$core_dir"
if [[ ! -f "$PACKED/core/libtransformer_engine.so.xz" || ! -f "$PACKED/core/$CORE_WHEEL" || ! -f "$core_dir/prune.json" ]]; then
    say "splitting $CORE_WHEEL"
    nice -n 19 "$PYTHON" "$HERE/kit.py" split-core "$CACHE/downloads/$CORE_WHEEL" "$core_dir/libtransformer_engine.so" \
        "$core_dir/$CORE_WHEEL"
    say "pruning libtransformer_engine.so to sm_90"
    nice -n 19 "$PYTHON" "$HERE/prune_fatbin.py" prune "$core_dir/libtransformer_engine.so" \
        "$core_dir/libtransformer_engine.sm_90.so" --arch 90 --json "$core_dir/prune.json" > /dev/null
    nice -n 19 "$PYTHON" "$HERE/prune_fatbin.py" check "$core_dir/libtransformer_engine.so" \
        "$core_dir/libtransformer_engine.sm_90.so" --arch 90
    nice -n 19 "$PYTHON" "$HERE/kit.py" record-library "$core_dir/$CORE_WHEEL" "$core_dir/libtransformer_engine.sm_90.so"
    say "compressing the pruned library (xz -6; a few minutes, once)"
    nice -n 19 "$PYTHON" "$HERE/kit.py" pack-lib "$core_dir/libtransformer_engine.sm_90.so" "$PACKED/core/libtransformer_engine.so.xz"
    cp "$core_dir/$CORE_WHEEL" "$PACKED/core/"
    rm -f "$core_dir/libtransformer_engine.so" "$core_dir/libtransformer_engine.sm_90.so"
fi

# 3. transformer_engine_torch's source. pip saves an sdist only after preparing its metadata, and
# this one's setup.py needs a CUDA build of torch for that; so pip downloads it (checked against
# the pinned hash) and unpacks it, keeps the tree (--no-clean) when the metadata step fails, and
# the tree is packed again. It is the sdist's content: nothing in it is changed by the failed step
# but the egg-info and a __pycache__, which are left out.
sdist="$PACKED/src/transformer_engine_torch-$TE_VERSION.tar.gz"
if [[ ! -f "$sdist" ]]; then
    say "downloading transformer-engine-torch $TE_VERSION (source)"
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    echo "$TE_TORCH_SDIST" > "$scratch/requirement.txt"
    TMPDIR="$scratch" pip_download --no-clean --no-binary :all: --no-build-isolation --require-hashes \
        -r "$scratch/requirement.txt" -d "$scratch" > "$scratch/pip.log" 2>&1 || true
    tree="$(find "$scratch" -maxdepth 3 -name PKG-INFO -path '*transformer-engine-torch*' -printf '%h\n' | head -1)"
    if [[ -z "$tree" ]] || ! grep -qx "Version: $TE_VERSION" "$tree/PKG-INFO"; then
        tail -20 "$scratch/pip.log" >&2
        echo "pack: error: pip did not unpack transformer-engine-torch $TE_VERSION (log above)" >&2
        exit 1
    fi
    mkdir -p "$scratch/out/transformer_engine_torch-$TE_VERSION"
    (cd "$tree" && tar --exclude='*.egg-info' --exclude=__pycache__ -cf - .) \
        | tar -xf - -C "$scratch/out/transformer_engine_torch-$TE_VERSION"
    tar --sort=name --owner=0 --group=0 --mtime=2026-01-01 -C "$scratch/out" -czf "$sdist.partial" \
        "transformer_engine_torch-$TE_VERSION"
    mv "$sdist.partial" "$sdist"
fi

# 4. The manifest, and the size limit.
nice -n 19 "$PYTHON" "$HERE/kit.py" manifest "$PACKED" "$core_dir/prune.json"
total=$(du -sb "$PACKED" | cut -f1)
if ((total > LIMIT_BYTES)); then
    echo "pack: error: $PACKED is $total bytes, over the 60 MiB the kit may take along" >&2
    exit 1
fi
say "$PACKED: $((total / 1024 / 1024)) MiB ($total bytes); manifest: $PACKED/MANIFEST.md"

# 5. The vLLM parts (docs/gpu_engine.md). The wheel list is vllm_requirements.txt, derived by
# resolve_vllm.py with a Python 3.12 pip; the platforms are the ones it resolved for (llguidance
# needs manylinux_2_31, every other wheel fits manylinux_2_28).
[[ ${GPU_KIT_VLLM:-1} == 0 ]] && exit 0
PACKED_VLLM="${GPU_KIT_PACKED_VLLM:-$HERE/packed_vllm}"
VLLM_REQUIREMENTS="$HERE/vllm_requirements.txt"
STAGE_REQUIREMENTS="$HERE/stage_requirements.txt"  # resolve_vllm.py stage; stage_imports.py checks it
VLLM_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for minor in $(seq 5 31); do VLLM_TARGET+=(--platform "manylinux_2_${minor}_x86_64"); done
VLLM_TARGET+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any)
mkdir -p "$CACHE/vllm/downloads"
vllm_missing=0
while read -r wheel; do
    [[ -f "$CACHE/vllm/downloads/$wheel" ]] || vllm_missing=$((vllm_missing + 1))
done < <(sed -n 's/.*# \(.*\.whl\)$/\1/p' "$VLLM_REQUIREMENTS" "$STAGE_REQUIREMENTS")
if ((vllm_missing)); then
    say "downloading $vllm_missing of the parts' wheels (vllm_requirements.txt, stage_requirements.txt, checked against their hashes)"
    pip_download --require-hashes "${VLLM_TARGET[@]}" -d "$CACHE/vllm/downloads" -r "$VLLM_REQUIREMENTS" \
        -r "$STAGE_REQUIREMENTS"
fi
nice -n 19 "$PYTHON" "$HERE/vllm_pack.py" build "$VLLM_REQUIREMENTS" "$CACHE/vllm/downloads" "$CACHE/vllm/work" \
    "$PACKED_VLLM" --part-limit-mib "${GPU_KIT_VLLM_PART_MIB:-54}" --also "$STAGE_REQUIREMENTS"
# What one command carries: the working tree (tracked and untracked files git does not ignore) and one part.
tree_bytes=$(cd "$HERE/../.." && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 stat -c %s 2> /dev/null | awk '{s += $1} END {print s + 0}')
for part in "$PACKED_VLLM"/part*/; do
    part_bytes=$(du -sb "$part" | cut -f1)
    if ((part_bytes + tree_bytes > 64 * 1024 * 1024)); then
        echo "pack: error: $part ($part_bytes bytes) and the working tree ($tree_bytes bytes) exceed one command's 64 MiB; set GPU_KIT_VLLM_PART_MIB lower" >&2
        exit 1
    fi
done
say "$PACKED_VLLM: $(du -sb "$PACKED_VLLM" | cut -f1) bytes in $(ls -d "$PACKED_VLLM"/part*/ | wc -l) parts (working tree: $tree_bytes bytes); $PACKED_VLLM/MANIFEST.md"
