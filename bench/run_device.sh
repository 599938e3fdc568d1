#!/usr/bin/env bash
# All GPU measurements of bench/ in one command, for the lent H200 (see docs/device_runs.md):
#   bash bench/run_device.sh smoke|full|attn|pack|validate|vllm|e2e|big|moe|gen|lora|vl|fp8curve|pinned
# (validate: first thing in every stay: `pytest tests/gpu` (all GPU tests; with vLLM carried, its tests too) and a
#  packed GRPO run on the GPU; record the pass/fail count in docs/device_runs.md)
# (big: bench/e2e_grpo.py --random-init for $MODELS (default 7b) with the optimizer partly on the host;
#  GEN_ALONE=1 (big, lora, e2e) adds plain vLLM's generation of the same prompts after the run; EXTRA adds trainer
#  overrides and TAG a suffix to the result's name: FP8 rollout beside bf16 is
#  `bash bench/run_device.sh big; EXTRA=actor_rollout_ref.rollout.quantization=fp8 TAG=_fp8 bash bench/run_device.sh big`)
# (moe: vLLM's routing GPU test, then MoE GRPO (Qwen3-30B-A3B sizes, $LAYERS layers) per router replay mode
#  in $REPLAY; needs the --keep-moe vLLM stage. gen: plain vLLM's generation of big's prompts, bf16 and FP8, at
#  $MODELS: `MODELS=7b,30b-a3b bash bench/run_device.sh gen`)
# (vl: the vision-language GPU tests, then GRPO of a Qwen2.5-VL shape ($MODELS, default vl-3b; vl-7b) with a
#  $IMAGE_SIZE-pixel picture per prompt, random init, through vLLM; needs torchvision + blake3 carried)
# (fp8curve: grpo_tiny through vLLM on the GPU, $STEPS steps with a bf16 rollout, then with an FP8 one and its
#  token-level TIS, same seed: the rewards and the rollout-vs-trainer mismatch of each in fp8curve_<quant>.jsonl)
# (lora: the LoRA GPU tests, then LoRA GRPO --random-init at $MODELS (default 14b / 32b by card), MERGE=true|false)
# (vllm, e2e: need vLLM and Ray, carried as ../shared/device/README.md says; vllm: the vLLM GPU tests and the
#  tiny GRPO run through Ray + vLLM with checkpoints; e2e: bench/e2e_grpo.py for $MODELS, with SGLang's rollout
#  `EXTRA=actor_rollout_ref.rollout.name=sglang TAG=_sglang` after sourcing the SGLang stage (docs/sglang.md))
# (attn: the SDPA core attention and TP=1 log-prob re-measurement; train + logprob + the CUDA SDPA test)
# (pack: the CUDA packing tests, then packed token-budget training on RL-like lengths for $MODELS, default
#  1.5b; FUSIONS=off,on also runs megatron's torch.compile'd SwiGLU/bias-dropout-add)
# Expects PYTHONPATH to hold megatron-core and the repo, and $OUT to be the folder that comes back.
# Writes $OUT/<mode>.log (everything) and one JSON per benchmark; a failing step is logged and the
# others still run (rc of each step is printed in the summary at the end).
set -uo pipefail
MODE=${1:-smoke}
OUT=${OUT:-/tmp/megarl_bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
LOG="$OUT/$MODE.log"
SUMMARY=""

step() {  # step NAME CMD...
  local name=$1; shift
  echo "=== [$name] $(date -u +%FT%TZ) $*" | tee -a "$LOG"
  local start=$SECONDS
  "$@" 2>&1 | grep -v -E "Loading weights|Writing model shards|UserWarning|warnings.warn" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  SUMMARY+="$name rc=$rc $((SECONDS - start))s"$'\n'
  echo "=== [$name] rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
}

step env bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python3 -c "import sys,torch,transformers,megatron.core as m; print(sys.version); print(\"torch\",torch.__version__,
  \"cuda\",torch.version.cuda,\"mcore\",m.__version__,\"transformers\",transformers.__version__,
  torch.cuda.get_device_name())"; python3 -m pip list 2>/dev/null | grep -i -E "^(safetensors|pyarrow|tensorboard|tokenizers|pyyaml|tqdm|ray|vllm|transformer.engine|flash.attn|apex) "'

GRPO_DIR=/tmp/megarl_grpo_$MODE
if [ "$MODE" = smoke ]; then
  step parity python3 -m pytest tests/gpu tests/distributed/engines/megatron/test_cuda_redirect_and_offload_gpu.py -q -s -p no:cacheprovider
  step train python3 -m bench.train_throughput --models 0.5b --prompt-len 512 --response-len 1536 --rows 4 \
    --group-size 4 --warmup 1 --iters 1 --hf-attn sdpa,eager --out "$OUT/train_smoke.json"
  step logprob python3 -m bench.logprob_bench --batch 2 --seq 1024 --warmup 1 --iters 2 --out "$OUT/logprob_smoke.json"
  step weight_sync python3 -m bench.weight_sync_bench --models 0.5b --bucket-mb 512 --iters 2 \
    --out "$OUT/weight_sync_smoke.json"
  step grpo python3 -m megarl.trainer.main --config configs/grpo_tiny.yaml trainer.backend=inprocess \
    trainer.device=cuda trainer.total_training_steps=3 trainer.test_freq=100 trainer.save_freq=100 \
    trainer.default_local_dir=$GRPO_DIR
elif [ "$MODE" = pack ]; then
  [ "${LOGPROB:-0}" = 1 ] && step logprob python3 -m bench.logprob_bench --batch 8 --seq 2048 --warmup 2 --iters 5 \
    --out "$OUT/logprob_pack.json"
  [ "${SKIP_TESTS:-0}" = 1 ] || step packing_cuda_test timeout 200 python3 -m pytest tests/gpu/test_packing_cuda.py -q -s -p no:cacheprovider
  for model in $(echo "${MODELS:-1.5b}" | tr , ' '); do
    step "train_packed_$model" timeout "${TRAIN_TIMEOUT:-420}" python3 -m bench.train_throughput --models "$model" \
      --prompt-len 1024 --response-len 3072 --rows "${ROWS:-16}" --group-size 8 --response-len-dist uniform \
      --max-tokens-per-micro-batch "${BUDGETS:-32768,16384}" --fusions "${FUSIONS:-off,on}" \
      --hf-attn sdpa --hf-micro-batch-size 1 --warmup 1 --iters 2 --profile \
      --out "$OUT/train_packed_$model.json"
  done
elif [ "$MODE" = validate ]; then  # first thing in every stay: every GPU test (tests/gpu), and a packed GRPO run
  # 503 s alone on an H100 (2026-12-07 13:49); 560 s cut it short in its 32nd test with SGLang's probe and a CPU
  # model write beside it: the limit keeps a hung test from eating the stay, not a tight budget
  # TESTS narrows it to the files whose GPU paths changed since the last full pass, where device time is short
  step gpu_tests timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest ${TESTS:-tests/gpu} -q -rs -p no:cacheprovider --timeout=400 \
    --junitxml="$OUT/gpu_tests.xml"
  step grpo_packed timeout 200 python3 -m megarl.trainer.main --config configs/grpo_tiny.yaml trainer.backend=inprocess \
    trainer.device=cuda trainer.total_training_steps=20 trainer.test_freq=10 trainer.save_freq=100 \
    actor_rollout_ref.model.use_sequence_packing=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024 trainer.progress_bar=false \
    trainer.default_local_dir=$GRPO_DIR
elif [ "$MODE" = vllm ]; then  # needs vLLM + Ray (../shared/device recipe): the production path's tests and runs
  step vllm_gpu_test timeout 300 python3 -m pytest tests/gpu/test_vllm_cuda.py -q -s -p no:cacheprovider
  step grpo_tiny_vllm timeout 240 python3 -m megarl.trainer.main --config configs/grpo_tiny.yaml trainer.device=cuda \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
    actor_rollout_ref.rollout.enforce_eager=true trainer.total_training_steps=10 trainer.test_freq=5 \
    trainer.save_freq=5 trainer.progress_bar=false trainer.default_local_dir=$GRPO_DIR
elif [ "$MODE" = e2e ]; then  # bench/e2e_grpo.py for $MODELS (default 0.5b), vLLM + Ray
  for model in $(echo "${MODELS:-0.5b}" | tr , ' '); do
    step "e2e_$model" timeout "${E2E_TIMEOUT:-540}" python3 -m bench.e2e_grpo --shape "$model" --prompts "${PROMPTS:-64}" \
      --n 8 --prompt-len 512 --response-len "${RESPONSE_LEN:-1024}" --steps "${STEPS:-4}" ${GEN_ALONE:+--gen-alone} \
      --out "$OUT/e2e_$model${TAG:-}.json" ${EXTRA:-}
  done
elif [ "$MODE" = big ] || [ "$MODE" = moe ]; then  # GRPO at $MODELS (default 7b) on one GPU, random init (no weights on disk)
  # The optimizer's fp32 state lives on the host in part (megatron's HybridDeviceOptimizer), sized to the card:
  # the device keeps bf16 params (+ grads while training) and 1 - fraction of Adam's state, vLLM the rest.
  # moe: the Qwen3-30B-A3B shape cut to $LAYERS layers (default 8, 5.6B parameters), once per router replay
  # mode in $REPLAY (default disabled,R3,R2); the rollout returns its routing in every mode, for the metric.
  GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
  if [ "$GIB" -lt 100 ]; then FRACTION=${FRACTION:-0.75}; UTIL=${UTIL:-0.42}; FP32_GRADS=${FP32_GRADS:-false}
  else FRACTION=${FRACTION:-0.5}; UTIL=${UTIL:-0.45}; FP32_GRADS=${FP32_GRADS:-true}; fi
  O=actor_rollout_ref.actor
  OFFLOAD="$O.megatron.recompute_granularity=full $O.megatron.grad_offload=true
    $O.megatron.use_distributed_optimizer=true $O.megatron.override_ddp_config.grad_reduce_in_fp32=$FP32_GRADS
    $O.optim.override_optimizer_config.optimizer_cpu_offload=true
    $O.optim.override_optimizer_config.optimizer_offload_fraction=$FRACTION
    $O.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=true
    $O.optim.override_optimizer_config.use_precision_aware_optimizer=true"
  if [ "$MODE" = big ]; then RUNS=$(echo "${MODELS:-7b}" | tr , ' ')
  else
    [ "${SKIP_TESTS:-0}" = 1 ] || step routing_cuda_test timeout 300 python3 -m pytest tests/gpu/test_vllm_routing_cuda.py \
      -q -rs -p no:cacheprovider
    RUNS=$(echo "${REPLAY:-disabled,R3,R2}" | tr , ' ')
  fi
  for run in $RUNS; do
    if [ "$MODE" = big ]; then SHAPE="--shape $run"; NAME=$run; KNOBS=""
    else SHAPE="--shape 30b-a3b --layers ${LAYERS:-8}"; NAME=moe_$run
      KNOBS="actor_rollout_ref.rollout.enable_rollout_routing_replay=true $O.megatron.router_replay.mode=$run"; fi
    step "e2e_$NAME" timeout "${E2E_TIMEOUT:-900}" python3 -m bench.e2e_grpo $SHAPE --random-init \
      --prompts "${PROMPTS:-16}" --n 8 --prompt-len "${PROMPT_LEN:-256}" --response-len "${RESPONSE_LEN:-512}" \
      --steps "${STEPS:-3}" --token-budget "${BUDGET:-4096}" --gpu-memory-utilization "$UTIL" ${GEN_ALONE:+--gen-alone} \
      --out "$OUT/e2e_$NAME${TAG:-}.json" $OFFLOAD $KNOBS ${EXTRA:-}
  done
elif [ "$MODE" = pinned ]; then  # host memory of page-locked copies: torch's rounding, its knobs, megarl's buffer
  step pinned_host_probe timeout 300 python3 -m bench.pinned_host_probe --out "$OUT/pinned_host_probe.json"
elif [ "$MODE" = gen ]; then  # plain vLLM's generation at $MODELS (default 7b; 30b-a3b cut to $LAYERS) per $QUANT
  for model in $(echo "${MODELS:-7b}" | tr , ' '); do
    LAYER_ARGS=""; [ "$model" = 30b-a3b ] && LAYER_ARGS="--layers ${LAYERS:-8}"
    # fp8kv: FP8 weights and an FP8 KV cache; fp8marlin: FP8 weights with bf16 activations (vLLM's Marlin kernel,
    # weight-only: no activation quantization per linear, for decode that reads weights more than it computes)
    for quant in $(echo "${QUANT:-bf16,fp8}" | tr , ' '); do
      KERNEL_ENV=""
      case $quant in
        bf16) QUANT_ARG="" ;;
        fp8kv) QUANT_ARG="--quantization fp8 --kv-cache-dtype fp8" ;;
        fp8marlin) QUANT_ARG="--quantization fp8"; KERNEL_ENV="VLLM_TEST_FORCE_FP8_MARLIN=1" ;;
        *) QUANT_ARG="--quantization $quant" ;;
      esac
      step "gen_${model}_$quant" env $KERNEL_ENV timeout "${GEN_TIMEOUT:-400}" python3 -m bench.e2e_grpo --shape "$model" $LAYER_ARGS \
        --random-init --gen-only $QUANT_ARG \
        --prompts "${PROMPTS:-16}" --n 8 --prompt-len "${PROMPT_LEN:-256}" --response-len "${RESPONSE_LEN:-512}" \
        --gpu-memory-utilization "${UTIL:-0.85}" --out "$OUT/gen_${model}_$quant.json"
    done
  done
elif [ "$MODE" = lora ]; then  # LoRA GRPO at $MODELS (default: 14b on an 80 GB card, 32b on a 141 GB one), random init
  # The frozen bf16 base leaves the device while vLLM generates (param_offload); the adapters and their Adam
  # state are megabytes. MERGE=true: vLLM gets the merged weights each sync; false: it serves the adapter.
  GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
  if [ "$GIB" -lt 100 ]; then DEFAULT_MODELS=14b; UTIL=${UTIL:-0.55}; else DEFAULT_MODELS=32b; UTIL=${UTIL:-0.6}; fi
  M=actor_rollout_ref.model
  O=actor_rollout_ref.actor
  [ "${SKIP_TESTS:-0}" = 1 ] || step lora_cuda_test timeout 400 python3 -m pytest tests/gpu/test_lora_cuda.py -q -s -p no:cacheprovider
  for model in $(echo "${MODELS:-$DEFAULT_MODELS}" | tr , ' '); do
    step "e2e_lora_${model}_merge_${MERGE:-true}" timeout "${E2E_TIMEOUT:-900}" python3 -m bench.e2e_grpo --shape "$model" \
      --random-init --prompts "${PROMPTS:-16}" --n 8 --prompt-len "${PROMPT_LEN:-256}" \
      --response-len "${RESPONSE_LEN:-512}" --steps "${STEPS:-3}" --token-budget "${BUDGET:-8192}" \
      --gpu-memory-utilization "$UTIL" ${GEN_ALONE:+--gen-alone} --out "$OUT/e2e_lora_${model}_merge_${MERGE:-true}.json" \
      $M.lora.rank=${RANK:-32} $M.lora.alpha=${ALPHA:-64} $M.lora.merge=${MERGE:-true} \
      $O.megatron.param_offload=true $O.megatron.recompute_granularity=full \
      $O.megatron.use_distributed_optimizer=true ${EXTRA:-}
  done
elif [ "$MODE" = vl ]; then  # vision-language GRPO at $MODELS (default vl-3b), random init, one picture per prompt
  # Megatron's grads and Adam state leave the device while vLLM generates (verl's offload keys); the tower is frozen.
  # vl-3b's update plans 99.7 GiB without recompute (bf16 params, fp32 grads and Adam, 8192-token micro-batches with
  # their fp32 log-prob buffers): an 80 GB card takes full recompute and bf16 grads (70.6 GiB), a 141 GB one neither.
  O=actor_rollout_ref.actor
  GIB=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
  if [ "$GIB" -lt 100 ]; then FIT="$O.megatron.recompute_granularity=full $O.megatron.override_ddp_config.grad_reduce_in_fp32=false"
  else FIT=""; fi
  [ "${SKIP_TESTS:-0}" = 1 ] || step vl_cuda_tests timeout 400 python3 -m pytest tests/gpu/test_vllm_vision_language_cuda.py \
    tests/gpu/test_vision_language_cuda.py -q -rs -s -p no:cacheprovider
  for model in $(echo "${MODELS:-vl-3b}" | tr , ' '); do
    step "e2e_$model" timeout "${E2E_TIMEOUT:-900}" python3 -m bench.e2e_grpo --shape "$model" --random-init \
      --prompts "${PROMPTS:-16}" --n 8 --prompt-len "${PROMPT_LEN:-512}" --response-len "${RESPONSE_LEN:-512}" \
      --image-size "${IMAGE_SIZE:-448}" --steps "${STEPS:-3}" --token-budget "${BUDGET:-8192}" \
      --gpu-memory-utilization "${UTIL:-0.4}" --out "$OUT/e2e_$model.json" \
      $O.megatron.grad_offload=true $O.megatron.optimizer_offload=true $O.megatron.use_distributed_optimizer=true \
      $FIT ${EXTRA:-}
  done
elif [ "$MODE" = fp8curve ]; then  # a short learning curve: grpo_tiny through vLLM, bf16 rollout, then FP8 (+ token TIS)
  # Same seed, data and bf16 training for both; only the rollout's weights differ. metrics.jsonl of each comes back.
  for quant in $(echo "${QUANT:-bf16,fp8}" | tr , ' '); do
    QUANT_ARG=""; [ "$quant" = bf16 ] || QUANT_ARG="actor_rollout_ref.rollout.quantization=$quant"
    step "grpo_tiny_$quant" timeout "${CURVE_TIMEOUT:-300}" python3 -m megarl.trainer.main --config configs/grpo_tiny.yaml \
      trainer.device=cuda actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
      actor_rollout_ref.rollout.enforce_eager=true actor_rollout_ref.rollout.dtype=bfloat16 \
      actor_rollout_ref.actor.megatron.params_dtype=bfloat16 $QUANT_ARG \
      trainer.total_training_steps=${STEPS:-40} trainer.test_freq=10 trainer.save_freq=1000 trainer.progress_bar=false \
      trainer.default_local_dir=${GRPO_DIR}_$quant
    cp "${GRPO_DIR}_$quant/metrics.jsonl" "$OUT/fp8curve_$quant.jsonl" 2>/dev/null || echo "no metrics.jsonl ($quant)"
  done
elif [ "$MODE" = attn ]; then
  step logprob python3 -m bench.logprob_bench --batch 8 --seq 2048 --warmup 2 --iters 5 --out "$OUT/logprob_attn.json"
  step train python3 -m bench.train_throughput --models 0.5b,1.5b --prompt-len 1024 --response-len 3072 --rows 8 \
    --group-size 8 --warmup 1 --iters 2 --hf-attn sdpa --core-attention sdpa --profile --out "$OUT/train_attn.json"
  step sdpa_cuda_test timeout 100 python3 -m pytest tests/distributed/models/test_sdpa_attention.py -k cuda -q -s -p no:cacheprovider
else
  if [ "${RUN_PARITY:-0}" = 1 ]; then
    step parity python3 -m pytest tests/gpu -q -s -p no:cacheprovider
  fi
  step train python3 -m bench.train_throughput --models 0.5b,1.5b --prompt-len 1024 --response-len 3072 --rows 8 \
    --group-size 8 --warmup 1 --iters 2 --hf-attn sdpa,eager --profile --out "$OUT/train.json"
  # Same model, shorter rows, 4 rows per micro-batch: does throughput scale with work per launch?
  step train_mbs4 python3 -m bench.train_throughput --models 0.5b --prompt-len 512 --response-len 1536 --rows 16 \
    --group-size 8 --micro-batch-size 4 --warmup 1 --iters 2 --hf-attn sdpa --profile --out "$OUT/train_mbs4.json"
  step logprob python3 -m bench.logprob_bench --batch 8 --seq 2048 --warmup 2 --iters 5 --out "$OUT/logprob.json"
  step weight_sync python3 -m bench.weight_sync_bench --models 0.5b,1.5b --bucket-mb 64,512,2048 --iters 5 \
    --out "$OUT/weight_sync.json"
  step grpo python3 -m megarl.trainer.main --config configs/grpo_tiny.yaml trainer.backend=inprocess \
    trainer.device=cuda trainer.total_training_steps=20 trainer.default_local_dir=$GRPO_DIR
fi
[ "$MODE" = attn ] || [ "$MODE" = pack ] || [ "$MODE" = e2e ] || [ "$MODE" = big ] || [ "$MODE" = moe ] || [ "$MODE" = gen ] || [ "$MODE" = fp8curve ] || [ "$MODE" = vl ] || cp "$GRPO_DIR/metrics.jsonl" "$OUT/grpo_metrics_$MODE.jsonl" 2>/dev/null || echo "no GRPO metrics.jsonl" | tee -a "$LOG"
echo "=== summary ($MODE)"; printf "%s" "$SUMMARY" | tee -a "$LOG"
