"""The separate-placement broadcast transport with real Ray actors and a real gloo weight group: a receiver
that fails stops the sync at once with its error (it never joins the broadcast, which would otherwise
block until the group's timeout), and so does a receiver that cannot join the group."""

import time

import pytest
import torch

from bench.transport_bench import Receiver, make_payload


class FailingReceiver(Receiver):
    def receive_weight_bucket(self, layout) -> None:
        raise ValueError("rollout engine refused the bucket")


pytestmark = pytest.mark.usefixtures("ray_cluster")  # the session's (tests/conftest.py)


@pytest.mark.timeout(120)
def test_a_failing_receiver_stops_the_broadcast_with_its_error():
    import ray

    from megarl.controller.peer_transports import BroadcastTransport, open_weight_group

    payload = make_payload(64, tensor_mb=16)  # 16 MB tensors: more than socket buffers hold
    shapes = [(name, tensor.numel()) for name, tensor in payload]
    peers = [ray.remote(num_cpus=0.5)(Receiver).remote(shapes),
             ray.remote(num_cpus=0.5)(FailingReceiver).remote(shapes)]
    try:
        group = open_weight_group(peers, "cpu", timeout_s=600)
        transport = BroadcastTransport(peers, group, timeout_s=600)
        start = time.monotonic()
        with pytest.raises(Exception, match="rollout engine refused the bucket"):
            transport.send(payload[:2])
        assert time.monotonic() - start < 60, "the failure was only noticed at the timeout"
        assert isinstance(payload[0][1], torch.Tensor)
    finally:  # the good receiver waits in a broadcast that never comes: give its CPU back to the shared cluster
        for peer in peers:
            ray.kill(peer)


class UnjoinableReceiver(Receiver):
    def join_weight_group(self, host, port, rank, world_size, timeout_s) -> None:
        raise RuntimeError("no route to the trainer")


@pytest.mark.timeout(120)
def test_a_receiver_that_cannot_join_fails_the_group_at_once():
    import ray

    from megarl.controller.peer_transports import open_weight_group

    peers = [ray.remote(num_cpus=0.5)(Receiver).remote([]), ray.remote(num_cpus=0.5)(UnjoinableReceiver).remote([])]
    start = time.monotonic()
    try:
        with pytest.raises(Exception, match="no route to the trainer"):
            open_weight_group(peers, "cpu", timeout_s=600)
        assert time.monotonic() - start < 60
    finally:  # the other receiver waits to join a group that never forms
        for peer in peers:
            ray.kill(peer)
