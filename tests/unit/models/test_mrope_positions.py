"""M-RoPE positions (megarl.models.vision_language.mrope_position_ids), worked by hand; transformers' agreement is
checked through whole-model logits in tests/distributed/models/test_vision_language.py."""

from __future__ import annotations

import pytest
import torch

from megarl.models.vision_language import batch_mrope_position_ids, image_slots, mrope_position_ids

I = 99  # the image token


def positions(ids, grids):
    return mrope_position_ids(ids, None if grids is None else torch.tensor(grids), image_token_id=I,
                              spatial_merge_size=2).tolist()


def test_text_counts_up_on_all_three_axes():
    assert positions([1, 2, 3], None) == [[0, 1, 2]] * 3


def test_an_image_sits_on_its_grid_and_the_text_after_it_resumes_past_its_largest_side():
    # grid 1 x 4 x 6 patches, merged 2 x 2: 2 rows x 3 columns of tokens, placed after the 2 text tokens
    got = positions([1, 2] + [I] * 6 + [3, 4], [[1, 4, 6]])
    assert got == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],   # temporal: one frame
                   [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],   # height: rows
                   [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]   # width: columns; then 2 + max(1, 2, 3) = 5


def test_two_images_back_to_back_and_one_first():
    got = positions([I, I] + [I] * 1 + [5], [[1, 2, 4], [1, 2, 2]])  # 1 x 2 tokens, then 1 x 1 right after
    assert got == [[0, 0, 2, 3], [0, 0, 2, 3], [0, 1, 2, 3]]


def test_a_padded_batch_places_each_rows_positions_on_its_real_tokens():
    ids = torch.tensor([[1, I, 2, 0], [0, 0, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    got = batch_mrope_position_ids(ids, mask, torch.tensor([[1, 2, 2]]), [1, 0], image_token_id=I,
                                   spatial_merge_size=2)
    assert got[:, 0].tolist() == [[0, 1, 2, 0]] * 3
    assert got[:, 1].tolist() == [[0, 0, 0, 1]] * 3


def test_image_tokens_past_the_images_are_text_there_and_in_the_slots():
    """A sampled image token (in a response) counts on like text and takes no image embedding."""
    ids = [1, I, 2, I, I]  # a 1-token image, then text, then two image tokens the policy sampled
    assert positions(ids, [[1, 2, 2]]) == [[0, 1, 2, 3, 4]] * 3
    assert positions([1, I], None) == [[0, 1]] * 3  # no images at all: every image token is text
    slots = image_slots(torch.tensor(ids), torch.tensor([[1, 2, 2]]), image_token_id=I, spatial_merge_size=2)
    assert slots.tolist() == [False, True, False, False, False]
    assert not image_slots(torch.tensor(ids), None, image_token_id=I, spatial_merge_size=2).any()


@pytest.mark.parametrize("ids,grids,message", [
    ([1, I, 2], [[1, 4, 4]], "token 1: image 1 has 1 placeholder tokens, its grid (1, 4, 4) merged by 2 needs 4"),
    ([1, 2], [[1, 2, 2]], "1 images in image_grid_thw, 0 runs of image tokens"),
])
def test_images_and_grids_that_disagree_are_refused_saying_where(ids, grids, message):
    with pytest.raises(ValueError) as error:
        positions(ids, grids)
    assert message in str(error.value)
