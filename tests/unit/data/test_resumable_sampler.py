"""ResumableSampler / PromptLoader: per-epoch seeded shuffles, drop_last batches, exact resume after a restart."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from megarl.data.dataset import RLDataset
from megarl.data.sampler import PromptLoader, ResumableSampler
from megarl.data.synthetic import write_digits_dataset
from megarl.data.tokenizer import write_local_tokenizer


def _take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_epochs_are_permutations_with_drop_last():
    sampler = ResumableSampler(10, 3, seed=5)
    assert len(sampler) == 3
    epochs = [list(sampler) for _ in range(3)]
    for epoch in epochs:
        flat = [i for batch in epoch for i in batch]
        assert len(epoch) == 3 and all(len(b) == 3 for b in epoch)
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))  # one of 10 dropped, no repeats
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    # The order is a pure function of (seed, epoch): an independent generator gives the same first epoch.
    expected = np.random.default_rng([5, 0]).permutation(10)[:9].reshape(3, 3).tolist()
    assert epochs[0] == expected
    assert ResumableSampler(10, 3, seed=6).next_batch() != epochs[0][0]


def test_no_shuffle_is_in_order():
    assert list(ResumableSampler(7, 2, seed=0, shuffle=False)) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 4, 7, 9])
def test_resume_yields_exactly_the_remaining_batches(cut):
    reference = _take(ResumableSampler(11, 4, seed=3), 10)  # 2 batches per epoch, 5 epochs
    run = ResumableSampler(11, 4, seed=3)
    before = _take(run, cut)
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint stores
    resumed = ResumableSampler(11, 4, seed=3)
    resumed.load_state_dict(state)
    assert before + _take(resumed, 10 - cut) == reference


def test_resume_mid_epoch_with_for_loops():
    sampler = ResumableSampler(12, 3, seed=1)
    full = [list(sampler) for _ in range(3)]
    sampler = ResumableSampler(12, 3, seed=1)
    seen = []
    for batch in sampler:
        seen.append(batch)
        if len(seen) == 2:
            break  # the job dies after its second step of epoch 0
    resumed = ResumableSampler(12, 3, seed=1)
    resumed.load_state_dict(sampler.state_dict())
    seen += list(resumed)  # the rest of epoch 0
    seen += list(resumed)  # epoch 1
    seen += list(resumed)  # epoch 2
    assert seen == [b for epoch in full for b in epoch]


def test_mismatched_state_is_refused():
    state = ResumableSampler(10, 2, seed=0).state_dict()
    for kwargs, field in [(dict(num_items=11, batch_size=2, seed=0), "num_items"),
                          (dict(num_items=10, batch_size=5, seed=0), "batch_size"),
                          (dict(num_items=10, batch_size=2, seed=1), "seed")]:
        with pytest.raises(ValueError, match=f"{field}="):
            ResumableSampler(**kwargs).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer than one batch"):
        ResumableSampler(3, 4, seed=0)


def test_prompt_loader_resumes_collated_batches(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path / "tok"))
    train, _ = write_digits_dataset(tmp_path / "data", 20, 2, seed=0, op="add", num_digits=2)
    dataset = RLDataset(train, tokenizer, max_prompt_length=64)
    reference = PromptLoader(dataset, 6, seed=9)
    expected = [reference.next_batch() for _ in range(7)]
    loader = PromptLoader(dataset, 6, seed=9)
    got = [loader.next_batch() for _ in range(4)]
    resumed = PromptLoader(dataset, 6, seed=9)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    got += [resumed.next_batch() for _ in range(3)]
    assert [b.indices for b in got] == [b.indices for b in expected]
    assert [b.prompt_ids for b in got] == [b.prompt_ids for b in expected]
    assert [b.ground_truths for b in got] == [[dataset[i].ground_truth for i in b.indices] for b in expected]
    assert resumed.epoch == 2 and len(resumed) == 3
