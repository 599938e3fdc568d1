"""Wait until an existing Ray cluster has the nodes a run asks for, or fail with what is missing.

Used two ways: by ``slurm/ray_cluster.sh`` after it started ``ray start`` on every node
(``python launch/cluster_wait.py --address HOST:PORT --nodes 4 --per-node 8 --device cuda --timeout-s 300``),
and by ``launch/multinode.py`` before it places workers. A node counts when it is alive and has at least
``per_node`` GPUs (device cuda) or CPUs (device cpu). Node names come from the ``megarl_node:<name>``
resource that ``slurm/ray_cluster.sh`` gives every node (its Slurm hostname), else the node IP.
Leaves out: starting or stopping Ray (the Slurm scripts do that).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional

NODE_NAME_PREFIX = "megarl_node:"


class ClusterWaitError(RuntimeError):
    """The cluster did not reach the asked size in time; the message lists what is there."""


@dataclass(frozen=True)
class ClusterNode:
    node_id: str
    name: str
    ip: str
    gpus: float
    cpus: float


def list_alive_nodes() -> list[ClusterNode]:
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive", False):
            continue
        resources = node.get("Resources", {})
        names = [key[len(NODE_NAME_PREFIX):] for key in resources if key.startswith(NODE_NAME_PREFIX)]
        ip = node["NodeManagerAddress"]
        nodes.append(ClusterNode(node_id=node["NodeID"], name=names[0] if names else ip, ip=ip,
                                 gpus=resources.get("GPU", 0.0), cpus=resources.get("CPU", 0.0)))
    return sorted(nodes, key=lambda n: n.name)


def usable_nodes(nodes: list[ClusterNode], per_node: int, device: str) -> list[ClusterNode]:
    key = "gpus" if device == "cuda" else "cpus"
    return [node for node in nodes if getattr(node, key) >= per_node]


def describe_nodes(nodes: list[ClusterNode]) -> str:
    if not nodes:
        return "no alive node"
    return "; ".join(f"{n.name} ({n.ip}, {n.gpus:g} GPU, {n.cpus:g} CPU)" for n in nodes)


def wait_for_nodes(nnodes: int, per_node: int, device: str, timeout_s: float, poll_s: float = 1.0, *,
                   whole_allocation: bool = False) -> list[ClusterNode]:
    """Poll the connected cluster until ``nnodes`` usable nodes are alive; return them (sorted by name).

    ``whole_allocation``: the cluster is exactly the ``nnodes`` nodes a scheduler gave the job (Slurm), so once
    all of them have joined, too few usable ones will not change by waiting: fail then, not at the timeout
    (a job asking for more GPUs per node than the nodes have fails in seconds, not after 10 minutes)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = list_alive_nodes()
        usable = usable_nodes(nodes, per_node, device)
        if len(usable) >= nnodes:
            return usable
        verdict = hopeless(nodes, nnodes, per_node, device, whole_allocation=whole_allocation,
                           timed_out=time.monotonic() >= deadline, timeout_s=timeout_s)
        if verdict is not None:
            raise ClusterWaitError(verdict)
        time.sleep(poll_s)


def hopeless(nodes: list[ClusterNode], nnodes: int, per_node: int, device: str, *, whole_allocation: bool = False,
             timed_out: bool = False, timeout_s: float = 0.0) -> Optional[str]:
    """Why waiting longer cannot give ``nnodes`` usable nodes (the error to raise), or None to keep waiting.

    Hopeless: the deadline passed; a scheduler's allocation has fully joined with too few usable nodes; or a GPU
    run on a cluster whose ``nnodes`` (or more) nodes have joined without a single GPU between them (a GPU-less
    cluster, or Ray started without GPUs: nothing a further wait changes, so it fails now, not at the timeout)."""
    usable = usable_nodes(nodes, per_node, device)
    unit = "GPUs" if device == "cuda" else "CPUs"
    ask = f"the run asks for {nnodes} nodes x {per_node} {unit} (trainer.nnodes x trainer.n_gpus_per_node)"
    if device == "cuda" and len(nodes) >= nnodes and not any(node.gpus > 0 for node in nodes):
        return (f"{ask} but no node of the cluster has a GPU ({describe_nodes(nodes)}): start Ray on the GPU nodes "
                f"(ray start ... --num-gpus), or run on CPU with trainer.device=cpu")
    every_node_joined = whole_allocation and len(nodes) >= nnodes
    if not (every_node_joined or timed_out):
        return None
    when = f"with all {len(nodes)} nodes of the allocation joined" if every_node_joined else f"after {timeout_s:g} s"
    return (f"{ask} but {when} the cluster has {len(usable)} such node(s); alive nodes: {describe_nodes(nodes)}. "
            f"Check the per-node logs of the workers that did not join.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--per-node", type=int, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--whole-allocation", action="store_true",
                        help="the cluster is exactly the job's --nodes nodes: fail once all joined and too few fit")
    args = parser.parse_args(argv)
    import ray

    # The head may still be starting: retry the connection itself until the deadline.
    deadline = time.monotonic() + args.timeout_s
    while True:
        try:
            ray.init(address=args.address, include_dashboard=False, logging_level="ERROR")
            break
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() >= deadline:
                print(f"cluster_wait: cannot reach the Ray head at {args.address} within {args.timeout_s:g} s: {exc}",
                      file=sys.stderr)
                return 1
            time.sleep(2.0)
    try:
        nodes = wait_for_nodes(args.nodes, args.per_node, args.device, max(deadline - time.monotonic(), 1.0),
                               whole_allocation=args.whole_allocation)
    except ClusterWaitError as exc:
        print(f"cluster_wait: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"cluster_wait: {len(nodes)} nodes ready: {describe_nodes(nodes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
