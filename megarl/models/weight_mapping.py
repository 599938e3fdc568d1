"""Tensor-level rules for moving one parameter between Hugging Face and megatron-core layouts.

A :class:`ParamRule` says, for one GLOBAL megatron parameter name (layer index global across pipeline
stages, expert index global across expert-parallel ranks), which HF tensors it is made of, how they are
fused (``copy``, ``qkv``, ``gate_up``, ``vocab``) and how the FULL tensor (what a TP=1 model holds) is
split across tensor-parallel ranks (``replicated``, ``column``, ``row``, ``vocab``, ``gate_up``).

The functions here are pure tensor reshuffles (bit exact, no arithmetic). They leave out naming
(which rules exist for an architecture: :mod:`megarl.models.architectures`) and I/O
(:mod:`megarl.models.hf_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

FUSIONS = ("copy", "qkv", "gate_up", "vocab")
TP_KINDS = ("replicated", "column", "row", "vocab", "gate_up")


@dataclass(frozen=True)
class QKVShape:
    """Attention geometry needed to (un)interleave megatron's fused linear_qkv."""

    num_heads: int
    num_query_groups: int
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


@dataclass(frozen=True)
class ParamRule:
    mcore_name: str
    hf_names: tuple[str, ...]
    fusion: str = "copy"
    tp_kind: str = "replicated"
    is_expert: bool = False
    qkv: Optional[QKVShape] = None
    vocab_size: Optional[int] = None  # unpadded (HF) rows, for fusion == "vocab"

    def __post_init__(self):
        if self.fusion not in FUSIONS:
            raise ValueError(f"{self.mcore_name}: unknown fusion {self.fusion!r}; expected one of {FUSIONS}")
        if self.tp_kind not in TP_KINDS:
            raise ValueError(f"{self.mcore_name}: unknown tp_kind {self.tp_kind!r}; expected one of {TP_KINDS}")
        if self.fusion == "qkv" and (self.qkv is None or len(self.hf_names) != 3):
            raise ValueError(f"{self.mcore_name}: qkv fusion needs a QKVShape and three HF names (q, k, v)")
        if self.fusion == "gate_up" and len(self.hf_names) != 2:
            raise ValueError(f"{self.mcore_name}: gate_up fusion needs two HF names (gate, up)")

    @property
    def tp_partition_dim(self) -> Optional[int]:
        return {"replicated": None, "column": 0, "row": 1, "vocab": 0, "gate_up": 0}[self.tp_kind]


@dataclass(frozen=True)
class RowRun:
    """``rows`` consecutive rows (first-dim slices) of an HF tensor that are consecutive in the megatron one."""

    hf_name: str
    src_row: int
    dst_row: int
    rows: int


@dataclass(frozen=True)
class TensorConverter:
    """Every tensor move of a set of parameters: made from HF tensors, split over TP ranks, and back.

    What a conversion worker needs of a model and no more: plain data that pickles small and imports
    neither transformers nor megatron, so a worker process starts in an interpreter plus torch's import.
    The bridge holds one for the whole model and delegates to it."""

    rules: Mapping[str, ParamRule]  # global megatron name -> rule
    vocab_size: int  # unpadded (HF) vocabulary rows
    make_vocab_size_divisible_by: int = 128

    def rule(self, global_name: str) -> ParamRule:
        try:
            return self.rules[global_name]
        except KeyError:
            raise KeyError(f"{global_name!r} is not one of the {len(self.rules)} parameters this converter "
                           f"knows") from None

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def hf_to_mcore(self, global_name: str, hf_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        rule = self.rule(global_name)
        missing = [n for n in rule.hf_names if n not in hf_tensors]
        if missing:
            raise KeyError(f"{global_name} needs HF tensors {missing}")
        parts = [hf_tensors[n] for n in rule.hf_names]
        if rule.fusion == "qkv":
            return fuse_qkv(*parts, rule.qkv)
        if rule.fusion == "gate_up":
            if parts[0].shape != parts[1].shape:
                raise ValueError(f"{global_name}: gate {tuple(parts[0].shape)} and up {tuple(parts[1].shape)} differ")
            return torch.cat(parts, dim=0)
        if rule.fusion == "vocab":
            if parts[0].shape[0] != rule.vocab_size:
                raise ValueError(f"{rule.hf_names[0]} has {parts[0].shape[0]} rows, config vocab_size is "
                                 f"{rule.vocab_size}")
            return pad_vocab(parts[0], self.padded_vocab_size(1))
        return parts[0]

    def row_runs(self, global_name: str, hf_rows: Mapping[str, int]) -> list[RowRun]:
        """:meth:`hf_to_mcore` as row copies: runs that fill the megatron tensor (TP=1) from its HF tensors,
        whose first dimensions are ``hf_rows``; rows no run covers (the vocabulary's padding) are zeros. Every
        fusion is a reordering of whole rows, so a reader can put each HF row where it belongs as it reads,
        without building the HF tensors first."""
        rule = self.rule(global_name)
        names = rule.hf_names
        if rule.fusion == "qkv":
            groups, head_dim, per_group = rule.qkv.num_query_groups, rule.qkv.head_dim, rule.qkv.heads_per_group
            q_rows, group_rows = per_group * head_dim, (per_group + 2) * head_dim
            runs = []
            for g in range(groups):
                runs += [RowRun(names[0], g * q_rows, g * group_rows, q_rows),
                         RowRun(names[1], g * head_dim, g * group_rows + q_rows, head_dim),
                         RowRun(names[2], g * head_dim, g * group_rows + q_rows + head_dim, head_dim)]
            return runs
        if rule.fusion == "gate_up":
            rows = hf_rows[names[0]]
            return [RowRun(names[0], 0, 0, rows), RowRun(names[1], 0, rows, hf_rows[names[1]])]
        return [RowRun(names[0], 0, 0, hf_rows[names[0]])]  # copy, and vocab (its padding rows stay zero)

    def mcore_to_hf(self, global_name: str, full_tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        rule = self.rule(global_name)
        if rule.fusion == "qkv":
            return list(zip(rule.hf_names, split_qkv(full_tensor, rule.qkv)))
        if rule.fusion == "gate_up":
            gate, up = torch.chunk(full_tensor, 2, dim=0)
            return [(rule.hf_names[0], gate.contiguous()), (rule.hf_names[1], up.contiguous())]
        if rule.fusion == "vocab":
            return [(rule.hf_names[0], full_tensor[: rule.vocab_size].contiguous())]
        return [(rule.hf_names[0], full_tensor)]

    def shard_tp(self, global_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        return shard_tensor(self.rule(global_name), full, tp_rank, tp_size, padded_rows=self.padded_vocab_size(tp_size))

    def merge_tp(self, global_name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        return merge_shards(self.rule(global_name), shards, full_rows=self.padded_vocab_size(1))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: QKVShape) -> torch.Tensor:
    """[q; k; v] (HF) -> megatron's per-query-group interleave [q_g0 k_g0 v_g0 q_g1 k_g1 v_g1 ...].

    Works for weights ([out, hidden]) and biases ([out]); the rows of one group are its
    ``heads_per_group`` query heads, then its key head, then its value head.
    """
    ng, hd, hpg = shape.num_query_groups, shape.head_dim, shape.heads_per_group
    tail = q.shape[1:]
    _expect_rows(q, shape.num_heads * hd, "q")
    _expect_rows(k, ng * hd, "k")
    _expect_rows(v, ng * hd, "v")
    fused = torch.cat(
        [q.reshape(ng, hpg * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)], dim=1
    )
    return fused.reshape(ng * (hpg + 2) * hd, *tail)


def split_qkv(fused: torch.Tensor, shape: QKVShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd, hpg = shape.num_query_groups, shape.head_dim, shape.heads_per_group
    tail = fused.shape[1:]
    _expect_rows(fused, ng * (hpg + 2) * hd, "linear_qkv")
    grouped = fused.reshape(ng, (hpg + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows (megatron pads the vocabulary so that it splits evenly over TP ranks)."""
    if weight.shape[0] > padded_rows:
        raise ValueError(f"cannot pad {weight.shape[0]} vocabulary rows down to {padded_rows}")
    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros(padded_rows - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def shard_tensor(rule: ParamRule, full: torch.Tensor, tp_rank: int, tp_size: int,
                 padded_rows: Optional[int] = None) -> torch.Tensor:
    """This TP rank's piece of ``full``; ``padded_rows`` is the vocab padding for ``tp_size`` (vocab only)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    if rule.tp_kind == "replicated" or tp_size == 1 and rule.tp_kind != "vocab":
        return full
    if rule.tp_kind == "vocab":
        full = pad_vocab(full, padded_rows if padded_rows is not None else full.shape[0])
    if rule.tp_kind == "gate_up":
        gate, up = _halves(rule, full)
        return torch.cat([_chunk(rule, gate, 0, tp_rank, tp_size), _chunk(rule, up, 0, tp_rank, tp_size)], dim=0)
    return _chunk(rule, full, rule.tp_partition_dim, tp_rank, tp_size)


def merge_shards(rule: ParamRule, shards: Sequence[torch.Tensor], full_rows: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over all ranks; ``full_rows`` trims TP-only vocab padding."""
    if rule.tp_kind == "replicated" or len(shards) == 1 and rule.tp_kind != "vocab":
        return shards[0]
    if rule.tp_kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves], 0), torch.cat([u for _, u in halves], 0)], dim=0)
    merged = torch.cat(list(shards), dim=rule.tp_partition_dim)
    if rule.tp_kind == "vocab" and full_rows is not None:
        merged = merged[:full_rows]
    return merged


def _halves(rule: ParamRule, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if full.shape[0] % 2:
        raise ValueError(f"{rule.mcore_name}: gated linear_fc1 has an odd number of rows {full.shape[0]}")
    gate, up = torch.chunk(full, 2, dim=0)
    return gate, up


def _chunk(rule: ParamRule, tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if tensor.shape[dim] % size:
        raise ValueError(f"{rule.mcore_name}: dim {dim} of size {tensor.shape[dim]} does not split over {size} ranks")
    return torch.chunk(tensor, size, dim=dim)[rank].contiguous()


def _expect_rows(tensor: torch.Tensor, rows: int, what: str) -> None:
    if tensor.shape[0] != rows:
        raise ValueError(f"{what} has {tensor.shape[0]} rows, expected {rows} (shape {tuple(tensor.shape)})")
