#!/usr/bin/env bash
# Everything a GPU stay carries, made on a CPU machine that reaches the package index (pip's configured one), into
# the ignored folders the device calls name in `carry` (docs/device_runs.md says how the calls use them):
#   .vstage/moe/callNN  vLLM 0.26 + Ray 2.60 in chunks, MoE kernels kept (../shared/device/vllm_prepare.sh)
#   .whl/               megatron-core 0.19.2; compressed-tensors + loguru (FP8 rollout); torchvision (vLLM's
#                       Qwen2.5-VL image processor; the index's cp312 build links CUDA 13, as the box's torch) + blake3
#                       (vLLM's image hashes)
#   .verl/              verl 0.9.1 and the pure-Python packages the box lacks, for bench/verl_baseline.sh
# A fresh checkout has none of them; this takes 5-8 min on 2 cores (most of it xz). Parts: STAGE="vllm whl verl".
# Usage: bash bench/stage_device.sh   (VLLM_PREPARE=path/to/vllm_prepare.sh if ../shared is elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-"vllm whl verl"}
PREPARE=${VLLM_PREPARE:-../shared/device/vllm_prepare.sh}
mkdir -p .git/info && touch .git/info/exclude
for dir in /.vstage/ /.whl/ /.verl/ /.dev/; do grep -qxF "$dir" .git/info/exclude || echo "$dir" >> .git/info/exclude; done
# the box: CPython 3.12, x86_64, glibc 2.35
PLATFORM="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform any"
download() {  # download DIR SPEC...
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q $PLATFORM -d "$dir" "$@" 2>&1 | grep -v "^WARNING: Location" || true
  for spec in "$@"; do  # pip's quiet mode can swallow a miss: name the package that did not come
    local name=${spec%%[=<>]*}; name=${name//-/_}
    ls "$dir" | grep -qi "^${name}-" || { echo "stage_device: $spec was not downloaded into $dir" >&2; exit 1; }
  done
}
if [[ " $STAGE " == *" vllm "* ]]; then
  [ -f "$PREPARE" ] || { echo "stage_device: $PREPARE not found (set VLLM_PREPARE)" >&2; exit 1; }
  # 55 MiB chunks leave room for the repository (~3 MiB) and the last call's wheels beside a chunk under 64 MiB
  bash "$PREPARE" --keep-moe --chunk-mib 55 /tmp/megarl-vllm-chunks
  rm -rf .vstage/moe && mkdir -p .vstage/moe && cp -r /tmp/megarl-vllm-chunks/call* .vstage/moe/
fi
if [[ " $STAGE " == *" whl "* ]]; then
  download .whl megatron-core==0.19.2 compressed-tensors==0.20.1 loguru==0.7.3 torchvision==0.26.0 blake3==1.0.11
fi
if [[ " $STAGE " == *" verl "* ]]; then
  download .verl verl==0.9.1 hydra-core==1.3.2 omegaconf==2.3.0 codetiming pylatexenc datasets==5.2.0 dill \
    multiprocess torchdata==0.11.0 tensordict==0.10.0 orjson pyvers importlib_metadata uvicorn transferqueue==0.1.11 \
    watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 \
    jmespath==1.1.0 supervisor==4.3.0
  # omegaconf's parser runtime is published as a source archive only: build its wheel here
  rm -rf /tmp/megarl-antlr && mkdir -p /tmp/megarl-antlr
  python3 -m pip download -q --no-deps --no-binary=:all: -d /tmp/megarl-antlr antlr4-python3-runtime==4.9.3 2>&1 \
    | grep -v "^WARNING: Location" || true
  python3 -m pip wheel -q --no-deps -w .verl /tmp/megarl-antlr/antlr4-python3-runtime-4.9.3.tar.gz 2>&1 \
    | grep -v "^WARNING: Location" || true
fi
du -sh .vstage/moe/call* .whl .verl 2>/dev/null || true
