"""Weight transports from training rank 0 to separate rollout workers: through Ray's object store, or
broadcast over a process group of rank 0 and the workers (NCCL on GPUs, gloo on CPU), with the group's
rendezvous. Rank 0 calls the workers through their group's :class:`~megarl.controller.worker_group.PeerGroup`
(the receiving side's contract: :class:`~megarl.controller.rollout_worker.WeightReceiver`), so a worker that
fails or dies is named the way the driver names its own ranks. The colocated transport needs no Ray and
lives in :mod:`megarl.weight_sync`."""

from __future__ import annotations

import threading

from megarl.controller.rollout_worker import WeightReceiver
from megarl.weight_sync.transport import WeightTransport

PEER_FAILURE_GRACE_S = 10.0  # how long Ray may take to report a receiver's death after its collective broke


class _RolloutPeersTransport(WeightTransport):
    """Buckets from training rank 0 to the separate rollout workers; ``finish`` resets their caches."""

    def __init__(self, peers, timeout_s: float):
        self.peers, self.timeout_s = peers, timeout_s  # peers: the rollout group's PeerGroup

    def finish(self) -> None:
        self.peers.call_async(WeightReceiver.finish_weight_update).get(timeout_s=self.timeout_s)


class ObjectStoreTransport(_RolloutPeersTransport):
    """Each bucket goes once into Ray's object store (host memory) and every rollout worker loads it.

    Waiting for all workers before the next bucket keeps the extra memory at one bucket.
    """

    def send(self, bucket) -> None:
        self.peers.call_async(WeightReceiver.load_weight_bucket, bucket).get(timeout_s=self.timeout_s)


class BroadcastTransport(_RolloutPeersTransport):
    """Each bucket is broadcast as one flat buffer over the weight group (:mod:`megarl.weight_sync.broadcast`);
    its layout goes ahead by RPC. Device to device with NCCL; one bucket of extra memory per side."""

    def __init__(self, peers, group, timeout_s: float):
        super().__init__(peers, timeout_s)
        self.group = group

    def send(self, bucket) -> None:
        from megarl.weight_sync.broadcast import bucket_layout, pack_bucket, start_broadcast

        layout = bucket_layout(bucket)
        buffer = pack_bucket(bucket, layout, bucket[0][1].device)
        receiving = self.peers.call_async(WeightReceiver.receive_weight_bucket, layout)
        work = start_broadcast(self.group, buffer)
        receiving.wait_until(work.is_completed, timeout_s=self.timeout_s,
                             what=f"weight broadcast of {len(layout)} tensors")
        try:
            work.wait()
        except Exception as collective_error:
            # a receiver's death reaches the broadcast (connection closed) before Ray reports it: wait a moment
            # for the receivers' call, whose failure names the worker
            peer_failure = receiving.failure_within(PEER_FAILURE_GRACE_S)
            if peer_failure is not None:
                raise peer_failure from collective_error
            raise
        receiving.get(timeout_s=self.timeout_s)


def open_weight_group(peers, device: str, timeout_s: float):
    """On training rank 0: the weight group of this process (its root) and the ``peers`` group's workers
    (ranks 1..N)."""
    import ray

    from megarl.weight_sync.broadcast import create_group, host_store

    host = ray.util.get_node_ip_address()
    world = peers.world_size + 1
    store = host_store(host, world, timeout_s)
    joining = peers.call_async(WeightReceiver.join_weight_group, host, store.port, world, timeout_s)
    # Joining blocks until every member is there: join in a thread and watch the peers' joins, so a peer that
    # fails to join ends this at once with its error instead of at the group's timeout.
    # (A daemon thread: one left blocked must not keep the process from exiting.)
    outcome: dict = {}

    def join_as_root():
        try:
            outcome["group"] = create_group(host, store.port, 0, world, device, timeout_s, store=store)
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err

    root = threading.Thread(target=join_as_root, name="weight-group-join", daemon=True)
    root.start()
    joining.wait_until(lambda: not root.is_alive(), timeout_s=None, what="joining the weight group")
    if "error" in outcome:
        raise outcome["error"]
    joining.get(timeout_s=timeout_s)
    return outcome["group"]
