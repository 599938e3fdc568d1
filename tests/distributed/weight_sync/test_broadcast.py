"""The broadcast weight transport's pieces: bucket <-> flat buffer, and a real gloo weight group of three
processes (what the trainer's rank 0 and two separate rollout workers form)."""

import torch

from megarl.weight_sync.broadcast import buffer_bytes, bucket_layout, pack_bucket, unpack_bucket
from tests.dist_harness import free_port, run_distributed


def _bucket(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
            ("layers.0.norm.weight", torch.randn(5, generator=g)),
            ("layers.0.count", torch.randint(0, 100, (3,), generator=g)),
            ("layers.0.proj.weight", torch.randn(4, 6, generator=g).t())]  # not contiguous


def test_buffer_round_trip_keeps_names_dtypes_shapes_and_bits():
    bucket = _bucket(0)
    layout = bucket_layout(bucket)
    assert all(slot.offset % 16 == 0 for slot in layout)
    buffer = pack_bucket(bucket, layout, "cpu")
    assert buffer.dtype == torch.uint8 and buffer.numel() == buffer_bytes(layout)
    for (name, want), (got_name, got) in zip(bucket, unpack_bucket(buffer, layout)):
        assert got_name == name and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def _member(rank, port):
    from megarl.weight_sync.broadcast import broadcast_from_root, create_group

    group = create_group("127.0.0.1", port, rank, 3, "cpu", timeout_s=60)
    received = []
    for seed in (1, 2):  # two buckets in a row over the same group
        bucket = _bucket(seed)
        layout = bucket_layout(bucket)
        if rank == 0:
            buffer = pack_bucket(bucket, layout, "cpu")
        else:
            buffer = torch.zeros(buffer_bytes(layout), dtype=torch.uint8)
        broadcast_from_root(group, buffer)
        received.append([(name, tensor.clone()) for name, tensor in unpack_bucket(buffer, layout)])
    return received


def test_weight_group_broadcasts_every_bucket_to_every_member():
    port = free_port()
    for rank, received in enumerate(run_distributed(_member, 3, port, timeout_s=120)):
        for seed, bucket in zip((1, 2), received):
            for (name, want), (_, got) in zip(_bucket(seed), bucket):
                assert torch.equal(got, want), (rank, seed, name)
