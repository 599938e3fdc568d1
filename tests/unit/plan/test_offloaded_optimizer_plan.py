"""The planner with megatron's CPU-offloaded optimizer, against the 7B run measured on one H100 80GB, and the
start-up check built on it (megarl.trainer.memory_check)."""

import json

import pytest

from bench.shapes import qwen2_config
from megarl.config import ConfigError
from megarl.plan.from_config import specs_from_run_config
from megarl.plan.memory import GIB, plan_layout
from megarl.run_config import load_config
from megarl.trainer.memory_check import memory_plan_errors
from tests.paths import REPO
from tests.unit.plan.measured_runs import H100_GIB, assert_phases_within

MEASURED = REPO / "docs" / "device_results" / "e2e_grpo_7b_h100_2026-12-07.json"
A = "actor_rollout_ref.actor"
# bench/run_device.sh big on the H100 (docs/benchmarks.md, "7B on one GPU"), as run-config overrides
RUN_7B = [
    "data.max_prompt_length=256", "data.max_response_length=512", "data.train_batch_size=16",
    f"{A}.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.model.use_sequence_packing=true",
    f"{A}.ppo_max_token_len_per_gpu=4096", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
    f"{A}.megatron.params_dtype=bfloat16",
    f"{A}.megatron.recompute_granularity=full", f"{A}.megatron.grad_offload=true",
    f"{A}.megatron.use_distributed_optimizer=true", f"{A}.megatron.override_ddp_config.grad_reduce_in_fp32=false",
    f"{A}.optim.override_optimizer_config.optimizer_cpu_offload=true",
    f"{A}.optim.override_optimizer_config.optimizer_offload_fraction=0.75",
    f"{A}.optim.override_optimizer_config.use_precision_aware_optimizer=true",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.42", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.dtype=bfloat16", "trainer.device=cuda",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_7b_shape")
    (path / "config.json").write_text(json.dumps(qwen2_config("7b")))
    return path


def _config(model_dir, *extra):
    return load_config(REPO / "configs" / "grpo_tiny.yaml", [f"actor_rollout_ref.model.path={model_dir}", *RUN_7B, *extra])


def test_per_phase_peaks_within_10_percent_of_the_7b_run(model_dir):
    hf_config, layout, training = specs_from_run_config(_config(model_dir))
    assert layout.optimizer_cpu_offload and layout.optimizer_offload_fraction == 0.75 and training.grad_bytes == 2
    report = plan_layout(hf_config, layout, training, H100_GIB)
    assert_phases_within(report, MEASURED, 0.10)
    # the update's peak is the optimizer step's: foreach Adam's fp32 temporary for the GPU's 25% of the parameters
    # outgrows the activations and logits it follows
    train = next(p for p in report.phases if p.phase == "actor train").components
    assert sum(train[k] for k in ("actor activations", "actor logits + log-prob buffers",
                                  "optimizer step's fp32 temporary beyond the activations")) == pytest.approx(
        4 * 0.25 * report.params.total, rel=1e-6)
    # the host's share of Adam (fp32 master + m + v + pinned fp32 grads) for 75% of 7.62B parameters
    host_optimizer = next(v for k, v in report.host.items() if k.startswith("actor optimizer on the host"))
    assert host_optimizer / GIB == pytest.approx(0.75 * 7.615e9 * 16 / GIB, rel=0.01)


def test_the_gpu_share_of_the_optimizer_is_what_moves_between_the_device_and_the_host(model_dir):
    hf_config, layout, training = specs_from_run_config(_config(model_dir))
    from dataclasses import replace

    on_device = plan_layout(hf_config, replace(layout, optimizer_cpu_offload=False), training, H100_GIB)
    all_on_host = plan_layout(hf_config, replace(layout, optimizer_offload_fraction=1.0), training, H100_GIB)
    assert not on_device.fits and "actor train needs" in " ".join(on_device.errors)  # 7B Adam on an 80 GB card
    assert all_on_host.fits and all_on_host.host_total > on_device.host_total


def test_start_up_refuses_what_does_not_fit_naming_the_knob(model_dir):
    assert memory_plan_errors(_config(model_dir), gpu_memory_gib=H100_GIB, host_memory_gib=125) == []
    # the whole optimizer on the host, params parked there while generating: over 125 GiB of host memory
    errors = memory_plan_errors(_config(model_dir, f"{A}.optim.override_optimizer_config.optimizer_offload_fraction=1.0",
                                        f"{A}.megatron.param_offload=true"),
                                gpu_memory_gib=H100_GIB, host_memory_gib=125)
    assert len(errors) == 1 and errors[0].startswith("host memory:") and "optimizer_offload_fraction" in errors[0]
    # no optimizer offload on an 80 GB card: the update phase is over, by how much, with its largest parts
    errors = memory_plan_errors(_config(model_dir, f"{A}.optim.override_optimizer_config.optimizer_cpu_offload=false"),
                                gpu_memory_gib=H100_GIB, host_memory_gib=125)
    assert any(e.startswith("actor train needs") and "over by" in e for e in errors), errors


def test_the_check_is_skipped_where_it_cannot_see_the_gpus(model_dir):
    from megarl.trainer.memory_check import check_memory_plan

    no_offload = f"{A}.optim.override_optimizer_config.optimizer_cpu_offload=false"
    check_memory_plan(_config(model_dir, no_offload, "trainer.device=cpu"))  # no GPU to plan for
    check_memory_plan(_config(model_dir, no_offload, "trainer.ray_address=auto"))  # the cluster's GPUs are elsewhere
    check_memory_plan(_config(model_dir, no_offload, "trainer.check_memory_plan=false"))
    with pytest.raises(ConfigError, match="trainer.device=cpu has no GPU"):
        _config(model_dir, "trainer.device=cpu")  # and a CPU run refuses megatron's CPU offload at load


def test_partial_recompute_reaches_the_plan_and_fits_the_7b_run_with_8_layers_kept_whole(model_dir):
    """What the next 7B run may try on the H100: full recompute of 20 of the 28 layers (megatron's "block")."""
    _, full, training = specs_from_run_config(_config(model_dir))
    _, block, _ = specs_from_run_config(_config(model_dir, f"{A}.megatron.recompute_method=block",
                                                f"{A}.megatron.recompute_num_layers=20"))
    assert (full.recompute_method, full.recompute_num_layers) == ("uniform", 1)
    assert (block.recompute_method, block.recompute_num_layers) == ("block", 20)
    peaks = {name: {p.phase: p.total / GIB for p in plan_layout(qwen2_config("7b"), layout, training, H100_GIB).phases}
             for name, layout in (("full", full), ("block", block))}
    assert peaks["full"]["actor train"] < peaks["block"]["actor train"] < H100_GIB - 2
