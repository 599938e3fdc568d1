#!/usr/bin/env bash
# Everything a GPU stay carries, made on a CPU machine that reaches the package index (pip's configured one), into
# the ignored folders the device calls name in `carry` (docs/device_runs.md says how the calls use them):
#   .vstage/moe/callNN  vLLM 0.26 + Ray 2.60 in chunks, MoE kernels kept (../shared/device/vllm_prepare.sh)
#   .whl/               megatron-core 0.19.2; compressed-tensors + loguru (FP8 rollout); torchvision (vLLM's
#                       Qwen2.5-VL image processor; the index's cp312 build links CUDA 13, as the box's torch) + blake3
#                       (vLLM's image hashes)
#   .verl/              verl 0.9.1 and the pure-Python packages the box lacks, for bench/verl_baseline.sh
#   .sgstage/callNN     SGLang 0.5.17 (the last release pinning the box's torch 2.11) + sglang-kernel 0.4.5 (sm90
#                       only, without its 1.1 GB FlashAttention-3: the probe runs SGLang's triton attention) + what
#                       its engine imports beyond the vLLM stage, found by importing it on a CPU with torch 2.11;
#                       chunks in vllm_install.sh's format, to install into /tmp/sglang_site (issue 41, STAGE=sglang)
# A fresh checkout has none of them; this takes 5-8 min on 2 cores (most of it xz). Parts: STAGE="vllm whl verl"
# (sglang only when asked).
# Usage: bash bench/stage_device.sh   (VLLM_PREPARE=path/to/vllm_prepare.sh if ../shared is elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-"vllm whl verl"}
PREPARE=${VLLM_PREPARE:-../shared/device/vllm_prepare.sh}
mkdir -p .git/info && touch .git/info/exclude
for dir in /.vstage/ /.whl/ /.verl/ /.dev/ /.sgstage/; do grep -qxF "$dir" .git/info/exclude || echo "$dir" >> .git/info/exclude; done
# the box: CPython 3.12, x86_64, glibc 2.35
PLATFORM="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
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
if [[ " $STAGE " == *" sglang "* ]]; then
  INSTALLER=$(dirname "$PREPARE")/vllm_install.sh  # unpacks any stage of its format into the site folder it is given
  [ -f "$INSTALLER" ] || { echo "stage_device: $INSTALLER not found (set VLLM_PREPARE)" >&2; exit 1; }
  work=/tmp/megarl-sglang; rm -rf "$work" && mkdir -p "$work/site"
  # sglang pins transformers 5.12.1 (the box's 5.17 already registers a config sglang registers again) and, with
  # it, tokenizers <= 0.23.0; openai, xgrammar and tvm-ffi differ from the vLLM stage's pins
  download "$work/wheels" sglang==0.5.17 sglang-kernel==0.4.5 torch_memory_saver==0.0.9.post1 transformers==5.12.1 \
    tokenizers==0.22.2 openai==2.6.1 xgrammar==0.2.1 apache-tvm-ffi==0.1.11 setproctitle==1.3.8 sentencepiece==0.2.3 \
    gguf==0.19.0 einops==0.8.2 dill==0.4.1 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 orjson==3.13.0 \
    uvloop==0.23.0 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 \
    aiosignal==1.4.0 frozenlist==1.8.0 attrs==26.1.0 ipython==9.19.1 traitlets==5.16.1 compressed-tensors==0.20.1 \
    loguru==0.7.3 uvicorn==0.55.0 flashinfer-python==0.6.15.post1 nvidia-ml-py==13.615.71
  # flashinfer (and the pynvml it imports): sglang's fp8_utils imports it at module level on CUDA (seen on the
  # H100, 2026-12-07: the engine's import chain reaches it through its quantization registry), though the triton
  # attention and pytorch sampling backends never call it; its kernels compile on first use only. A CPU import
  # sees these only with torch told it has an sm90 device (and sgl_kernel, which needs the driver, stood in for).
  # the box's interpreter, not this one, decides which wheels install
  python3 -m pip install -q $PLATFORM --no-compile --target "$work/site" "$work"/wheels/*.whl 2>&1 \
    | grep -v "^WARNING: Location" || true
  [ -d "$work/site/sglang" ] && [ -d "$work/site/sgl_kernel/sm90" ] || { echo "stage_device: sglang did not install" >&2; exit 1; }
  # what the box's engine imports, checked as the box imports it (CUDA-only imports included): needs a Python
  # 3.12 with the box's torch in SGLANG_CHECK_PYTHON (e.g. a virtualenv with torch 2.11.0+cu130 and nothing the box
  # lacks); skipped, and said so, without one
  if [ -n "${SGLANG_CHECK_PYTHON:-}" ]; then
    "$SGLANG_CHECK_PYTHON" bench/sglang_import_check.py "$work/site" ${VLLM_SITE:+"$VLLM_SITE"} \
      || { echo "stage_device: SGLang's engine does not import from the stage (above)" >&2; exit 1; }
  else
    echo "stage_device: SGLANG_CHECK_PYTHON not set: the stage's CUDA-side imports are not checked" >&2
  fi
  # Hopper only, and no FlashAttention-3/FlashMLA builds: 1.2 GB of the kernel package's 1.25 GB
  rm -rf "$work/site/sgl_kernel/sm100" "$work/site/sgl_kernel/flash_ops.abi3.so" "$work/site/sgl_kernel/flashmla_ops.abi3.so" \
    "$work/site/bin"
  tar -C "$work" -cf - site | xz -T2 -9 > "$work/site.tar.xz"
  split -b 55M -d -a 2 "$work/site.tar.xz" "$work/part"
  stage_id=$(sha256sum "$work/site.tar.xz" | cut -c1-16)
  rm -rf .sgstage && mkdir -p .sgstage
  parts=$(ls "$work"/part?? | wc -l); i=1
  for part in "$work"/part??; do
    call=.sgstage/call$(printf %02d "$i"); mkdir -p "$call"; cp "$part" "$call/"; cp "$INSTALLER" "$call/"
    { echo "stage_id=$stage_id"; echo "parts=$parts"
      for p in "$work"/part??; do echo "$(basename "$p") $(sha256sum "$p" | cut -d' ' -f1)"; done; } > "$call/MANIFEST"
    i=$((i + 1))
  done
fi
du -sh .vstage/moe/call* .whl .verl .sgstage/call* 2>/dev/null || true
