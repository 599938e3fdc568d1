"""Separate-placement weight transports: broadcast over a weight group vs Ray's object store.

The driver plays training rank 0 and sends ``--total-mb`` of bf16 tensors in ``--bucket-mb`` buckets to
``--receivers`` Ray actors (a worker group, as the rollout workers are) through the trainer's own transports
(:class:`BroadcastTransport` over a gloo group on CPU / NCCL on GPUs, :class:`ObjectStoreTransport`). Each
receiver copies every bucket into
preallocated tensors, as a rollout engine's ``update_weights`` does, and checks the bytes of the last
one. Reported: seconds per sync (median of ``--iters`` after one warm-up) and GB/s of payload delivered
to each receiver; the ratio is broadcast over object store in the same run.

    python -m bench.transport_bench --receivers 2 --total-mb 1024 --bucket-mb 128 --iters 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.measure import environment, write_json
from megarl.controller.rollout_worker import WeightReceiver


def make_payload(total_mb: int, tensor_mb: int = 16) -> list[tuple[str, torch.Tensor]]:
    per_tensor = tensor_mb * 2**20 // 2  # bf16 elements
    count = max(1, total_mb // tensor_mb)
    g = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.weight", torch.randn(per_tensor, generator=g).to(torch.bfloat16)) for i in range(count)]


class Receiver(WeightReceiver):
    """What a RolloutWorker does with buckets, minus the engine: copy into preallocated parameters."""

    def __init__(self, names_and_numels: list[tuple[str, int]]):
        self.params = {name: torch.empty(numel, dtype=torch.bfloat16) for name, numel in names_and_numels}

    def apply_bucket(self, bucket) -> None:
        for name, tensor in bucket:
            self.params[name].copy_(tensor)

    def apply_finished(self) -> None:
        pass

    def checksum(self, name: str) -> float:
        return float(self.params[name].float().sum())


def start_receivers(count: int, names_and_numels, worker_cls: type = None, *, timeout_s: float = 120):
    """``count`` receivers in a worker group of their own (one CPU-only Ray actor each, as separate rollout
    workers are): the group and its pool, for ``group.as_peers()`` and their shutdown."""
    from megarl.controller.resource_pool import ResourcePool
    from megarl.controller.worker_group import WorkerGroup

    pool = ResourcePool("receivers", [count], device="cpu", cpus_per_process=0.5)
    try:
        group = WorkerGroup(pool, worker_cls or Receiver, init_args=(names_and_numels,), name_prefix="receivers",
                            call_timeout_s=timeout_s, init_timeout_s=timeout_s)
    except BaseException:
        pool.release()
        raise
    return group, pool


def time_syncs(transport_factory, payload, bucket_bytes: int, iters: int) -> list[float]:
    from megarl.weight_sync.buckets import bucketize

    seconds = []
    for _ in range(iters + 1):  # the first one warms up (connections, allocations)
        transport = transport_factory()
        start = time.perf_counter()
        for bucket in bucketize(payload, bucket_bytes):
            transport.send(bucket)
        transport.finish()
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--bucket-mb", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import ray

    from megarl.controller.peer_transports import BroadcastTransport, ObjectStoreTransport, open_weight_group

    payload = make_payload(args.total_mb)
    total_bytes = sum(t.numel() * t.element_size() for _, t in payload)
    started = not ray.is_initialized()  # inside a driver that has Ray already (a test session), use its cluster
    if started:
        ray.init(num_cpus=max(2, args.receivers + 1), include_dashboard=False,
                 object_store_memory=max(2 * args.bucket_mb * 2**20 * args.receivers, 256 * 2**20))
    try:
        receivers, pool = start_receivers(args.receivers, [(n, t.numel()) for n, t in payload])
        peers = receivers.as_peers()
        group = open_weight_group(peers, "cpu", timeout_s=120)
        bucket_bytes = args.bucket_mb * 2**20
        results = {
            "broadcast": time_syncs(lambda: BroadcastTransport(peers, group, 600), payload, bucket_bytes, args.iters),
            "object_store": time_syncs(lambda: ObjectStoreTransport(peers, 600), payload, bucket_bytes, args.iters),
        }
        name, tensor = payload[-1]
        want = float(tensor.float().sum())
        got = receivers.call(Receiver.checksum, name)
        receivers.shutdown()
        pool.release()
        if any(abs(g - want) > 1e-3 * max(1.0, abs(want)) for g in got):
            raise AssertionError(f"receivers hold {got}, expected {want}")
    finally:
        if started:
            ray.shutdown()
    report = {"env": environment(torch.device("cpu")), "args": vars(args), "payload_bytes": total_bytes}
    print(f"{args.receivers} receivers, {total_bytes / 1e9:.2f} GB in {args.bucket_mb} MB buckets (CPU)")
    for kind, seconds in results.items():
        median = statistics.median(seconds)
        report[kind] = {"seconds": seconds, "median_s": median, "gb_per_s_per_receiver": total_bytes / 1e9 / median}
        print(f"  {kind:13s} {median:7.3f} s   {total_bytes / 1e9 / median:6.2f} GB/s per receiver")
    report["broadcast_over_object_store_speed"] = (report["object_store"]["median_s"]
                                                   / report["broadcast"]["median_s"])
    print(f"  broadcast / object store speed: {report['broadcast_over_object_store_speed']:.2f}x")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
