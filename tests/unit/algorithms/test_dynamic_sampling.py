"""DAPO pieces: which groups dynamic sampling keeps, the first-N-groups cut, the overlong penalty, and
row-wise concatenation of batches."""

import pytest
import torch

from megarl.algorithms.dynamic_sampling import first_groups, overlong_penalty, rows_of_informative_groups
from megarl.batch import TrainBatch, concat_rows, select_rows


def test_only_groups_with_a_score_spread_are_kept_in_row_order():
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 1.0])
    assert rows_of_informative_groups(groups, scores) == [2, 3]
    assert rows_of_informative_groups(groups, scores + torch.tensor([0, 1e-3, 0, 0, 0, 0, 0])) == [0, 1, 2, 3]
    assert rows_of_informative_groups(groups, scores + torch.tensor([0, 1e-3, 0, 0, 0, 0, 0]), tolerance=1e-2) == [2, 3]
    with pytest.raises(ValueError, match="7 group ids for 3 scores"):
        rows_of_informative_groups(groups, scores[:3])


def test_first_groups_takes_whole_groups_in_order_of_appearance():
    assert first_groups(["x", "x", "y", "z", "y", "z"], 2) == [0, 1, 2, 4]
    assert first_groups(["x", "y"], 5) == [0, 1]


def test_overlong_penalty_is_zero_before_the_buffer_and_linear_inside_it():
    lengths = torch.tensor([0, 12, 13, 14, 16])
    got = overlong_penalty(lengths, max_response_length=16, buffer_length=4, penalty_factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ValueError, match="buffer_length must be in"):
        overlong_penalty(lengths, max_response_length=16, buffer_length=0, penalty_factor=1.0)


def test_concat_rows_inverts_a_row_split():
    batch = TrainBatch(prompt_ids=torch.arange(12).view(4, 3), prompt_mask=torch.ones(4, 3, dtype=torch.long),
                       response_ids=torch.arange(8).view(4, 2), response_mask=torch.ones(4, 2, dtype=torch.long),
                       group_ids=["a", "a", "b", "b"], data_sources=["s"] * 4, ground_truths=[1, 2, 3, 4])
    batch.old_log_probs = torch.randn(4, 2)
    parts = [select_rows(batch, [0, 1]), select_rows(batch, [2, 3])]
    joined = concat_rows(parts)
    for name in ("prompt_ids", "response_ids", "old_log_probs"):
        assert torch.equal(getattr(joined, name), getattr(batch, name))
    assert joined.group_ids == batch.group_ids and joined.ground_truths == batch.ground_truths
    assert joined.values is None
    parts[1].values = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="'values' is set in some batches"):
        concat_rows(parts)
