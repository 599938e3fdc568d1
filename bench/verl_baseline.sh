#!/usr/bin/env bash
# verl's GRPO (FSDP actor, vLLM rollout, one GPU) on the workload of bench/e2e_grpo.py, for the comparison in
# docs/benchmarks.md. Run on the GPU box after bench/e2e_grpo.py has written the model/tokenizer/prompts of
# $SHAPE (default 0.5b) under /tmp/megarl_e2e, with vLLM + Ray staged (../shared/device) and verl's wheels in
# $VERL_WHEELS (verl 0.9.1 and the pure-Python packages the box lacks; see docs/device_runs.md).
# Writes $OUT/verl_$SHAPE.log; the per-step timing_s/* and perf/throughput lines are verl's own console logger.
# The box has no flash-attn: verl's FSDP model then takes SDPA attention and no remove-padding (verl's
# unpadding helpers come from flash-attn), which costs verl some speed that flash-attn would give it back.
# 7B on one GPU as verl's docs run it (FSDP parameter and optimizer offload, gradient checkpointing), on
# bench/run_device.sh big's workload (`e2e_grpo --shape 7b --prepare-only` first: verl reads weights from disk):
#   SHAPE=7b PROMPTS=16 PROMPT_LEN=256 RESPONSE_LEN=512 OFFLOAD=true UTIL=0.6 TRAIN_TOKENS=8192 bash bench/verl_baseline.sh
# On one H100 80 GB + 125 GB host verl cannot run the 7B full-parameter workload (2026-12-07: FSDP's optimizer
# step OOMs on the GPU, FSDP2's offload_policy OOMs the host; docs/benchmarks.md); on an H200 try it with
#   VERL_EXTRA="..." extra verl overrides (e.g. "actor_rollout_ref.actor.strategy=fsdp2
#   actor_rollout_ref.actor.fsdp_config.offload_policy=true"), TAG=_fsdp2 a suffix of the log's name.
# LORA_RANK=32 (LORA_ALPHA, default 64): verl's LoRA GRPO on all linear layers as its users get it (verl's
# actor_rollout_ref.model.lora.merge defaults to false: vLLM serves the adapter, the base is synced once), against
# bench/run_device.sh lora's runs; VERL_EXTRA="actor_rollout_ref.model.lora.merge=true" syncs merged weights.
# verl's served-adapter sync gathers the base on the host (fsdp_utils.collect_lora_params) and hands a tensor
# larger than its bucket to vLLM by CUDA IPC, which a host tensor cannot go through: at 7B the fp32 embedding
# (2.2 GB) is above the 2,048 MB default and vLLM's worker failed in verl's rebuild_ipc (IndexError, 2026-12-07).
# With LoRA the bucket is 4,096 MB, so every tensor is copied through it.
set -uo pipefail
SHAPE=${SHAPE:-0.5b}; WORK=/tmp/megarl_e2e/$SHAPE; OUT=${OUT:-/tmp}; VERL_WHEELS=${VERL_WHEELS:-.verl}
LOG="$OUT/verl_$SHAPE${TAG:-}.log"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/verl_site "$VERL_WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/verl_site:$PYTHONPATH PYTHONUNBUFFERED=1
# verl applies a chat template: give the tokenizer one that passes the prompt through unchanged, so verl sees the
# same tokens as megarl with data.apply_chat_template=false. The tokenizer gets its own folder
# (model.tokenizer_path): beside a config.json of model_type qwen2, transformers 5 builds its Qwen2 BPE
# tokenizer from the word vocabulary, which encodes every prompt to nothing.
python3 - "$WORK" <<'PY' || exit 1
import json, os, shutil, sys
import pyarrow as pa, pyarrow.parquet as pq
work = sys.argv[1]
tok_dir = f"{work}/verl_tok"
shutil.rmtree(tok_dir, ignore_errors=True)
shutil.copytree(f"{work}/tok", tok_dir)
config = json.load(open(f"{tok_dir}/tokenizer_config.json"))
config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# verl's agent loop picks its token builder by model_type; the Qwen one needs "\n" to be one token and an
# <|im_end|> token: name the eos id <|im_end|> (Qwen's own) and give "\n" the id of w1 (prompts never use it)
tok = json.load(open(f"{tok_dir}/tokenizer.json"))
vocab = tok["model"]["vocab"]
eos_id = vocab.pop("<eos>")
del vocab["w1"]
vocab["<|im_end|>"] = eos_id
vocab["\n"] = 1
tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<eos>"] + [
    dict(id=eos_id, content="<|im_end|>", single_word=False, lstrip=False, rstrip=False, normalized=False, special=True),
    dict(id=1, content="\n", single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)]
json.dump(tok, open(f"{tok_dir}/tokenizer.json", "w"))
config["eos_token"] = "<|im_end|>"
json.dump(config, open(f"{tok_dir}/tokenizer_config.json", "w"))
rows = pq.read_table(f"{work}/prompts.parquet").to_pylist()
for row in rows:
    row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    row["extra_info"] = {"index": 0}
pq.write_table(pa.Table.from_pylist(rows), f"{work}/verl_prompts.parquet")
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(tok_dir)
text = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False)
words = rows[0]["prompt"][0]["content"].split()
if tokenizer.encode(text, add_special_tokens=False) != [int(w[1:]) for w in words]:
    sys.exit(f"verl's tokenizer in {tok_dir} does not give the prompt's token ids: verl would see other prompts")
PY
python3 -c "import verl; print('verl', verl.__version__)" || exit 1
LORA_BUCKET=""
[ "${LORA_RANK:-0}" -gt 0 ] && LORA_BUCKET="actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096"
timeout "${VERL_TIMEOUT:-480}" python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
  data.train_files="$WORK/verl_prompts.parquet" data.val_files="$WORK/verl_prompts.parquet" \
  data.train_batch_size="${PROMPTS:-64}" data.max_prompt_length="${PROMPT_LEN:-512}" data.max_response_length="${RESPONSE_LEN:-1024}" \
  data.filter_overlong_prompts=false data.truncation=error \
  actor_rollout_ref.model.path="$WORK/model" actor_rollout_ref.model.tokenizer_path="$WORK/verl_tok" \
  actor_rollout_ref.model.use_remove_padding=false \
  actor_rollout_ref.model.enable_gradient_checkpointing="${GC:-true}" \
  actor_rollout_ref.model.lora_rank="${LORA_RANK:-0}" actor_rollout_ref.model.lora_alpha="${LORA_ALPHA:-64}" \
  actor_rollout_ref.model.target_modules=all-linear \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size="${PROMPTS:-64}" \
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${TRAIN_TOKENS:-16384}" \
  actor_rollout_ref.actor.use_kl_loss=false actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.fsdp_config.param_offload="${OFFLOAD:-false}" actor_rollout_ref.actor.fsdp_config.optimizer_offload="${OFFLOAD:-false}" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization="${UTIL:-0.5}" actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true \
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${LOGPROB_TOKENS:-32768}" ++actor_rollout_ref.rollout.ignore_eos=true \
  trainer.logger='["console"]' trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps="${STEPS:-4}" \
  trainer.save_freq=-1 trainer.test_freq=-1 trainer.val_before_train=false trainer.project_name=verl_baseline trainer.use_v1=false \
  trainer.experiment_name="$SHAPE" $LORA_BUCKET ${VERL_EXTRA:-} > "$LOG" 2>&1
rc=$?
echo "verl rc=$rc"
grep -E "step:|timing_s/(gen|old_log_prob|update_actor|update_weights|step)|perf/throughput" "$LOG" | tail -20
[ $rc = 0 ] || tail -40 "$LOG"
