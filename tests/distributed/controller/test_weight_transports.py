"""The separate-placement broadcast transport with real Ray actors in a worker group and a real gloo weight
group: a receiver that fails stops the sync at once with its error, naming its group and rank (it never joins
the broadcast, which would otherwise block until the group's timeout), and so does a receiver that cannot join
the group."""

import os
import time

import pytest
import torch

from bench.transport_bench import Receiver, make_payload, start_receivers
from megarl.controller.worker_group import WorkerError


class FailingReceiver(Receiver):
    def receive_weight_bucket(self, layout) -> None:
        if os.environ["RANK"] == "1":
            raise ValueError("rollout engine refused the bucket")
        super().receive_weight_bucket(layout)


pytestmark = pytest.mark.usefixtures("ray_cluster")  # the session's (tests/conftest.py)


@pytest.mark.timeout(120)
def test_a_failing_receiver_stops_the_broadcast_with_its_error():
    from megarl.controller.peer_transports import BroadcastTransport, open_weight_group

    payload = make_payload(64, tensor_mb=16)  # 16 MB tensors: more than socket buffers hold
    receivers, pool = start_receivers(2, [(name, tensor.numel()) for name, tensor in payload], FailingReceiver)
    try:
        peers = receivers.as_peers()
        group = open_weight_group(peers, "cpu", timeout_s=600)
        transport = BroadcastTransport(peers, group, timeout_s=600)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rollout engine refused the bucket") as caught:
            transport.send(payload[:2])
        assert time.monotonic() - start < 60, "the failure was only noticed at the timeout"
        assert (caught.value.group_name, caught.value.rank) == ("receivers", 1)
        assert caught.value.method == "receive_weight_bucket"
        assert isinstance(payload[0][1], torch.Tensor)
    finally:  # the good receiver waits in a broadcast that never comes: give its CPU back to the shared cluster
        receivers.shutdown()
        pool.release()


class UnjoinableReceiver(Receiver):
    def join_weight_group(self, host, port, world_size, timeout_s) -> None:
        if os.environ["RANK"] == "1":
            raise RuntimeError("no route to the trainer")
        super().join_weight_group(host, port, world_size, timeout_s)


@pytest.mark.timeout(120)
def test_a_receiver_that_cannot_join_fails_the_group_at_once():
    from megarl.controller.peer_transports import open_weight_group

    receivers, pool = start_receivers(2, [], UnjoinableReceiver)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="no route to the trainer") as caught:
            open_weight_group(receivers.as_peers(), "cpu", timeout_s=600)
        assert time.monotonic() - start < 60
        assert caught.value.rank == 1 and caught.value.method == "join_weight_group"
    finally:  # the other receiver waits to join a group that never forms
        receivers.shutdown()
        pool.release()
