"""Resumable prompt sampling: seeded per-epoch shuffles, fixed-size batches, exact resume from a state dict.

`ResumableSampler` yields batches of dataset indices; `PromptLoader` turns them into collated `PromptBatch`es.
The order is a pure function of (seed, epoch), and the state is only (epoch, batches consumed), so a run that
is stopped, checkpointed and restarted sees exactly the batches an uninterrupted run would have seen.

Left out: sharding across data-parallel ranks (the single controller draws prompts, then dispatches them) and
drop_last=False (a short last batch would break the fixed rollout batch shape).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from megarl.data.dataset import PromptBatch, RLDataset

_STATE_VERSION = 1


class ResumableSampler:
    """Batches of `batch_size` indices in [0, num_items), reshuffled each epoch, last partial batch dropped.

    Iterating yields the remaining batches of the current epoch and then moves to the next epoch, so
    `for epoch in ...: for batch in sampler:` works, and so does `next_batch()` for step-driven loops.
    """

    def __init__(self, num_items: int, batch_size: int, *, seed: int, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_items < batch_size:
            raise ValueError(f"dataset has {num_items} prompts, fewer than one batch of {batch_size} (drop_last)")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.batches_done = 0  # batches of the current epoch already handed out

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index permutation of `epoch` (identity when shuffle is off)."""
        if not self.shuffle:
            return np.arange(self.num_items)
        # One generator per (seed, epoch): the order of epoch k never depends on how epochs < k were consumed.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_batch(self) -> list[int]:
        """The next batch, rolling over into the next epoch after the last full batch."""
        if self.batches_done >= self.batches_per_epoch:
            self.epoch += 1
            self.batches_done = 0
        start = self.batches_done * self.batch_size
        batch = self.epoch_order(self.epoch)[start : start + self.batch_size].tolist()
        # Advance before handing out: a state_dict taken after receiving a batch counts that batch as consumed.
        self.batches_done += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.batches_done >= self.batches_per_epoch:
            self.epoch += 1
            self.batches_done = 0
        epoch = self.epoch
        while self.epoch == epoch and self.batches_done < self.batches_per_epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The order-defining fields must match: resuming over a different dataset size,
        batch size, seed or shuffle setting would silently replay different prompts, so it raises instead."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} != {_STATE_VERSION}")
        for key in ("seed", "num_items", "batch_size", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}; "
                    "the resumed prompt order would differ"
                )
        if not 0 <= state["batches_done"] <= self.batches_per_epoch or state["epoch"] < 0:
            raise ValueError(f"sampler state out of range: epoch={state['epoch']}, batches_done={state['batches_done']}")
        self.epoch = state["epoch"]
        self.batches_done = state["batches_done"]


class PromptLoader:
    """Collated `PromptBatch`es from an `RLDataset` in `ResumableSampler` order; resumable the same way."""

    def __init__(self, dataset: RLDataset, batch_size: int, *, seed: int, shuffle: bool = True) -> None:
        self.dataset = dataset
        self.sampler = ResumableSampler(len(dataset), batch_size, seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def _collate(self, indices: list[int]) -> PromptBatch:
        return self.dataset.batch(indices)

    def next_batch(self) -> PromptBatch:
        return self._collate(self.sampler.next_batch())

    def __iter__(self) -> Iterator[PromptBatch]:
        for indices in self.sampler:
            yield self._collate(indices)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
