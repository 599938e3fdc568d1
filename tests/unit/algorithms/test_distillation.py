"""On-policy distillation's loss against references written from its definition (fp64, per token): the clamped
single-sample KL estimate, as a supervised loss or as the negated advantage of PPO-clip, in every aggregation
mode, with its gradient; the settings verl refuses are refused."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import LOSS_AGG_MODES
from megarl.algorithms.distillation import DistillationSpec, distillation_loss
from tests.numerics import aggregate_by_loops


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 5])[:, None]).double()
    student = -3 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    student[0, 0] = -14.0  # below log_prob_min_clamp: the clamp acts
    teacher = student + torch.randn(4, 6, generator=g, dtype=torch.float64)
    teacher[2, 1] = -30.0  # a k3 estimate past loss_max_clamp
    old = student + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    return student, teacher, old, mask


def _estimate(s: float, t: float, mode: str, spec: DistillationSpec) -> float:
    s, t = max(s, spec.log_prob_min_clamp), max(t, spec.log_prob_min_clamp)
    d = s - t
    value = {"k1": d, "k2": 0.5 * d * d, "abs": abs(d),
             "k3": min(max(math.exp(-d) + d - 1, -10.0), 10.0)}[mode]
    return min(max(value, -spec.loss_max_clamp), spec.loss_max_clamp)


def _run(spec, mode, student, teacher, old, mask):
    lp = student.clone().requires_grad_(True)
    loss, metrics = distillation_loss(log_probs=lp, teacher_log_probs=teacher, old_log_probs=old, response_mask=mask,
                                      spec=spec, loss_agg_mode=mode, norm_length=mask.shape[1])
    loss.backward()
    return loss.detach(), metrics, lp.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("estimator", ["k3", "k2", "abs"])
def test_supervised_distillation_is_the_clamped_estimate(estimator, mode):
    student, teacher, old, mask = _batch()
    spec = DistillationSpec(loss_mode=estimator, use_policy_gradient=False, loss_max_clamp=5.0)
    loss, metrics, grad = _run(spec, mode, student, teacher, old, mask)
    tokens = [(i, t) for i in range(4) for t in range(6) if mask[i, t]]
    per = {(i, t): _estimate(student[i, t].item(), teacher[i, t].item(), estimator, spec) for i, t in tokens}
    assert loss.item() == pytest.approx(aggregate_by_loops(per, mask, mode, mask.shape[1]), rel=1e-12)
    assert metrics["distillation/abs_loss"] == pytest.approx(sum(abs(v) for v in per.values()) / len(tokens))
    # the gradient by central differences of the reference (no clamp boundary is this close to any point)
    h = 1e-6
    for i, t in tokens[:8]:
        up, down = dict(per), dict(per)
        up[(i, t)] = _estimate(student[i, t].item() + h, teacher[i, t].item(), estimator, spec)
        down[(i, t)] = _estimate(student[i, t].item() - h, teacher[i, t].item(), estimator, spec)
        width = mask.shape[1]
        numeric = (aggregate_by_loops(up, mask, mode, width) - aggregate_by_loops(down, mask, mode, width)) / (2 * h)
        assert grad[i, t].item() == pytest.approx(numeric, rel=1e-5, abs=1e-8), (i, t)
    assert grad[0, 0] == 0  # below the log-prob clamp: no gradient
    assert (grad[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_gradient_distillation_is_ppo_clip_on_the_negated_estimate(mode):
    from megarl.algorithms import compute_ppo_clip_loss

    student, teacher, old, mask = _batch(1)
    spec = DistillationSpec(loss_mode="k1", use_policy_gradient=True, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics, grad = _run(spec, mode, student, teacher, old, mask)
    per = torch.zeros_like(student)
    for i in range(4):
        for t in range(6):
            if mask[i, t]:
                per[i, t] = _estimate(student[i, t].item(), teacher[i, t].item(), "k1", spec)
    lp = student.clone().requires_grad_(True)
    want, _ = compute_ppo_clip_loss(log_probs=lp, old_log_probs=old, advantages=-per, response_mask=mask,
                                    clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode,
                                    norm_length=mask.shape[1])
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-12, atol=1e-14)
    assert "distillation/pg_clipfrac" in metrics


def test_settings_verl_refuses_are_refused():
    with pytest.raises(ValueError, match="gradient of k1 does not depend on the teacher"):
        DistillationSpec(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="forward_kl_topk"):
        DistillationSpec(loss_mode="forward_kl_topk")
    assert DistillationSpec(use_task_rewards=False, distillation_loss_coef=0.1).weight == 1.0  # alone: weight 1
    assert DistillationSpec(use_task_rewards=True, distillation_loss_coef=0.1).weight == 0.1
