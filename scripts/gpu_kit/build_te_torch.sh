#!/usr/bin/env bash
# Build Transformer Engine's PyTorch extension (transformer_engine_torch) from the kit's source and
# put it beside the installed transformer_engine package, where TE looks for it. run.sh starts this
# in the background, in its own process group; gpu_verify.py's stages d-f wait for RC_FILE.
#
#   build_te_torch.sh PYTHON PIP_WHEEL SOURCE_DIR TE_SITE RC_FILE [CUDNN_INCLUDE]
#
# NVTE_PYTORCH_FORCE_BUILD: else setup.py tries to download a prebuilt wheel (no network there).
# NVTE_NO_LOCAL_VERSION: else the version gets the enclosing git repository's hash, and TE refuses
# the mismatch with transformer-engine 2.11.0 at import. CPLUS_INCLUDE_PATH: cuDNN's headers.
set -uo pipefail
[[ $# -ge 5 ]] || { echo "usage: $0 PYTHON PIP_WHEEL SOURCE_DIR TE_SITE RC_FILE [CUDNN_INCLUDE]" >&2; exit 2; }
python="$1" pip_wheel="$2" source="$3" te_site="$4" rc_file="$5" cudnn_include="${6:-}"
echo "build started $(date -u +%T) (CUDA_HOME=${CUDA_HOME:-unset}, cuDNN headers: ${cudnn_include:-none})"
NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 MAX_JOBS="${MAX_JOBS:-16}" \
    CPLUS_INCLUDE_PATH="$cudnn_include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    "$python" "$pip_wheel/pip" install -v --no-index --no-deps --no-build-isolation --target "$source.built" "$source"
rc=$?
# The build installs its .dist-info at the top and the extension module inside transformer_engine/
# wheel_lib/. TE's package is already in TE_SITE, so the module is copied into its wheel_lib/ (pip
# --target over an existing package skips that folder: the first run on a GPU failed that way).
if [[ $rc == 0 ]]; then
    mv "$source.built"/transformer_engine_torch* "$te_site/" \
        && cp "$source.built"/transformer_engine/wheel_lib/* "$te_site/transformer_engine/wheel_lib/" || rc=1
    ls "$te_site"/transformer_engine/wheel_lib/transformer_engine_torch*.so \
        || { echo "the build left no transformer_engine_torch*.so in $te_site/transformer_engine/wheel_lib"; rc=1; }
fi
echo "build ended $(date -u +%T) with exit status $rc"
echo "$rc" > "$rc_file.partial" && mv "$rc_file.partial" "$rc_file"
exit "$rc"
