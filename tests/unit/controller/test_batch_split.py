"""split_batch / concat_batches on tensors, arrays, lists, dicts and (nested, frozen, init=False) dataclasses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megarl.controller.batch_split import BatchSplitError, concat_batches, count_batch_rows, split_batch


@dataclasses.dataclass
class Inner:
    mask: torch.Tensor
    ids: tuple


@dataclasses.dataclass(frozen=True)
class Outer:
    tokens: torch.Tensor
    rewards: np.ndarray
    prompts: list
    inner: Inner
    extras: dict
    step: int
    name: str | None = None
    rows: int = dataclasses.field(init=False, default=-1)


def make_outer(n: int) -> Outer:
    batch = Outer(tokens=torch.arange(n * 3).reshape(n, 3), rewards=np.arange(n, dtype=np.float32),
                  prompts=[f"p{i}" for i in range(n)], inner=Inner(mask=torch.arange(n) % 2 == 0, ids=tuple(range(n))),
                  extras={"old_logp": torch.linspace(0, 1, n)}, step=3, name="demo")
    object.__setattr__(batch, "rows", n)
    return batch


def test_split_gives_contiguous_row_blocks_and_copies_metadata():
    chunks = split_batch(make_outer(6), 3)
    assert len(chunks) == 3
    for index, chunk in enumerate(chunks):
        rows = list(range(2 * index, 2 * index + 2))
        assert chunk.tokens.tolist() == [[3 * r, 3 * r + 1, 3 * r + 2] for r in rows]
        assert chunk.rewards.tolist() == [float(r) for r in rows]
        assert chunk.prompts == [f"p{r}" for r in rows]
        assert chunk.inner.ids == tuple(rows) and chunk.inner.mask.tolist() == [r % 2 == 0 for r in rows]
        assert torch.allclose(chunk.extras["old_logp"], torch.linspace(0, 1, 6)[rows])
        assert (chunk.step, chunk.name, chunk.rows) == (3, "demo", 6)
        assert chunk.tokens.untyped_storage().size() == chunk.tokens.numel() * 8  # not a view of the parent


def test_concat_inverts_split():
    batch = make_outer(8)
    back = concat_batches(split_batch(batch, 4))
    assert isinstance(back, Outer) and isinstance(back.inner, Inner)
    assert torch.equal(back.tokens, batch.tokens) and np.array_equal(back.rewards, batch.rewards)
    assert back.prompts == batch.prompts and back.inner.ids == batch.inner.ids
    assert torch.equal(back.inner.mask, batch.inner.mask) and torch.equal(back.extras["old_logp"], batch.extras["old_logp"])
    assert (back.step, back.name, back.rows) == (3, "demo", 8)


def test_split_refuses_indivisible_and_inconsistent_batches():
    with pytest.raises(BatchSplitError, match="batch size 5 is not divisible into 2"):
        split_batch(make_outer(5), 2)
    bad = dataclasses.replace(make_outer(4), prompts=["only", "three", "here"])
    with pytest.raises(BatchSplitError, match=r"batch\.prompts=3"):
        split_batch(bad, 2)
    with pytest.raises(BatchSplitError, match=r"batch\[0\]: cannot split a value of type set"):
        count_batch_rows({0: {1, 2}})


def test_concat_names_the_field_that_cannot_be_joined():
    left, right = split_batch(make_outer(4), 2)
    with pytest.raises(BatchSplitError, match=r"batch\.step: scalar values differ"):
        concat_batches([left, dataclasses.replace(right, step=4)])
    with pytest.raises(BatchSplitError, match=r"batch\.tokens: cannot concatenate tensors of shapes"):
        concat_batches([left, dataclasses.replace(right, tokens=torch.zeros(2, 5))])
    with pytest.raises(BatchSplitError, match="different types"):
        concat_batches([torch.zeros(1), [0.0]])


def test_plain_tensor_and_list_round_trip():
    tensor = torch.randn(6, 2)
    assert torch.equal(concat_batches(split_batch(tensor, 2)), tensor)
    assert concat_batches(split_batch(list(range(6)), 3)) == list(range(6))
    assert split_batch(7, 2) == [7, 7]  # metadata only: copied
