"""Worker groups on a real local Ray cluster: gloo worlds with real collectives, DP dispatch, colocation, failures.

The session's one Ray cluster (tests/conftest.py; 0.5 CPU per rank here) serves the module, and starting worker
processes is the expensive part on a 2-core box, so groups are module fixtures: a 4-rank dp2 x tp2 mesh, and
a 2-rank pool holding two colocated groups. The last two tests break those pair groups on purpose (kill -9, hang),
so they come last. Worker classes live here; the workers import this module by reference.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import ray
import torch
import torch.distributed as dist

from megarl.controller.device_oom import DeviceOutOfMemory
from megarl.controller.dispatch import Collect, Dispatch, DPInfo, register
from megarl.controller.inprocess_group import InProcessWorkerGroup
from megarl.controller.resource_pool import ResourcePool, ResourcePoolError
from megarl.controller.worker_env import init_torch_distributed
from megarl.controller.worker_group import CallTimeoutError, WorkerError, WorkerGroup

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("ray_cluster")]

CPUS_PER_RANK = 0.5


@dataclasses.dataclass
class ToyBatch:
    tokens: torch.Tensor
    prompts: list
    step: int


class CollectiveWorker:
    """Joins the group's gloo world at construction, like a real engine worker."""

    def __init__(self, tag: str = "") -> None:
        self.ctx = init_torch_distributed(timeout_s=60)
        self.tag = tag

    def all_reduce_rank(self) -> float:
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return value.item()

    def rank_env(self) -> dict:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MEGARL_GROUP_NAME", "CUDA_DEVICE_MAX_CONNECTIONS",
                 "MEGARL_TEST_MARKER")
        return {name: os.environ.get(name) for name in names} | {"tag": self.tag, "pid": os.getpid(),
                                                                "threads": torch.get_num_threads()}

    @register(dispatch=Dispatch.ALL_TO_ALL, collect=Collect.ALL)
    def scale(self, factor: float, *, offset: float) -> float:
        return dist.get_rank() * factor + offset

    @register(collect=Collect.RANK0)
    def describe_rank(self) -> int:
        return dist.get_rank()

    def die_in_collective(self, victim: int) -> float:
        if dist.get_rank() == victim:
            os.kill(os.getpid(), 9)
        value = torch.ones(1)
        dist.all_reduce(value)  # the survivors block here: their peer never arrives
        return value.item()

    def raise_on(self, victim: int) -> int:
        if dist.get_rank() == victim:
            raise ValueError(f"bad row in shard of rank {victim}")
        return dist.get_rank()

    def update_actor(self, victim: int) -> int:
        """The victim runs out of device memory; its peer fails after it, as a peer's collective would."""
        if dist.get_rank() == victim:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        time.sleep(0.2)
        raise RuntimeError("Connection closed by peer")

    def hang_on(self, victim: int, seconds: float) -> int:
        if dist.get_rank() == victim:
            time.sleep(seconds)
        return dist.get_rank()


class TensorParallelWorker(CollectiveWorker):
    """dp=2 x tp=2 on 4 ranks: rank = dp_rank * tp + tp_rank; TP rank 0 collects (as after Megatron init)."""

    TP = 2

    def __init__(self) -> None:
        super().__init__(tag="mesh")
        rank, world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.tp_rank = divmod(rank, self.TP)
        # Every rank must create every subgroup, in the same order (torch.distributed's rule).
        for dp in range(world // self.TP):
            group = dist.new_group(list(range(dp * self.TP, (dp + 1) * self.TP)), backend="gloo")
            if dp == self.dp_rank:
                self.tp_group = group

    def get_dp_info(self) -> DPInfo:
        return DPInfo(self.dp_rank, dist.get_world_size() // self.TP, self.tp_rank == 0)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT)
    def double_and_check_tp_peers(self, batch: ToyBatch, note: str) -> ToyBatch:
        # A real TP check: the peer's chunk must be identical, verified through a TP-group collective.
        total = batch.tokens.clone()
        dist.all_reduce(total, group=self.tp_group)
        if not torch.equal(total, batch.tokens * self.TP):
            raise AssertionError(f"TP peers of dp rank {self.dp_rank} received different chunks")
        return ToyBatch(tokens=batch.tokens * 2, prompts=[f"{p}|dp{self.dp_rank}|{note}" for p in batch.prompts],
                        step=batch.step)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.ALL)
    def chunk_first_rows(self, tokens: torch.Tensor) -> list:
        return tokens[:, 0].tolist()


class CallsPeers:
    """Calls the workers of another group, as training rank 0 streams weight buckets to rollout workers."""

    def attach(self, peers: list) -> None:
        self.peers = peers

    def push_to_peers(self) -> list:
        return ray.get([peer.execute.remote("where") for peer in self.peers], timeout=30)


class LightWorker:
    """No torch.distributed world: used where only placement matters."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def nap(self, victim: int, seconds: float) -> str:
        if int(os.environ["RANK"]) == victim:
            time.sleep(seconds)
        return self.marker

    def where(self) -> dict:
        return {"marker": self.marker, "pid": os.getpid(), "master_port": os.environ["MASTER_PORT"],
                "world": os.environ["WORLD_SIZE"]}


@pytest.fixture(scope="module")
def mesh():
    pool = ResourcePool("mesh", nodes=[2, 2], device="cpu", cpus_per_process=CPUS_PER_RANK)
    group = WorkerGroup(pool, TensorParallelWorker, name_prefix="mesh")
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def pair_pool():
    pool = ResourcePool("pair", nodes=[2], device="cpu", cpus_per_process=CPUS_PER_RANK)
    yield pool
    pool.release()


@pytest.fixture(scope="module")
def pair(pair_pool):
    group = WorkerGroup(pair_pool, CollectiveWorker, init_kwargs={"tag": "t"}, name_prefix="pair", bundle_share=0.5)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def side(pair_pool, pair):
    group = WorkerGroup(pair_pool, LightWorker, init_args=("side",), name_prefix="side", bundle_share=0.5)
    yield group
    group.shutdown()


def test_four_rank_world_all_reduce_and_rank_env(mesh):
    assert mesh.call("all_reduce_rank") == [10.0] * 4  # 1 + 2 + 3 + 4
    envs = mesh.call("rank_env")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["MEGARL_GROUP_NAME"] for e in envs} == {"mesh"}
    assert len({e["pid"] for e in envs}) == 4
    assert {e["threads"] for e in envs} == {1}  # CPU ranks are the parallelism: one intra-op thread each
    # init_ray's runtime env reached the workers: Megatron default and the explicit extra_env.
    assert {(e["CUDA_DEVICE_MAX_CONNECTIONS"], e["MEGARL_TEST_MARKER"]) for e in envs} == {("1", "on")}
    rows = mesh.placement_table()
    assert [row["pool_node"] for row in rows] == [0, 0, 1, 1]
    # Both pool nodes land on this one machine, so LOCAL_RANK counts across them (torchrun semantics).
    assert [int(e["LOCAL_RANK"]) for e in envs] == [0, 1, 2, 3]
    assert "node_ip" in mesh.format_placement_table()


def test_all_to_all_and_rank0_dispatch(mesh):
    # ALL_TO_ALL: rank r gets factor[r] and offset[r]
    assert mesh.call("scale", [10.0, 20.0, 30.0, 40.0], offset=[1.0, 2.0, 3.0, 4.0]) == [1.0, 22.0, 63.0, 124.0]
    assert mesh.call("describe_rank") == 0
    with pytest.raises(ValueError, match="one entry per rank"):
        mesh.call("scale", [1.0], offset=[0.0] * 4)
    assert mesh.call_rank(3, "describe_rank") == 3


def test_dp_split_sends_identical_chunks_to_tp_peers_and_collects_once_per_dp_rank(mesh):
    assert mesh.dp_layout.dp_ranks == (0, 0, 1, 1)
    assert mesh.dp_layout.collect_ranks == (0, 2)
    tokens = torch.arange(12).reshape(4, 3)
    batch = ToyBatch(tokens=tokens, prompts=["a", "b", "c", "d"], step=7)
    out = mesh.call("double_and_check_tp_peers", batch, note="n")
    assert isinstance(out, ToyBatch)
    assert torch.equal(out.tokens, tokens * 2)  # each row exactly once, in dp order
    assert out.prompts == ["a|dp0|n", "b|dp0|n", "c|dp1|n", "d|dp1|n"]
    assert out.step == 7
    # Collect.ALL shows what every rank got: TP peers share a chunk.
    assert mesh.call("chunk_first_rows", tokens) == [[0, 3], [0, 3], [6, 9], [6, 9]]
    with pytest.raises(ValueError, match="not divisible"):
        mesh.call("chunk_first_rows", torch.zeros(3, 1))


def test_pool_placement_table_lists_every_rank(mesh):
    rows = mesh.pool.placement_table()
    assert [(r["rank"], r["pool_node"], r["bundle"]) for r in rows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert {r["node_id"] for r in rows} <= alive


def test_two_rank_world_all_reduce(pair):
    assert pair.call("all_reduce_rank") == [3.0, 3.0]  # 1 + 2
    envs = pair.call("rank_env")
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["tag"] for e in envs} == {"t"}


def test_two_groups_colocated_on_one_pool_share_bundles(pair_pool, pair, side):
    with pytest.raises(ResourcePoolError, match="already claimed"):
        WorkerGroup(pair_pool, LightWorker, init_args=("third",), name_prefix="third", bundle_share=0.5)
    a, b = pair.call("rank_env"), side.call("where")
    assert [x["marker"] for x in b] == ["side", "side"]
    assert not {x["pid"] for x in a} & {x["pid"] for x in b}  # separate processes ...
    assert {x["world"] for x in b} == {"2"}
    assert b[0]["master_port"] != pair.worker_infos[0]["master_port"]  # ... and separate worlds ...
    # ... on the same bundles: rank r of both groups sits on the same node.
    assert [r["node_ip"] for r in pair.placement_table()] == [r["node_ip"] for r in side.placement_table()]


def test_failing_constructor_is_reported_as_worker_error():
    pool = ResourcePool("badinit", nodes=[1], device="cpu", cpus_per_process=CPUS_PER_RANK)
    try:
        with pytest.raises(WorkerError, match=r"LightWorker.__init__.*TypeError"):
            WorkerGroup(pool, LightWorker, name_prefix="badinit")  # missing `marker`
        # The failed group gave its share back, so a correct one fits.
        with WorkerGroup(pool, LightWorker, init_args=("ok",), name_prefix="badinit") as group:
            assert group.call("where")[0]["marker"] == "ok"
    finally:
        pool.release()


def test_unsatisfiable_pools_fail_fast_with_clear_errors(mesh, pair_pool):
    # mesh + pair_pool hold 3 CPUs of the session's cluster (fixtures requested so the state is the same in
    # isolation); what earlier tests held is given back (a killed actor's CPU returns a moment after the kill).
    total = int(ray.cluster_resources()["CPU"])
    deadline = time.monotonic() + 30
    while (free := ray.available_resources().get("CPU", 0)) != total - 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free == total - 3, f"{total - 3 - free} CPU still held by earlier tests' actors"
    start = time.monotonic()
    with pytest.raises(ResourcePoolError, match=r"asks for 1 node x 8 processes.*no GPUs"):
        ResourcePool("gpu", nodes=[8], device="cuda")
    too_many = 2 * total + 2  # 0.5 CPU each: one more CPU than the whole cluster has
    with pytest.raises(ResourcePoolError, match=rf"asks for 1 node x {too_many} processes.*fits on no node"):
        ResourcePool("big", nodes=[too_many], device="cpu", cpus_per_process=0.5)
    # the cluster has the CPUs, but the groups hold them: one CPU more than is free
    with pytest.raises(ResourcePoolError, match=rf"could not be placed within 2 s.*available now: {free:g} CPU"):
        ResourcePool("late", nodes=[int(free) + 1], device="cpu", cpus_per_process=1.0, ready_timeout_s=2.0)
    assert time.monotonic() - start < 20
    # The timed-out pool released its partial reservation: an ask that fits the free CPU succeeds.
    ResourcePool("fits", nodes=[2], device="cpu", cpus_per_process=0.5, ready_timeout_s=10.0).release()


def test_raising_worker_reports_original_error_and_group_stays_usable(pair):
    with pytest.raises(WorkerError) as caught:
        pair.call("raise_on", 1)
    err = caught.value
    assert err.rank == 1 and err.method == "raise_on" and isinstance(err.cause, ValueError)
    assert "bad row in shard of rank 1" in str(err) and "in raise_on" in str(err)  # remote traceback
    # Every rank finished the call, so the world is intact.
    assert pair.call("all_reduce_rank") == [3.0, 3.0]


def test_out_of_device_memory_is_named_with_phase_and_rank_and_outranks_its_peers_failure(pair):
    with pytest.raises(WorkerError) as caught:
        pair.call("update_actor", 1)
    err = caught.value
    assert err.rank == 1 and isinstance(err.cause, DeviceOutOfMemory) and err.cause.phase == "update_actor"
    assert "out of device memory in actor update" in str(err) and "rank 1: requested 20.00 MiB" in str(err)
    assert "ppo_max_token_len_per_gpu" in str(err)
    assert "rank 0: RuntimeError: Connection closed by peer" in str(err)


def test_in_process_group_names_the_method_as_the_phase():
    group = InProcessWorkerGroup(_Hungry, device="cpu")
    try:
        with pytest.raises(DeviceOutOfMemory, match=r"old log-probs .* \[compute_log_probs\] on rank 0"):
            group.call("compute_log_probs")
    finally:
        group.shutdown()
    with pytest.raises(DeviceOutOfMemory, match=r"start-up .* \[construct\]"):
        InProcessWorkerGroup(_Hungry, device="cpu", init_kwargs={"fail_in_init": True})


class _Hungry:
    def __init__(self, fail_in_init: bool = False):
        if fail_in_init:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB.")

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def compute_log_probs(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB.")


def test_a_worker_that_died_under_another_groups_call_is_named_not_the_caller():
    """one_step_off's weight sync: rank 0 of the trainer calls the rollout workers; SIGKILL one of them and the
    error must name the dead rollout worker (group, rank, pid), not the live trainer rank that saw it."""
    pool = ResourcePool("peers", nodes=[2], device="cpu", cpus_per_process=CPUS_PER_RANK)
    try:
        callers = WorkerGroup(pool, CallsPeers, name_prefix="caller", bundle_share=0.5)
        rollout = WorkerGroup(pool, LightWorker, init_args=("r",), name_prefix="rollout", bundle_share=0.5)
        callers.call_rank(0, "attach", rollout.actors)
        assert [w["marker"] for w in callers.call_rank(0, "push_to_peers")] == ["r", "r"]
        victim_pid = rollout.worker_infos[1]["pid"]
        os.kill(victim_pid, 9)
        with pytest.raises(WorkerError) as caught:
            callers.call_rank(0, "push_to_peers")
        err = caught.value
        assert (err.group_name, err.rank, err.pid) == ("rollout", 1, victim_pid), str(err)
        assert "died" in str(err) and "'caller' rank 0 was calling it in push_to_peers()" in str(err)
        with pytest.raises(RuntimeError, match="broken"):
            rollout.call("where")
        callers.shutdown()
        rollout.shutdown()
    finally:
        pool.release()


# --- the two tests below break the pair groups; keep them last -----------------------------------------------


def test_hung_rank_hits_call_timeout_with_its_stack(side):
    start = time.monotonic()
    with pytest.raises(CallTimeoutError) as caught:
        side.call_async("nap", 1, 60.0).get(timeout_s=2.0)
    assert time.monotonic() - start < 20
    err = caught.value
    assert err.pending_ranks == [1] and err.rank == 1
    assert "in nap" in err.stacks[1]  # faulthandler's dump shows where rank 1 sits
    with pytest.raises(RuntimeError, match="broken"):
        side.call("where")


def test_killed_worker_in_collective_raises_worker_error_fast(pair):
    victim_pid = pair.worker_infos[1]["pid"]
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        pair.call("die_in_collective", 1)
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"took {elapsed:.1f} s"
    err = caught.value
    assert (err.group_name, err.rank, err.method, err.pid) == ("pair", 1, "die_in_collective", victim_pid)
    assert "died" in str(err) and "'pair' rank 1" in str(err) and err.node_ip in str(err)
    with pytest.raises(RuntimeError, match="broken"):
        pair.call("all_reduce_rank")
