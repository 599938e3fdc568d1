"""When waiting for a cluster cannot help (launch/cluster_wait.py): a GPU run on a cluster without a single GPU fails
as soon as its nodes have joined, naming trainer.device; otherwise the wait goes on until the allocation has joined
(Slurm) or the deadline passes."""

import importlib.util
import sys

from tests.paths import REPO

_spec = importlib.util.spec_from_file_location("cluster_wait", REPO / "launch" / "cluster_wait.py")
cluster_wait = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cluster_wait", cluster_wait)  # dataclasses look the module up by name
_spec.loader.exec_module(sys.modules["cluster_wait"])
cluster_wait = sys.modules["cluster_wait"]
Node = cluster_wait.ClusterNode


def _nodes(*gpus):
    return [Node(node_id=f"id{i}", name=f"n{i}", ip=f"10.0.0.{i}", gpus=g, cpus=16.0) for i, g in enumerate(gpus)]


def test_a_gpu_run_on_a_gpu_less_cluster_fails_at_once():
    verdict = cluster_wait.hopeless(_nodes(0, 0), 2, 8, "cuda")
    assert verdict is not None and "no node of the cluster has a GPU" in verdict and "trainer.device=cpu" in verdict
    assert cluster_wait.hopeless(_nodes(0), 2, 8, "cuda") is None  # a GPU node may still join: wait
    assert cluster_wait.hopeless(_nodes(0, 0), 2, 8, "cpu") is None  # a CPU run: CPUs count


def test_too_few_usable_nodes_fail_once_the_allocation_joined_or_the_deadline_passed():
    nodes = _nodes(8, 4)  # the second node has too few GPUs for 8 per node
    assert cluster_wait.hopeless(nodes, 2, 8, "cuda") is None
    assert "with all 2 nodes of the allocation joined" in cluster_wait.hopeless(nodes, 2, 8, "cuda",
                                                                                 whole_allocation=True)
    assert "after 300 s" in cluster_wait.hopeless(nodes, 2, 8, "cuda", timed_out=True, timeout_s=300)
