"""The planner with LoRA: the frozen base has no grads and no optimizer state, the reference is the base (no
second model), and the adapters' share is what rank x (in + out) per adapted linear says."""

from bench.shapes import qwen2_config
from megarl.models.model_dims import read_model_dims
from megarl.models.parallel_layout import ParallelLayout
from megarl.plan.layout import LayoutSpec, TrainingSpec
from megarl.plan.memory import GIB, lora_params_per_layer, plan_layout


def _plan(lora_rank: int):
    layout = LayoutSpec(world_size=1, parallel=ParallelLayout(), recompute="full", distributed_optimizer=True)
    training = TrainingSpec(global_batch_size=64, micro_batch_size=8, max_seq_len=768, use_reference=True,
                            offload_parts=(True, False, False), rollout_gpu_memory_utilization=0.55,
                            lora_rank=lora_rank)
    return plan_layout(qwen2_config("14b"), layout, training, gpu_memory_gib=79.2, host_memory_gib=126)


def test_lora_drops_grads_optimizer_and_reference():
    full, lora = _plan(0), _plan(32)
    train_full = next(p for p in full.phases if p.phase == "actor train").components
    train_lora = next(p for p in lora.phases if p.phase == "actor train").components
    grads = lambda c: next(v for k, v in c.items() if "grads" in k)  # noqa: E731
    optimizer = lambda c: next(v for k, v in c.items() if "optimizer" in k)  # noqa: E731
    dims = read_model_dims(qwen2_config("14b"))
    adapters = dims.num_layers * lora_params_per_layer(dims, 32, TrainingSpec.lora_targets)
    assert grads(train_lora) == 4 * adapters  # fp32 grads of the adapters alone
    assert optimizer(train_lora) < optimizer(train_full) / 100
    logprob = next(p for p in lora.phases if p.phase.startswith("log-prob")).components
    assert "reference params" not in logprob
    assert not full.fits and lora.fits  # 14B full-parameter does not fit an 80 GB card without offload; LoRA does
    assert adapters == 48 * 32 * ((5120 + 7168) + (5120 + 5120) + (5120 + 27648) + (13824 + 5120))
    assert next(p for p in lora.phases if p.phase == "actor train").total < 60 * GIB
