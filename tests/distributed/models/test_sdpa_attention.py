"""SDPA core attention (``core_attention="sdpa"``) equals megatron's local DotProductAttention.

Logits, the loss and every parameter gradient of one forward/backward on a left-padded batch (the
engines' mask: causal | padded keys) agree in fp32 between the two core attentions, at TP=1 and TP=2,
on two real gloo processes, for Qwen2 (GQA, qkv bias, tied embeddings) and DeepSeek-V3 (MLA, whose
query/key heads are wider than its value heads, plus MoE). The mask preparation is checked by hand.
The same comparison on the GPU is tests/gpu/test_sdpa_cuda.py.
"""

import pytest
import torch

from megarl.models.sdpa_attention import prepare_sdpa_mask
from megarl.models.tiny import save_tiny_hf_checkpoint
from tests.dist_harness import run_distributed
from tests.distributed.models.sdpa_workers import compare_core_attentions
from tests.numerics import FP32_REORDERED, assert_close_to_scale

ARCHS = ("qwen2", "deepseek_v3")
LAYOUTS = [("tp1", dict()), ("tp2", dict(tensor_parallel=2))]


def _megatron_mask(real: torch.Tensor) -> torch.Tensor:
    seq = real.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return causal[None, None] | ~real.bool()[:, None, None, :]


def test_causal_mask_is_recognised_and_padded_mask_keeps_the_diagonal():
    causal = _megatron_mask(torch.ones(2, 5, dtype=torch.long))
    assert prepare_sdpa_mask(causal) is None
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    padded = _megatron_mask(real)
    prepared = prepare_sdpa_mask(padded)
    expected = ~padded
    expected[0, 0, 0, 0] = expected[0, 0, 1, 1] = True  # padding queries attend to themselves only
    assert torch.equal(prepared, expected)
    assert prepare_sdpa_mask(padded) is prepared  # cached for the next layer
    padded[1, 0, 4, 3] = True  # an in-place edit bumps the version: no stale answer
    assert not prepare_sdpa_mask(padded)[1, 0, 4, 3]
    with pytest.raises(TypeError, match="bool"):
        prepare_sdpa_mask(padded.float())


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdpa_ckpts")
    hf_dirs = {arch: save_tiny_hf_checkpoint(arch, root / arch, seed=3) for arch in ARCHS}
    return run_distributed(compare_core_attentions, 2, LAYOUTS, hf_dirs, timeout_s=300)


def _assert_same(local, sdpa, what, *, relative=FP32_REORDERED):
    assert local["core_modules"] in ({"DotProductAttention"}, {"MLACompatibleDotProductAttention"}), \
        local["core_modules"]
    assert sdpa["core_modules"] == {"SDPADotProductAttention"}, sdpa["core_modules"]
    real = local["real"].bool()
    assert local["logits"][real].abs().max() > 0.1, "degenerate logits would prove nothing"
    # Real positions match; padding positions differ by design (documented) but must stay finite.
    assert_close_to_scale(sdpa["logits"][real], local["logits"][real], relative, f"{what} logits")
    assert torch.isfinite(sdpa["logits"]).all()
    assert_close_to_scale(sdpa["loss"], local["loss"], relative, f"{what} loss")
    assert local["grads"].keys() == sdpa["grads"].keys() and len(local["grads"]) > 10
    for name, grad in local["grads"].items():
        if grad.abs().max() == 0:
            assert "expert" in name or "router" in name, f"{name}: zero gradient"
            assert sdpa["grads"][name].abs().max() == 0, f"{what} grad {name}: zero in local, not in sdpa"
            continue
        assert_close_to_scale(sdpa["grads"][name], grad, relative, f"{what} grad {name}")
    assert "packed_seq_params.qkv_format 'sbhd'" in sdpa["packed_error"]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("label", [label for label, _ in LAYOUTS])
@pytest.mark.parametrize("arch", ARCHS)
def test_sdpa_logits_and_grads_equal_local_attention(per_rank, label, arch):
    for rank, results in enumerate(per_rank):
        _assert_same(results[(label, arch, "local")], results[(label, arch, "sdpa")], f"{label} {arch} rank {rank}")
