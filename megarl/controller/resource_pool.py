"""Resource pools: Ray placement groups that reserve one bundle per rank, one placement group per node.

`ResourcePool("actor_rollout", nodes=[8, 8], device="cuda")` reserves 2 nodes x 8 processes; each node is a
STRICT_PACK placement group (all its bundles on one machine), bundle = {"GPU": gpus_per_process,
"CPU": cpus_per_process} on CUDA and {"CPU": cpus_per_process} on CPU. Rank r is bundle r in node-major order.
Several worker groups may share a pool's bundles (colocation, see `WorkerGroup(bundle_share=...)`); the pool
keeps the shares claimed so far and refuses over-subscription. Separate placement = separate pools.

Before creating anything the pool checks the static cluster resources and raises `ResourcePoolError` naming what
is missing; if the groups still cannot be placed (resources held by someone else) it gives up after
`ready_timeout_s` instead of hanging. Leaves out: spawning workers (`worker_group.py`) and autoscaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from megarl.controller.ray_cluster import describe_cluster

_EPS = 1e-6


class ResourcePoolError(RuntimeError):
    """The cluster cannot hold the requested pool; the message says what is asked and what exists."""


@dataclass(frozen=True)
class RankSlot:
    """Where rank `rank` of a pool lives: bundle `bundle_index` of placement group `pool_node`."""

    rank: int
    pool_node: int
    bundle_index: int
    placement_group: PlacementGroup


def _per_process(device: str, cpus_per_process: float, gpus_per_process: float) -> dict[str, float]:
    bundle = {"CPU": float(cpus_per_process)}
    if device == "cuda":
        bundle["GPU"] = float(gpus_per_process)
    return bundle


def _format_resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(key, 0.0):g} {key}" for key in ("GPU", "CPU") if key in resources or key == "CPU")


def _describe_ask(pool_name: str, nodes: Sequence[int], per_process: dict[str, float]) -> str:
    if len(set(nodes)) == 1:
        shape = f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} x {nodes[0]} processes"
    else:
        shape = f"{len(nodes)} nodes with {list(nodes)} processes"
    return f"resource pool {pool_name!r} asks for {shape} ({_format_resources(per_process)} per process)"


def _describe_cluster(cluster: list[dict[str, Any]]) -> str:
    if not cluster:
        return "the cluster has no alive node"
    listing = "; ".join(f"{node['ip']} ({_format_resources(node['resources'])})" for node in cluster)
    return f"the cluster has {len(cluster)} alive node{'s' if len(cluster) > 1 else ''}: {listing}"


def check_cluster_resources(
    pool_name: str,
    nodes: Sequence[int],
    *,
    device: str,
    cpus_per_process: float,
    gpus_per_process: float,
    cluster: list[dict[str, Any]] | None = None,
) -> None:
    """Raise ResourcePoolError if the pool's per-node packs cannot fit the cluster's total node resources.

    Each pool node must fit entirely on one cluster node (STRICT_PACK); pool nodes are placed largest first,
    first fit. `cluster` is `describe_cluster()` output; it is injectable so the check runs without a cluster.
    This is a static check against totals: resources already held by other pools are caught later by the
    placement-group ready timeout.
    """
    cluster = describe_cluster() if cluster is None else cluster
    per_process = _per_process(device, cpus_per_process, gpus_per_process)
    ask = _describe_ask(pool_name, nodes, per_process)
    if device == "cuda" and not any(node["resources"].get("GPU", 0) > 0 for node in cluster):
        raise ResourcePoolError(f"{ask}, but {_describe_cluster(cluster)} (no GPUs); "
                                "use device='cpu' for a CPU run")
    remaining = [dict(node["resources"]) for node in cluster]
    order = sorted(range(len(nodes)), key=lambda index: -nodes[index])
    for index in order:
        need = {key: value * nodes[index] for key, value in per_process.items()}
        for free in remaining:
            if all(free.get(key, 0.0) + _EPS >= value for key, value in need.items()):
                for key, value in need.items():
                    free[key] -= value
                break
        else:
            raise ResourcePoolError(
                f"{ask}, but {_describe_cluster(cluster)}: pool node {index} ({nodes[index]} processes needing "
                f"{_format_resources(need)} on one machine) fits on no node left after placing the larger ones"
            )


class ResourcePool:
    """A set of placement groups (one per node) reserving one bundle per rank."""

    def __init__(
        self,
        name: str,
        nodes: Sequence[int],
        *,
        device: str = "cuda",
        cpus_per_process: float = 1.0,
        gpus_per_process: float = 1.0,
        ready_timeout_s: float = 60.0,
    ) -> None:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"resource pool {name!r}: device must be 'cuda' or 'cpu', got {device!r}")
        if not nodes or any(int(count) != count or count < 1 for count in nodes):
            raise ValueError(f"resource pool {name!r}: nodes must be a non-empty list of positive process "
                             f"counts per node, got {list(nodes)!r}")
        if cpus_per_process <= 0:
            raise ValueError(f"resource pool {name!r}: cpus_per_process must be > 0 (a Ray bundle cannot be "
                             f"empty), got {cpus_per_process}")
        if device == "cuda" and gpus_per_process <= 0:
            raise ValueError(f"resource pool {name!r}: gpus_per_process must be > 0 on cuda, got {gpus_per_process}")
        self.name = name
        self.nodes = [int(count) for count in nodes]
        self.device = device
        self.cpus_per_process = float(cpus_per_process)
        self.gpus_per_process = float(gpus_per_process) if device == "cuda" else 0.0
        self._claims: dict[str, float] = {}
        check_cluster_resources(name, self.nodes, device=device, cpus_per_process=self.cpus_per_process,
                                gpus_per_process=self.gpus_per_process)
        bundle = _per_process(device, self.cpus_per_process, self.gpus_per_process)
        self._placement_groups = [
            placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK",
                            name=f"megarl_{name}_node{index}")
            for index, count in enumerate(self.nodes)
        ]
        self._wait_ready(ready_timeout_s, bundle)
        self.slots = self._build_slots()

    def _build_slots(self) -> list[RankSlot]:
        slots = []
        for node_index, pg in enumerate(self._placement_groups):
            for local in range(self.nodes[node_index]):
                slots.append(RankSlot(rank=len(slots), pool_node=node_index, bundle_index=local, placement_group=pg))
        return slots

    def _wait_ready(self, timeout_s: float, bundle: dict[str, float]) -> None:
        refs = [pg.ready() for pg in self._placement_groups]
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if not_ready:
            missing = [index for index, ref in enumerate(refs) if ref in not_ready]
            available = ray.available_resources()
            self.release()
            ask = _describe_ask(self.name, self.nodes, bundle)
            raise ResourcePoolError(
                f"{ask}: pool nodes {missing} could not be placed within {timeout_s:g} s. The cluster has the "
                f"resources in total, so other pools or actors hold them; available now: "
                f"{_format_resources(available)}. Free them, colocate on an existing pool, or shrink this pool."
            )

    @property
    def world_size(self) -> int:
        return sum(self.nodes)

    @property
    def placement_groups(self) -> list[PlacementGroup]:
        return list(self._placement_groups)

    def claim_share(self, group_name: str, share: float) -> None:
        """Record that `group_name`'s actors take `share` of every bundle; refuse going above 1."""
        if not 0 < share <= 1:
            raise ValueError(f"worker group {group_name!r}: bundle_share must be in (0, 1], got {share}")
        if group_name in self._claims:
            raise ValueError(f"resource pool {self.name!r} already has a worker group named {group_name!r}")
        used = sum(self._claims.values())
        if used + share > 1 + _EPS:
            holders = ", ".join(f"{name}={value:g}" for name, value in self._claims.items())
            raise ResourcePoolError(
                f"resource pool {self.name!r}: worker group {group_name!r} asks for bundle_share={share:g} but "
                f"{used:g} of each bundle is already claimed ({holders}); colocated groups' shares must sum to <= 1"
            )
        self._claims[group_name] = share

    def release_share(self, group_name: str) -> None:
        self._claims.pop(group_name, None)

    def placement_table(self) -> list[dict[str, Any]]:
        """One row per rank: rank, pool_node, bundle, node_id, node_ip (where Ray placed the bundle)."""
        ip_of = {node["node_id"]: node["ip"] for node in describe_cluster()}
        rows = []
        for slot in self.slots:
            table = ray.util.placement_group_table(slot.placement_group)
            node_id = table["bundles_to_node_id"].get(slot.bundle_index)
            rows.append({"rank": slot.rank, "pool_node": slot.pool_node, "bundle": slot.bundle_index,
                         "node_id": node_id, "node_ip": ip_of.get(node_id, "?")})
        return rows

    def release(self) -> None:
        """Remove the placement groups (actors still on them are killed by Ray)."""
        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray shut down: nothing left to free
                pass
        self._placement_groups = []
        self._claims.clear()


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render placement rows (list of same-keyed dicts) as an aligned text table for launcher logs."""
    if not rows:
        return "(empty)"
    columns = list(rows[0])
    cells = [[str(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join(lines)
