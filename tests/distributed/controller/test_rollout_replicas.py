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
