"""The checks every production rollout engine makes of a weight sync before its tensors reach the model
(megarl/engines/rollout/weight_session.py): names and shapes against the checkpoint, a tied head's alias, nothing
twice, the whole model before the session closes."""

from __future__ import annotations

import pytest
import torch

from megarl.engines.rollout.weight_session import WeightUpdateSession

SHAPES = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,), "model.layers.0.mlp.up_proj.weight": (6, 4)}


def tensors(*names):
    return [(name, torch.zeros(SHAPES.get(name, SHAPES["model.embed_tokens.weight"]))) for name in names]


def test_a_whole_model_in_buckets_closes_the_session():
    session = WeightUpdateSession("Engine", SHAPES, tied=False)
    for bucket in (tensors("model.embed_tokens.weight"), tensors("model.norm.weight", "model.layers.0.mlp.up_proj.weight")):
        session.loaded(session.admit(bucket))
    session.check_complete()
    session.close()
    assert not session.open and not session.names


def test_what_the_checkpoint_does_not_have_is_refused_by_name():
    session = WeightUpdateSession("Engine", SHAPES, tied=False)
    with pytest.raises(KeyError, match="Engine.update_weights: unknown parameter name 'model.bogus'"):
        session.admit([("model.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.norm.weight': got \(5,\), checkpoint has \(4,\)"):
        session.admit([("model.norm.weight", torch.zeros(5))])
    assert not session.open  # a refused bucket opens nothing


def test_nothing_twice_in_one_session_and_nothing_missing_at_its_end():
    session = WeightUpdateSession("Engine", SHAPES, tied=False)
    with pytest.raises(ValueError, match="'model.norm.weight' sent twice"):
        session.admit(tensors("model.norm.weight", "model.norm.weight"))
    session.loaded(session.admit(tensors("model.norm.weight")))
    with pytest.raises(ValueError, match="sent twice"):
        session.admit(tensors("model.norm.weight"))
    with pytest.raises(RuntimeError, match=r"lacks 2 checkpoint tensors"):
        session.check_complete()
    with pytest.raises(RuntimeError, match="without a preceding update_weights"):
        WeightUpdateSession("Engine", SHAPES, tied=False).check_complete()


@pytest.mark.parametrize("order", [("lm_head.weight", "model.embed_tokens.weight"),
                                   ("model.embed_tokens.weight", "lm_head.weight")])
def test_a_tied_head_is_the_embeddings_alias_whichever_comes_first(order):
    session = WeightUpdateSession("Engine", SHAPES, tied=True)
    first = session.admit(tensors(order[0]))
    assert [name for name, _ in first] == ["model.embed_tokens.weight"]
    session.loaded(first)
    assert session.admit(tensors(order[1])) == []  # the second copy is dropped, not refused
    session.loaded(session.admit(tensors("model.norm.weight", "model.layers.0.mlp.up_proj.weight")))
    session.check_complete()
    untied = WeightUpdateSession("Engine", SHAPES, tied=False)
    with pytest.raises(KeyError, match="lm_head.weight"):
        untied.admit(tensors("lm_head.weight"))
