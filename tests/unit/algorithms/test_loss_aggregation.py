"""aggregate_loss modes by hand, and micro-batches with global normalisers reproduce the full-batch gradient."""

import pytest
import torch

from megarl.algorithms import aggregate_loss, compute_ppo_clip_loss, masked_var, masked_whiten

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),
        ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 2),
        ("seq-mean-token-mean", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) + (4 + 5 + 6)) / (2 * 3)),
    ],
)
def test_modes_by_hand(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_norm_length_is_the_dr_grpo_constant():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(18 / 20)


def test_padding_values_do_not_matter():
    poisoned = LOSS.clone()
    poisoned[0, 2] = float("inf")
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate_loss(poisoned, MASK, mode).item() == aggregate_loss(LOSS, MASK, mode).item()


def test_bad_mode_and_empty_mask():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'.*token-mean"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="no valid tokens"):
        aggregate_loss(LOSS, torch.zeros_like(MASK), "token-mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_normaliser_equal_full_batch_gradient(mode):
    torch.manual_seed(0)
    batch, length = 6, 5
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    old_log_probs = -torch.rand(batch, length)
    advantages = torch.randn(batch, length)
    weights = torch.randn(batch, length)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)

    def grad_of(indices_list, global_counts):
        param = torch.zeros(batch, length, requires_grad=True)
        for idx in indices_list:
            # log-probs depend on a shared parameter, like a model would
            log_probs = old_log_probs[idx] + 0.3 * torch.tanh(param[idx] + weights[idx])
            counts = (
                dict(global_num_tokens=mask.sum().item(), global_num_seqs=batch, norm_length=length)
                if global_counts else {}
            )
            loss, _ = compute_ppo_clip_loss(log_probs=log_probs, old_log_probs=old_log_probs[idx],
                                            advantages=advantages[idx], response_mask=mask[idx], **kw, **counts)
            loss.backward()
        return param.grad.clone()

    full = grad_of([torch.arange(batch)], global_counts=False)
    # uneven micro-batches (2 "ranks" x 2 micro-batches): shares must add up to the full-batch gradient
    micro = [torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5])]
    torch.testing.assert_close(grad_of(micro, global_counts=True), full)
    if mode in ("token-mean", "seq-mean-token-mean"):
        # the local normaliser is NOT equivalent for uneven splits: this is why the global variant exists
        assert not torch.allclose(grad_of(micro, global_counts=False) / len(micro), full)


def test_masked_var_biased_and_unbiased_and_whiten():
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    data = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean = sum(data) / 5
    ss = sum((x - mean) ** 2 for x in data)
    assert masked_var(values, mask).item() == pytest.approx(ss / 4)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(ss / 5)
    w = masked_whiten(values, mask, eps=0.0)
    assert w[0, 2] == 0
    torch.testing.assert_close(w[mask.bool()], torch.tensor([(x - mean) / (ss / 4) ** 0.5 for x in data]))
    # one valid token: centred to 0 instead of NaN
    assert masked_whiten(torch.tensor([[7.0, 1.0]]), torch.tensor([[1.0, 0.0]])).abs().sum() == 0
