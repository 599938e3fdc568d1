#!/usr/bin/env bash
# verl's GRPO (FSDP actor, vLLM rollout, one GPU) on the workload of bench/e2e_grpo.py, for the comparison in
# docs/benchmarks.md. Run on the GPU box after bench/e2e_grpo.py has written the model/tokenizer/prompts of
# $SHAPE (default 0.5b) under /tmp/megarl_e2e, with vLLM + Ray staged (../shared/device) and verl's wheels in
# $VERL_WHEELS (verl 0.9.1 and the pure-Python packages the box lacks; see docs/device_runs.md).
# Writes $OUT/verl_$SHAPE.log; the per-step timing_s/* and perf/throughput lines are verl's own console logger.
# The box has no flash-attn: verl's FSDP model then takes SDPA attention and no remove-padding (verl's
# unpadding helpers come from flash-attn), which costs verl some speed that flash-attn would give it back.
set -uo pipefail
SHAPE=${SHAPE:-0.5b}; WORK=/tmp/megarl_e2e/$SHAPE; OUT=${OUT:-/tmp}; VERL_WHEELS=${VERL_WHEELS:-.verl}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/verl_site "$VERL_WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/verl_site:$PYTHONPATH PYTHONUNBUFFERED=1
# verl reads the tokenizer from the model dir and applies a chat template: give it both (the template passes
# the prompt through unchanged, so verl sees the same tokens as megarl with data.apply_chat_template=false)
python3 - "$WORK" <<'PY'
import json, os, shutil, sys
import pyarrow as pa, pyarrow.parquet as pq
work = sys.argv[1]
model = f"{work}/verl_model"
os.makedirs(model, exist_ok=True)
for name in os.listdir(f"{work}/model"):
    target = f"{model}/{name}"
    if not os.path.exists(target):
        os.symlink(f"{work}/model/{name}", target)
for name in os.listdir(f"{work}/tok"):
    shutil.copy(f"{work}/tok/{name}", model)
config = json.load(open(f"{model}/tokenizer_config.json"))
config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
json.dump(config, open(f"{model}/tokenizer_config.json", "w"))
rows = pq.read_table(f"{work}/prompts.parquet").to_pylist()
for row in rows:
    row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    row["extra_info"] = {"index": 0}
pq.write_table(pa.Table.from_pylist(rows), f"{work}/verl_prompts.parquet")
PY
python3 -c "import verl; print('verl', verl.__version__)" || exit 1
timeout "${VERL_TIMEOUT:-480}" python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
  data.train_files="$WORK/verl_prompts.parquet" data.val_files="$WORK/verl_prompts.parquet" \
  data.train_batch_size="${PROMPTS:-64}" data.max_prompt_length=512 data.max_response_length="${RESPONSE_LEN:-1024}" \
  data.filter_overlong_prompts=false data.truncation=error \
  actor_rollout_ref.model.path="$WORK/verl_model" actor_rollout_ref.model.use_remove_padding=false \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size="${PROMPTS:-64}" \
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.fsdp_config.param_offload=false actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 ++actor_rollout_ref.rollout.ignore_eos=true \
  trainer.logger='["console"]' trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps="${STEPS:-4}" \
  trainer.save_freq=-1 trainer.test_freq=-1 trainer.val_before_train=false trainer.project_name=verl_baseline trainer.use_v1=false \
  trainer.experiment_name="$SHAPE" > "$OUT/verl_$SHAPE.log" 2>&1
rc=$?
echo "verl rc=$rc"
grep -E "step:|timing_s/(gen|old_log_prob|update_actor|update_weights|step)|perf/throughput" "$OUT/verl_$SHAPE.log" | tail -20
[ $rc = 0 ] || tail -40 "$OUT/verl_$SHAPE.log"
