"""Packed RoPE (``megarl.models.packed_rope``) against megatron's own ``thd`` path: bit-identical."""

from types import SimpleNamespace

import pytest
import torch

from megarl.models.packed_rope import _packed_rotary, token_positions


class _OneRankGroup:  # megatron's thd path asks its context-parallel group for size and rank only
    def size(self):
        return 1

    def rank(self):
        return 0


def _rope_inputs(lengths, heads=3, dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    t = torch.randn(sum(lengths), heads, dim, generator=generator).to(dtype)
    inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(sum(lengths) + 5, dtype=torch.float32), inverse)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [max_s, 1, 1, dim], as megatron makes them
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return t, freqs, cu


def test_token_positions_restart_at_every_sequence():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert token_positions(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_packed_rope_is_megatrons_thd_rope_bit_for_bit(dtype, interleaved, mscale):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=interleaved, multi_latent_attention=False,
                             context_parallel_size=1)
    t, freqs, cu = _rope_inputs([5, 1, 9, 4, 7], dtype=dtype)
    expected = apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, mscale=mscale, cp_group=_OneRankGroup())
    got = _packed_rotary(apply_rotary_pos_emb, t, freqs, config, cu_seqlens=cu, mscale=mscale,
                         cp_group=_OneRankGroup())
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    # positions running on across sequences (no restart) rotate every sequence after the first differently
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    running_on = _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[:len(t)], rotary_interleaved=interleaved,
                                            mscale=mscale).squeeze(1)
    assert torch.equal(got[:5], running_on[:5]) and not torch.equal(got[5:], running_on[5:])


def test_cases_it_does_not_own_go_to_megatron_unchanged():
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "megatron"

    t, freqs, cu = _rope_inputs([4, 4])
    plain = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False,
                            context_parallel_size=1)
    for config, cu_seqlens, f in [(plain, None, freqs), (SimpleNamespace(**{**vars(plain), "apply_rope_fusion": True}),
                                                          cu, freqs),
                                  (SimpleNamespace(**{**vars(plain), "context_parallel_size": 2}), cu, freqs),
                                  (SimpleNamespace(**{**vars(plain), "multi_latent_attention": True}), cu, freqs),
                                  (plain, cu, freqs[:8].expand(8, *freqs.shape[1:]))]:
        assert _packed_rotary(original, t, f, config, cu_seqlens=cu_seqlens) == "megatron"
    assert len(calls) == 5


def test_use_installs_once_and_restores_megatrons_function():
    from megatron.core.transformer import attention

    from megarl.models import packed_rope

    before = attention.apply_rotary_pos_emb
    try:
        packed_rope.use(False)
        original = attention.apply_rotary_pos_emb
        packed_rope.use()
        installed = attention.apply_rotary_pos_emb
        packed_rope.use()
        assert installed is attention.apply_rotary_pos_emb and installed is not original
        assert installed.__wrapped__ is original
        packed_rope.use(False)
        assert attention.apply_rotary_pos_emb is original
    finally:
        attention.apply_rotary_pos_emb = before
