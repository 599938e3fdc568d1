"""Dispatch planning, DP layout validation and method-spec lookup (pure Python; Ray is exercised elsewhere)."""

from __future__ import annotations

import pytest
import torch

from megarl.controller.dispatch import (
    Collect,
    Dispatch,
    DPInfo,
    DPLayout,
    MethodSpec,
    collect_results,
    lookup_method_spec,
    plan_dispatch,
    register,
)


class Worker:
    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT)
    def train(self, batch):
        return batch

    def plain(self):
        return 1


def tp2_pp2_dp2_infos() -> list[DPInfo]:
    # Megatron order tp-fastest, then dp, then pp: rank = pp * 4 + dp * 2 + tp; the last PP stage's TP rank 0 collects.
    infos = []
    for rank in range(8):
        pp, rest = divmod(rank, 4)
        dp, tp = divmod(rest, 2)
        infos.append(DPInfo(dp, 2, pp == 1 and tp == 0))
    return infos


def test_layout_from_tp_pp_infos():
    layout = DPLayout.from_infos(tp2_pp2_dp2_infos())
    assert layout.dp_ranks == (0, 0, 1, 1, 0, 0, 1, 1)
    assert layout.collect_ranks == (4, 6) and layout.dp_size == 2 and layout.world_size == 8


@pytest.mark.parametrize(
    "infos, message",
    [
        ([(0, 2, True), (1, 1, True)], "disagree on dp_size"),
        ([(0, 2, True), (0, 2, True)], "two collect ranks"),
        ([(0, 2, True), (1, 2, False)], "replica 1 has no collect rank"),
        ([(0, 2, True), (2, 2, True)], "outside"),
        ([(0, 2, True), (0, 2, False), (1, 2, True), (0, 2, False)], "replica 0 has 3 ranks"),
        ([(0, 1)], "expected \\(dp_rank, dp_size, is_collect_rank\\)"),
    ],
)
def test_layout_rejects_inconsistent_reports(infos, message):
    with pytest.raises(ValueError, match=message):
        DPLayout.from_infos(infos, group_name="g")


def test_dp_split_plan_gives_peers_the_same_chunk_object_and_broadcasts_scalars():
    layout = DPLayout.from_infos(tp2_pp2_dp2_infos())
    batch = torch.arange(8).reshape(4, 2)
    plan = plan_dispatch(Dispatch.DP_SPLIT, (batch,), {"lr": 0.1}, world_size=8, layout=layout)
    assert plan[0][0][0] is plan[1][0][0] is plan[4][0][0]  # dp replica 0 across TP and PP peers
    assert plan[0][0][0].tolist() == [[0, 1], [2, 3]] and plan[2][0][0].tolist() == [[4, 5], [6, 7]]
    assert {kwargs["lr"] for _, kwargs in plan} == {0.1}


def test_collect_modes():
    layout = DPLayout.from_infos(tp2_pp2_dp2_infos())
    results = [torch.tensor([rank]) for rank in range(8)]
    assert torch.equal(collect_results(Collect.DP_COLLECT, results, layout=layout), torch.tensor([4, 6]))
    assert collect_results(Collect.RANK0, results).item() == 0
    assert len(collect_results(Collect.ALL, results)) == 8
    with pytest.raises(ValueError, match="needs the DP layout"):
        collect_results(Collect.DP_COLLECT, results)


def test_all_to_all_plan_and_errors():
    plan = plan_dispatch(Dispatch.ALL_TO_ALL, ([1, 2],), {"k": ["a", "b"]}, world_size=2)
    assert plan == [((1,), {"k": "a"}), ((2,), {"k": "b"})]
    with pytest.raises(ValueError, match="argument 'k': ALL_TO_ALL needs a list with one entry per rank \\(2\\), got str"):
        plan_dispatch(Dispatch.ALL_TO_ALL, (), {"k": "ab"}, world_size=2, method_name="m")


def test_spec_lookup_order():
    assert lookup_method_spec(Worker, "train") == MethodSpec(Dispatch.DP_SPLIT, Collect.DP_COLLECT)
    assert lookup_method_spec(Worker, "plain") == MethodSpec(Dispatch.ONE_TO_ALL, Collect.ALL)
    override = {"plain": MethodSpec(Dispatch.ONE_TO_ALL, Collect.RANK0)}
    assert lookup_method_spec(Worker, "plain", override).collect is Collect.RANK0
    with pytest.raises(AttributeError, match="Worker has no method 'trian'.*'plain', 'train'"):
        lookup_method_spec(Worker, "trian")
    with pytest.raises(TypeError, match="Dispatch member"):
        register(dispatch="dp_split")  # type: ignore[arg-type]
