"""Run a megarl training job on an existing multi-node Ray cluster.

    python launch/multinode.py --config configs/qwen2_5_7b_gsm8k_grpo.yaml [--address HOST:PORT] [a.b.c=value ...]

Attaches to the cluster (``--address``, else ``trainer.ray_address``, else ``"auto"``), waits up to
``--wait-timeout-s`` for ``trainer.nnodes`` nodes with ``trainer.n_gpus_per_node`` GPUs (CPUs on a CPU run),
reserves one placement group per node the way the trainer's resource pools do and prints which rank lands on
which node, releases it, then hands the config to ``megarl.trainer.main.run``. ``--dry-run`` stops after the
placement (exit 0): a cheap check that a cluster is ready for a config.
Leaves out: starting Ray (``slurm/ray_cluster.sh`` or ``ray start`` by hand) and the training itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, so `megarl` imports from a clone

from cluster_wait import ClusterWaitError, list_alive_nodes, wait_for_nodes  # noqa: E402  (sibling module)


def resolve_device(requested: str, nodes) -> str:
    if requested != "auto":
        return requested
    return "cuda" if any(node.gpus > 0 for node in nodes) else "cpu"


def print_placement(cfg, device: str) -> str:
    """Reserve the trainer's shape (one STRICT_PACK group per node), print rank -> node, release it."""
    from megarl.controller.resource_pool import ResourcePool, format_table

    names = {node.node_id: node.name for node in list_alive_nodes()}
    pool = ResourcePool("launch_check", [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes, device=device,
                        ready_timeout_s=cfg.trainer.worker_timeout_s)
    try:
        rows = pool.placement_table()
    finally:
        pool.release()
    for row in rows:
        row["node"] = names.get(row["node_id"], "?")
        row["node_id"] = str(row["node_id"])[:12]
    text = format_table(rows)
    print(f"placement ({cfg.trainer.nnodes} nodes x {cfg.trainer.n_gpus_per_node} {device} processes):\n{text}",
          flush=True)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    parser.add_argument("--address", help="Ray address; default trainer.ray_address, else 'auto'")
    parser.add_argument("--wait-timeout-s", type=float, default=300.0, help="how long to wait for nodes to join")
    parser.add_argument("--dry-run", action="store_true", help="check the cluster and print placement, then exit")
    args = parser.parse_args(argv)

    from megarl.config import ConfigError
    from megarl.run_config import load_config
    from megarl.controller.ray_cluster import init_ray, shutdown_ray

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"multinode: {args.config}: {exc}", file=sys.stderr)
        return 2
    address = args.address or cfg.trainer.ray_address or "auto"
    init_ray(address=address)
    try:
        per_node = cfg.trainer.n_gpus_per_node
        nodes = list_alive_nodes()
        device = resolve_device(cfg.trainer.device, nodes)
        nodes = wait_for_nodes(cfg.trainer.nnodes, per_node, device, args.wait_timeout_s)
        print(f"multinode: attached to {address}; {len(nodes)} usable nodes: "
              + ", ".join(node.name for node in nodes), flush=True)
        print_placement(cfg, device)
    except ClusterWaitError as exc:
        print(f"multinode: {exc}", file=sys.stderr)
        return 1
    finally:
        # The trainer opens its own connection (with its runtime env); one driver connection at a time.
        shutdown_ray()
    if args.dry_run:
        print("multinode: dry run, not training", flush=True)
        return 0
    cfg.trainer.ray_address = address
    cfg.trainer.device = device
    from megarl.trainer.main import run

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
