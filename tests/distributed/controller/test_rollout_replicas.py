"""Rollout replicas spanning ranks: the ranks of a replica generate their shares together (identical
requests on every rank, as vLLM's external launcher needs), and each gets back exactly its own share."""

import pytest

from tests.dist_harness import run_distributed


def _replica_worker(rank, model_dir):
    import torch.distributed as dist

    from megarl.controller.rollout_replicas import form_rollout_replicas, generate_in_replica
    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.hf_engine import HFRolloutEngine

    dist.init_process_group("gloo")
    replica = form_rollout_replicas(2)  # world of 4: replicas {0, 1} and {2, 3}
    engine = HFRolloutEngine(model_dir)
    shares = [[[5, 6, 7]], [[8, 9], [10, 11, 12]], [], [[13]]]
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=4, seed=11, logprobs=True)
    mine = generate_in_replica(engine, shares[rank], sampling, replica)
    # what the replica's ranks generated together, seen from this rank
    merged = [p for r in range(2 * replica.index, 2 * replica.index + 2) for p in shares[r]]
    together = generate_in_replica(engine, merged, sampling, type(replica)(replica.index, 1, None))
    return dict(replica=replica.index, mine=[(o.prompt_index, o.token_ids) for o in mine],
                together=[(o.prompt_index, o.token_ids) for o in together])


@pytest.mark.timeout(200)
def test_replica_ranks_generate_together_and_get_their_own_share_back(tmp_path):
    from megarl.models.embedded import ensure_embedded_model

    results = run_distributed(_replica_worker, 4, str(ensure_embedded_model()), timeout_s=180)
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    sizes = [1, 2, 0, 1]
    for rank, r in enumerate(results):
        offset = 0 if rank % 2 == 0 else sizes[rank - 1]
        expected = [(i - offset, ids) for i, ids in r["together"] if offset <= i < offset + sizes[rank]]
        assert r["mine"] == expected and len(r["mine"]) == 2 * sizes[rank]  # n = 2 samples per prompt


def _tensor_bytes(bucket):
    """The ranks' copies as bytes (SGLang's are CUDA IPC handles of the rank's own GPU: tests/gpu can't have two)."""
    import io

    import torch

    def saved(tensor):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return buffer.getvalue()

    return [(name, saved(tensor)) for name, tensor in bucket]


def _first_rank_engine(model_dir, visible):
    """The HF engine standing where SGLang's engine stands in a replica's first rank: it checks every rank sent
    the first rank's tensors, then loads those (SGLang's TP worker i would load rank i's copy)."""
    import io

    import torch

    from megarl.engines.rollout import sglang_compat
    from megarl.engines.rollout.hf_engine import HFRolloutEngine

    class FirstRankHFEngine(HFRolloutEngine):
        def update_weights_from_replica(self, named_tensors, payloads_by_rank):
            bucket = list(named_tensors)
            sglang_compat.check_replica_payloads([name for name, _ in bucket], payloads_by_rank)
            for payload in payloads_by_rank:
                for (name, tensor), (_, data) in zip(bucket, payload):
                    if not torch.equal(torch.load(io.BytesIO(data)), tensor):
                        raise ValueError(f"a rank's copy of {name} differs from the first rank's")
            self.update_weights(bucket)

    engine = FirstRankHFEngine(model_dir)
    engine.visible_devices = visible
    return engine


def _first_rank_replica_worker(rank, model_dir):
    import dataclasses

    import torch
    import torch.distributed as dist

    from megarl.controller.first_rank_replica import serve_from_first_rank
    from megarl.controller.rollout_replicas import form_rollout_replicas, generate_in_replica
    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.hf_engine import HFRolloutEngine

    dist.init_process_group("gloo")
    replica = form_rollout_replicas(2)  # world of 4: replicas {0, 1} and {2, 3}, each served by its first rank
    face = serve_from_first_rank(replica, lambda visible: _first_rank_engine(model_dir, visible), sleeps=False,
                                 serialize_bucket=_tensor_bytes, local_device_index=rank)
    shares = [[[5, 6, 7]], [[8, 9], [10, 11, 12]], [], [[13]]]
    merged = [p for r in range(2 * replica.index, 2 * replica.index + 2) for p in shares[r]]
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=4, logprobs=True)
    sampled = dataclasses.replace(greedy, n=2, temperature=1.0, seed=11)

    def mine_and_together(engine, sampling):
        mine = generate_in_replica(face, shares[rank], sampling, replica)
        together = generate_in_replica(engine, merged, sampling, type(replica)(replica.index, 1, None))
        return [(o.prompt_index, o.token_ids) for o in mine], [(o.prompt_index, o.token_ids) for o in together]

    reference = HFRolloutEngine(model_dir)  # this rank's own engine: what the replica must answer
    before = mine_and_together(reference, sampled)
    # every rank sends the same new weights from its own copy (the weight sync's full HF tensors per rank)
    new = [(name, param.detach() * 0.5 + 0.01) for name, param in reference.model.named_parameters()]
    face.update_weights(new[: len(new) // 2])
    face.update_weights(new[len(new) // 2:])
    face.finish_weight_update()
    reference.update_weights(new)
    reference.finish_weight_update()
    after = mine_and_together(reference, greedy)
    # what the first rank's engine raises, each rank raises
    try:
        generate_in_replica(face, [[10**6]] if rank % 2 else [], greedy, replica)
        failed = None
    except Exception as exc:  # noqa: BLE001 - the test reports it
        failed = f"{type(exc).__name__}: {exc}"
    # a rank whose bucket differs from its first rank's
    try:
        face.update_weights(new[:2] if rank % 2 else new[:3])
        mismatched = None
    except Exception as exc:  # noqa: BLE001
        mismatched = f"{type(exc).__name__}: {exc}"
    return dict(replica=replica.index, first=face.engine is not None,
                visible=getattr(face.engine, "visible_devices", None), before=before, after=after, failed=failed,
                mismatched=mismatched, changed=after[1] != _greedy_before_any_update(model_dir, merged, greedy))


def _greedy_before_any_update(model_dir, merged, greedy):
    from megarl.engines.rollout.hf_engine import HFRolloutEngine

    outputs = HFRolloutEngine(model_dir).generate(merged, greedy) if merged else []
    return [(o.prompt_index, o.token_ids) for o in outputs]


@pytest.mark.timeout(240)
def test_a_replica_served_by_its_first_rank_generates_syncs_and_fails_on_every_rank():
    from megarl.models.embedded import ensure_embedded_model

    results = run_distributed(_first_rank_replica_worker, 4, str(ensure_embedded_model()), timeout_s=220)
    assert [(r["replica"], r["first"]) for r in results] == [(0, True), (0, False), (1, True), (1, False)]
    assert results[0]["visible"] == ["0", "1"] and results[2]["visible"] == ["2", "3"]  # the replica's GPUs
    sizes = [1, 2, 0, 1]
    for rank, r in enumerate(results):
        offset = 0 if rank % 2 == 0 else sizes[rank - 1]
        for mine, together in (r["before"], r["after"]):  # sampled with seeds, then greedy after the update
            expected = [(i - offset, ids) for i, ids in together if offset <= i < offset + sizes[rank]]
            assert mine == expected, (rank, mine, expected)
        assert r["changed"] or sizes[rank] == 0  # the update reached the first rank's engine
        assert "10000" in r["failed"] and "prompt" in r["failed"], r["failed"]
        if rank % 2:  # a peer: the first rank's error, named
            assert r["failed"].startswith("RuntimeError: rollout replica") and "first rank" in r["failed"]
        assert "another bucket than its first rank" in r["mismatched"], r["mismatched"]
