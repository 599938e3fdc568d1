"""Weight transports from training rank 0 to separate rollout workers (Ray actors): through Ray's object
store, or broadcast over a process group of rank 0 and the workers (NCCL on GPUs, gloo on CPU), with the
group's rendezvous. The colocated transport needs no Ray and lives in :mod:`megarl.weight_sync`."""

from __future__ import annotations

from typing import Optional

from megarl.weight_sync.transport import WeightTransport


class _RolloutPeersTransport(WeightTransport):
    """Buckets from training rank 0 to the separate rollout workers; ``finish`` resets their caches."""

    def __init__(self, peers: list, timeout_s: float):
        self.peers, self.timeout_s = peers, timeout_s

    def _on_every_peer(self, method: str, *args):
        return [peer.execute.remote(method, *args) for peer in self.peers]

    def _wait(self, pending: list) -> None:
        import ray

        ray.get(pending, timeout=self.timeout_s)

    def finish(self) -> None:
        self._wait(self._on_every_peer("finish_weight_update"))


class ObjectStoreTransport(_RolloutPeersTransport):
    """Each bucket goes once into Ray's object store (host memory) and every rollout worker loads it.

    Waiting for all workers before the next bucket keeps the extra memory at one bucket.
    """

    def send(self, bucket) -> None:
        import ray

        self._wait(self._on_every_peer("load_weight_bucket", ray.put(bucket)))


class BroadcastTransport(_RolloutPeersTransport):
    """Each bucket is broadcast as one flat buffer over the weight group (:mod:`megarl.weight_sync.broadcast`);
    its layout goes ahead by RPC. Device to device with NCCL; one bucket of extra memory per side."""

    def __init__(self, peers: list, group, timeout_s: float):
        super().__init__(peers, timeout_s)
        self.group = group

    def send(self, bucket) -> None:
        from megarl.weight_sync.broadcast import bucket_layout, pack_bucket, start_broadcast

        layout = bucket_layout(bucket)
        buffer = pack_bucket(bucket, layout, bucket[0][1].device)
        pending = self._on_every_peer("receive_weight_bucket", layout)
        work = start_broadcast(self.group, buffer)
        _watch_peers(pending, work.is_completed, timeout_s=self.timeout_s,
                     what=f"weight broadcast of {len(layout)} tensors")
        work.wait()
        self._wait(pending)


def _watch_peers(pending: list, is_done, *, timeout_s: Optional[float] = None, what: str = "") -> None:
    """Wait until ``is_done()``, raising the first error among the peers' ``pending`` calls meanwhile: a
    peer that failed or died never joins the collective being waited on, so its error is the reason to
    stop rather than the collective's timeout."""
    import time

    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not is_done():
        finished, _ = ray.wait(pending, num_returns=len(pending), timeout=0.05)
        ray.get(finished)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s:.0f}s (trainer.worker_timeout_s)")


def open_weight_group(peers: list, device: str, timeout_s: float):
    """On training rank 0: the weight group of this process (its root) and ``peers`` (ranks 1..N)."""
    import threading

    import ray

    from megarl.weight_sync.broadcast import create_group, host_store

    host = ray.util.get_node_ip_address()
    world = len(peers) + 1
    store = host_store(host, world, timeout_s)
    port = store.port
    joins = [peer.execute.remote("join_weight_group", host, port, rank, world, timeout_s)
             for rank, peer in enumerate(peers, start=1)]
    # Joining blocks until every member is there: wait in a thread and watch the peers' joins, so a peer
    # that fails to join ends this at once with its error instead of at the group's timeout.
    # (A daemon thread: one left blocked must not keep the process from exiting.)
    outcome: dict = {}

    def join_as_root():
        try:
            outcome["group"] = create_group(host, port, 0, world, device, timeout_s, store=store)
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err

    joining = threading.Thread(target=join_as_root, name="weight-group-join", daemon=True)
    joining.start()
    _watch_peers(joins, lambda: not joining.is_alive())
    if "error" in outcome:
        raise outcome["error"]
    ray.get(joins, timeout=timeout_s)
    return outcome["group"]
