"""Worker groups: one Ray actor per pool bundle, forming one torch.distributed world, driven by RPC.

`WorkerGroup(pool, MyWorker, init_kwargs=...)` starts one host actor per rank of `pool`, reads where each landed
(node, IP, GPU), picks a free port on rank 0's node, writes the rank environment (see `worker_env.py`) and only
then constructs `MyWorker` inside each actor, so its `__init__` can call `init_torch_distributed()`. Worker
classes are plain Python classes (no Ray import); their methods are called with `call` / `call_async` and fan
out according to their `@register(dispatch=..., collect=...)` declaration (`dispatch.py`).

Colocation: groups built on the same pool share its bundles (each claims `bundle_share` of every bundle, e.g.
0.5 + 0.5; on GPU both actors see the bundle's GPU). The hybrid-engine default is a single worker class that
holds actor, rollout and reference, so one group with bundle_share=1. Separate placement = separate pools.

Failures never hang the driver: results are awaited with `ray.wait` in a poll loop, and the first rank whose
call raised or whose process died (kill -9, `os._exit`, node loss: Ray resolves its pending call with
ActorDiedError) turns into `WorkerError` naming group, rank, node, pid, method and the original error. A hung
collective (a peer alive but never arriving) is caught two ways: inside the workers by the process-group
timeout (`init_torch_distributed(timeout_s=...)`), which makes the collective raise; on the driver by the
per-call timeout (`call_timeout_s`, or `call_async(...).get(timeout_s=...)`), which raises `CallTimeoutError`
with the Python stacks of the ranks that did not finish (dumped by faulthandler on SIGUSR2). When a rank died,
or some rank was still running the failed call (so it may sit in a collective forever), the group is marked
broken and refuses further calls: shut it down and build a new one. When every rank finished and some merely
raised, the world is intact and the group stays usable.
Leaves out: restarting workers, elastic resizing, and the worker classes themselves (`workers.py`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from megarl.controller.debugging import break_requested, debugging_on, reason_to_wait_on
from megarl.controller.device_oom import DeviceOutOfMemory, naming_out_of_memory
from megarl.controller.host_oom import HostOutOfMemory, is_host_out_of_memory
from megarl.controller.profiling import stage_range
from megarl.controller.dispatch import (
    DP_INFO_METHOD,
    Collect,
    Dispatch,
    DPLayout,
    MethodSpec,
    WorkerMethod,
    collect_results,
    lookup_method_spec,
    method_name_of,
    plan_dispatch,
    ship_reads,
)
from megarl.controller.resource_pool import ResourcePool, format_table
from megarl.controller.worker_env import ENV_DEVICE, ENV_GROUP_NAME, ENV_LOCAL_DEVICE, ENV_POOL_NODE

STACK_DUMP_SIGNAL = signal.SIGUSR2
GROUP_DEFAULT: Any = object()  # "use the group's call_timeout_s" (None already means "no limit")
_SCALARS = (int, float, str, bool, bytes, type(None))


class WorkerError(RuntimeError):
    """A rank of a worker group failed (raised, died, or timed out) in a call; names where and why."""

    def __init__(self, group_name: str, rank: int, method: str, detail: str, *, node_ip: str | None = None,
                 pid: int | None = None, cause: BaseException | None = None) -> None:
        self.group_name = group_name
        self.rank = rank
        self.method = method
        self.detail = detail
        self.node_ip = node_ip
        self.pid = pid
        self.cause = cause
        self.failed_ranks = [rank]
        where = f"node {node_ip or '?'}, pid {pid or '?'}"
        super().__init__(f"worker group {group_name!r} rank {rank} ({where}) failed in {method}(): {detail}")

    def __reduce__(self):
        # raised in one worker (a peer group's call) and handed through Ray to the driver: rebuilt from its
        # fields, the cause (a dead peer's RayActorError, say) included
        return _rebuild_error, (type(self), dict(self.__dict__), str(self))


def _rebuild_error(cls: type, fields: dict, message: str) -> WorkerError:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(fields)
    return error


class CallTimeoutError(WorkerError):
    """A call did not finish on all ranks within its timeout; `stacks` maps rank -> Python stacks."""

    def __init__(self, group_name: str, ranks: list[int], method: str, timeout_s: float,
                 stacks: dict[int, str], infos: list[dict[str, Any]]) -> None:
        self.pending_ranks = ranks
        self.stacks = stacks
        shown = "\n".join(f"--- rank {rank} ({infos[rank]['node_ip']}, pid {infos[rank]['pid']}) ---\n{stacks[rank]}"
                          for rank in ranks if rank in stacks)
        detail = (f"did not finish within {timeout_s:g} s on ranks {ranks} (others finished; a peer stuck in a "
                  f"collective or a slow/hung rank). Stacks of the pending ranks:\n{shown or '(unavailable)'}")
        first = ranks[0]
        super().__init__(group_name, first, method, detail, node_ip=infos[first]["node_ip"], pid=infos[first]["pid"])


class _WorkerHost:
    """Ray actor body: owns one worker instance and runs its methods (on the actor's main thread)."""

    def __init__(self, worker_cls: type, group_name: str, rank: int) -> None:
        self._worker_cls = worker_cls
        self._group_name = group_name
        self._rank = rank
        self._worker: Any = None
        # faulthandler writes from the C signal handler, so it works even when the main thread is blocked
        # inside a C++ collective that holds no Python frame progress.
        # The file is unlinked at once (read back through /proc/<pid>/fd) so killed workers leave nothing behind.
        self._stack_file = tempfile.TemporaryFile(mode="w+", prefix="megarl-stacks-")
        faulthandler.register(STACK_DUMP_SIGNAL, file=self._stack_file, all_threads=True)

    def __repr__(self) -> str:  # Ray prefixes worker log lines with this
        return f"{self._group_name}[rank {self._rank}]"

    def describe(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "stack_file": f"/proc/{os.getpid()}/fd/{self._stack_file.fileno()}",
            "debugging": debugging_on(),
        }

    def bind_rendezvous_store(self, timeout_s: float) -> int:
        """Rank 0: the group's store, bound now on a port the system picks (see parallel.bind_rendezvous_store)."""
        from megarl.engines.megatron.parallel import bind_rendezvous_store

        return bind_rendezvous_store(timeout_s)

    def construct(self, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        os.environ.update(env)
        with naming_out_of_memory("construct", self._rank):
            self._worker = self._worker_cls(*args, **kwargs)

    def execute(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        if break_requested(method_name, self._rank):
            breakpoint()  # MEGARL_BREAK_AT (megarl.controller.debugging): step into the call below
        with naming_out_of_memory(method_name, self._rank), stage_range(method_name):
            return getattr(self._worker, method_name)(*args, **kwargs)


def _dump_stacks_of(targets: dict[int, tuple[int, str]], settle_s: float = 0.5) -> dict[int, str]:
    """On the workers' node: make faulthandler in each process (rank -> (pid, stack file)) dump all thread
    stacks, and return each one's new text; every process is signalled before the one wait for the dumps."""
    starts = {}
    for rank, (pid, stack_file) in targets.items():
        with open(stack_file) as handle:
            starts[rank] = handle.seek(0, os.SEEK_END)
        os.kill(pid, STACK_DUMP_SIGNAL)
    time.sleep(settle_s)
    stacks = {}
    for rank, (_, stack_file) in targets.items():
        with open(stack_file) as handle:
            handle.seek(starts[rank])
            stacks[rank] = handle.read()
    return stacks


# For ranks on another node than the driver's: a task there, one per node (Ray starts a worker process for it,
# which on a loaded node can take longer than the read is given).
_dump_remote_stacks = ray.remote(num_cpus=0)(_dump_stacks_of)


def _local_device_index(info: dict[str, Any]) -> int:
    """CUDA index of the bundle's GPU as seen inside the process (Ray usually narrows visibility to it)."""
    if not info["gpu_ids"]:
        raise RuntimeError(f"worker on {info['node_ip']} pid {info['pid']} got no GPU from Ray")
    gpu = info["gpu_ids"][0]
    visible = info["cuda_visible_devices"]
    if visible:
        entries = [entry.strip() for entry in visible.split(",")]
        if gpu in entries:
            return entries.index(gpu)
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all GPUs visible, the Ray id is the physical index.
    return int(gpu)


def _settle(pending: dict[ray.ObjectRef, int], timeout_s: float) -> tuple[dict[int, Any], dict[int, RayError]]:
    """Wait up to ``timeout_s`` for the calls in ``pending`` (ref -> rank) and take the finished ones out of it:
    their ranks' results, and the ranks whose call raised or whose process died, with Ray's error."""
    results: dict[int, Any] = {}
    failures: dict[int, RayError] = {}
    if not pending:
        return results, failures
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    for ref in ready:
        rank = pending.pop(ref)
        try:
            results[rank] = ray.get(ref)
        except RayError as err:
            failures[rank] = err
    return results, failures


class PendingCall:
    """A call in flight on every rank of a group; `get()` waits (never forever unless asked) and collects."""

    def __init__(self, group: "RankCaller", method: str, spec: MethodSpec, refs: list[ray.ObjectRef],
                 layout: DPLayout | None) -> None:
        self.group = group
        self.method = method
        self.spec = spec
        self.refs = refs
        self.layout = layout

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self, timeout_s: float | None = GROUP_DEFAULT) -> Any:
        """Wait for all ranks and collect. timeout_s=None waits without limit (dead ranks are still caught)."""
        limit = self.group.call_timeout_s if timeout_s is GROUP_DEFAULT else timeout_s
        results = self.group._gather(self.refs, self.method, limit)
        return collect_results(self.spec.collect, results, layout=self.layout,
                               method_name=f"{self.group.name}.{self.method}")

    def failure_within(self, seconds: float) -> "WorkerError | None":
        """This call's failure, if one of its ranks fails or dies within ``seconds``; None if none does. For a
        collective that failed under these ranks (gloo: "connection closed"): the collective can learn of a
        dead rank before Ray does, and the death, not the collective's error, names the worker."""
        pending = {ref: rank for rank, ref in enumerate(self.refs)}
        _, failures = _settle(pending, seconds)
        return self.group._fail(self.method, failures, pending) if failures else None

    def wait_until(self, is_done: Callable[[], bool], *, what: str, timeout_s: float | None = GROUP_DEFAULT) -> None:
        """Wait until ``is_done()`` (a collective these ranks take part in, say), raising the first failure of
        this call's ranks meanwhile: a rank that failed or died never joins the collective, so its error is the
        reason to stop, not the collective's timeout. Call :meth:`get` after it for the results."""
        limit = self.group.call_timeout_s if timeout_s is GROUP_DEFAULT else timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        pending = {ref: rank for rank, ref in enumerate(self.refs)}
        while not is_done():
            _, failures = _settle(pending, 0.05)
            if failures:
                raise self.group._fail(self.method, failures, pending)
            if deadline is not None and time.monotonic() > deadline:
                if self.group._at_breakpoint(sorted(pending.values()), self.method) is not None:
                    deadline = time.monotonic() + limit
                    continue
                raise TimeoutError(f"{what} did not finish within {limit:.0f}s (trainer.worker_timeout_s)")


@dataclass
class _PeerDeath:
    """A worker of ``group`` died, and rank ``seen_by`` of another group failed because of it."""

    group: "RankCaller"
    rank: int
    seen_by: int
    cause: BaseException

    def as_error(self, seer: "RankCaller", method: str, failures: dict[int, RayError]) -> WorkerError:
        info = self.group.worker_infos[self.rank]
        self.group._broken = f"rank {self.rank} died (seen by {seer.name!r} rank {self.seen_by} in {method}())"
        seer._broken = f"{method}() failed on rank {self.seen_by}: a peer in {self.group.name!r} died"
        detail = (f"the worker process died; {seer.name!r} rank {self.seen_by} was calling it in {method}() and "
                  f"failed with {type(self.cause).__name__}: {self.cause}")
        error = WorkerError(self.group.name, self.rank, method, detail, node_ip=info.get("node_ip"),
                            pid=info.get("pid"), cause=self.cause)
        error.failed_ranks = sorted(failures)
        return error


# Every group that came up in this process, so that a rank failing because a worker of another group died can
# name that worker.
_LIVE_GROUPS: "weakref.WeakSet[WorkerGroup]" = weakref.WeakSet()


class RankCaller:
    """Calling the ranks of a started group: dispatch by each method's declaration, waiting that never hangs,
    failures named. :class:`WorkerGroup` (which also starts and owns the ranks) and :class:`PeerGroup` (the
    view of a group that another group's worker holds) are both one."""

    name: str
    worker_cls: type
    call_timeout_s: float | None
    poll_interval_s: float
    worker_infos: list[dict[str, Any]]
    _actors: list[Any]
    _method_specs: dict[str, MethodSpec]
    _broken: str | None
    _dp_layout: DPLayout | None

    # ----------------------------------------------------------------------------------------- calls

    @property
    def world_size(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def call(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> Any:
        """Run `method` (a method of the worker class) on all ranks (dispatch per its declaration), wait with
        the group timeout, collect."""
        return self.call_async(method, *args, **kwargs).get()

    def call_async(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> PendingCall:
        """Start `method` on all ranks and return at once; `.get()` on the result waits and collects."""
        method_name = method_name_of(self.worker_cls, method)
        self._check_usable(method_name)
        spec = lookup_method_spec(self.worker_cls, method_name, self._method_specs)
        args, kwargs = ship_reads(spec, args, kwargs)
        needs_layout = spec.dispatch is Dispatch.DP_SPLIT or spec.collect is Collect.DP_COLLECT
        layout = self.dp_layout if needs_layout else None
        per_rank = plan_dispatch(spec.dispatch, args, kwargs, world_size=self.world_size, layout=layout,
                                 method_name=f"{self.name}.{method_name}")
        stored: dict[int, Any] = {}
        keep_alive: list[Any] = []  # ids in `stored` stay valid only while the objects live

        def share(value: Any) -> Any:
            # Put every non-scalar argument in the object store once, so ONE_TO_ALL and DP peers fetch one
            # copy instead of the driver serialising it once per rank.
            if isinstance(value, _SCALARS):
                return value
            if id(value) not in stored:
                stored[id(value)] = ray.put(value)
                keep_alive.append(value)
            return stored[id(value)]

        refs = [
            actor.execute.remote(method_name, *(share(v) for v in rank_args),
                                 **{name: share(v) for name, v in rank_kwargs.items()})
            for actor, (rank_args, rank_kwargs) in zip(self._actors, per_rank)
        ]
        return PendingCall(self, method_name, spec, refs, layout)

    def call_rank(self, rank: int, method: WorkerMethod, *args: Any, timeout_s: float | None = GROUP_DEFAULT,
                  **kwargs: Any) -> Any:
        """Run `method` on one rank only (e.g. rank 0 saving an HF checkpoint) and return its result."""
        method_name = method_name_of(self.worker_cls, method)
        self._check_usable(method_name)
        lookup_method_spec(self.worker_cls, method_name, self._method_specs)
        if not 0 <= rank < self.world_size:
            raise IndexError(f"worker group {self.name!r} has ranks 0..{self.world_size - 1}, got {rank}")
        limit = self.call_timeout_s if timeout_s is GROUP_DEFAULT else timeout_s
        ref = self._actors[rank].execute.remote(method_name, *args, **kwargs)
        return self._gather([ref], method_name, limit, ranks=[rank])[0]

    @property
    def dp_layout(self) -> DPLayout:
        """DP layout reported by the workers' `get_dp_info()` (fetched once); pure DP if they lack it."""
        if self._dp_layout is None:
            self.refresh_dp_layout()
        return self._dp_layout  # type: ignore[return-value]

    def refresh_dp_layout(self) -> DPLayout:
        """Re-query the DP layout, e.g. after the workers (re)initialised their parallel state."""
        if not callable(getattr(self.worker_cls, DP_INFO_METHOD, None)):
            self._dp_layout = DPLayout.pure_data_parallel(self.world_size)
        else:
            self._check_usable(DP_INFO_METHOD)
            infos = self._gather([actor.execute.remote(DP_INFO_METHOD) for actor in self._actors],
                                 DP_INFO_METHOD, self.call_timeout_s)
            self._dp_layout = DPLayout.from_infos(infos, group_name=f"worker group {self.name!r}")
        return self._dp_layout

    # ----------------------------------------------------------------------------------------- waiting

    def _check_usable(self, method_name: str) -> None:
        if not self._actors:
            raise RuntimeError(f"worker group {self.name!r} is shut down; cannot call {method_name}()")
        if self._broken is not None:
            raise RuntimeError(f"worker group {self.name!r} is broken by an earlier failure ({self._broken}); "
                               f"cannot call {method_name}(): shut it down and create a new group")

    def _gather(self, refs: list[ray.ObjectRef], method: str, timeout_s: float | None,
                ranks: list[int] | None = None) -> list[Any]:
        """Wait for all refs; raise WorkerError at the first failed rank, CallTimeoutError past the deadline."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = self.poll_interval_s
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
            finished, failures = _settle(pending, wait_s)
            results.update(finished)
            if failures:
                raise self._fail(method, failures, pending)
            if pending and deadline is not None and time.monotonic() >= deadline:
                pending_ranks = sorted(pending.values())
                stacks = self._at_breakpoint(pending_ranks, method)
                if stacks is None:
                    deadline = time.monotonic() + timeout_s  # type: ignore[operator]
                    continue
                self._broken = f"{method}() timed out on ranks {pending_ranks}"
                raise CallTimeoutError(self.name, pending_ranks, method, float(timeout_s),  # type: ignore[arg-type]
                                       stacks, self.worker_infos)
        return [results[rank] for rank in ranks]

    def _fail(self, method: str, failures: dict[int, RayError], pending: dict[ray.ObjectRef, int],
              grace_s: float = 1.0) -> WorkerError:
        """Build the WorkerError for a failed call, naming the root cause rank.

        A dead process makes its peers' collectives fail a moment later (gloo: connection closed), so after the
        first failure we wait `grace_s` for the other ranks and report first a rank killed for the node's memory,
        then a died rank, then a rank out of device memory; the other failures are listed in the message.
        """
        failures.update(_settle(pending, grace_s)[1])  # the ranks still running are left in pending
        peer_death = self._peer_death(failures)
        if peer_death is not None:
            return peer_death.as_error(self, method, failures)
        # A rank killed for the node's memory, or out of device memory, makes its peers' collectives fail too:
        # it is the cause, not they.
        host_out_of_memory = [rank for rank, err in failures.items() if is_host_out_of_memory(err)]
        died = [rank for rank, err in failures.items() if isinstance(err, RayActorError)]
        out_of_memory = [rank for rank, err in failures.items()
                         if isinstance(err, RayTaskError) and isinstance(err.cause, DeviceOutOfMemory)]
        primary = min(host_out_of_memory or died or out_of_memory or failures)
        err = failures[primary]
        cause: BaseException | None
        if is_host_out_of_memory(err):
            phase = "construct" if method.endswith(".__init__") else method  # the worker's construction
            cause = HostOutOfMemory.from_ray(err, phase, primary)
            detail = str(cause)
        elif isinstance(err, RayActorError):
            detail = f"the worker process died ({type(err).__name__}): {err}"
            cause = err
        elif isinstance(err, RayTaskError):
            cause = err.cause if isinstance(err.cause, BaseException) else err
            # str() of Ray's task error carries the remote traceback.
            detail = f"{type(cause).__name__}: {cause}\n{err}"
        else:
            cause, detail = err, f"{type(err).__name__}: {err}"
        others = sorted(rank for rank in failures if rank != primary)
        if others:
            summaries = [f"rank {rank}: {self._summarize(failures[rank])}" for rank in others]
            detail += "\nalso failed (likely as a consequence): " + "; ".join(summaries)
        still_running = sorted(pending.values())
        if died or host_out_of_memory or still_running:
            # Survivors may sit in a collective forever and the world lost a member: unusable from now on.
            self._broken = f"{method}() failed on rank {primary}"
        # Otherwise every rank finished the call (some raised): the world is intact and the group usable.
        info = self.worker_infos[primary]
        error = WorkerError(self.name, primary, method, detail, node_ip=info.get("node_ip"), pid=info.get("pid"),
                            cause=cause)
        error.failed_ranks = sorted(failures)
        return error

    def _peer_death(self, failures: dict[int, RayError]) -> "_PeerDeath | None":
        """A rank that raised because a worker of *another* group died under it (a rollout worker that rank 0
        streams weights to, say): that worker is the cause, and the error names it."""
        for rank, err in sorted(failures.items()):
            if not isinstance(err, RayTaskError):
                continue
            cause = err.cause
            while cause is not None and not isinstance(cause, RayActorError):
                # a peer group's error (PeerGroup, in the failed rank) carries the dead peer's as its cause
                cause = cause.cause if isinstance(cause, WorkerError) else (cause.__cause__ or cause.__context__)
            actor_id = getattr(cause, "actor_id", None) if cause is not None else None
            if not actor_id:
                continue
            for group in list(_LIVE_GROUPS):
                if group is self:
                    continue
                for peer_rank, actor in enumerate(group._actors):
                    if actor._actor_id.hex() == actor_id:
                        return _PeerDeath(group, peer_rank, rank, cause)
        return None

    @staticmethod
    def _summarize(err: RayError) -> str:
        if isinstance(err, RayTaskError) and isinstance(err.cause, BaseException):
            text = f"{type(err.cause).__name__}: {err.cause}"
        else:
            text = f"{type(err).__name__}: {err}"
        return text.splitlines()[0][:300] if text else type(err).__name__

    def _at_breakpoint(self, pending_ranks: list[int], method: str) -> dict[int, str] | None:
        """At a call's deadline: None when a pending rank sits at a debugger breakpoint (a person stepping
        through it, not a hang: the caller waits another period) or may (see ``reason_to_wait_on``), else the
        pending ranks' stacks for the report."""
        stacks, unreadable = self._dump_stacks(pending_ranks)
        debugging = {rank: bool(self.worker_infos[rank].get("debugging")) for rank in pending_ranks}
        reason = reason_to_wait_on(stacks, unreadable, debugging)
        if reason is None:
            return stacks
        print(f"[megarl] {self.name}.{method}(): {reason}; the call's watchdog (trainer.worker_timeout_s) waits on",
              flush=True)
        return None

    def _dump_stacks(self, ranks: list[int], timeout_s: float = 15.0) -> tuple[dict[int, str], list[int]]:
        """Best effort: ask faulthandler in each pending rank for its stacks (from here for ranks on the driver's
        node, by a task on theirs for the others). Returns the stacks, a reason in place of those that could not
        be read, and the ranks whose stacks could not."""
        driver_node = ray.get_runtime_context().get_node_id()
        by_node: dict[str, dict[int, tuple[int, str]]] = {}
        for rank in ranks:
            info = self.worker_infos[rank]
            if "stack_file" in info:
                by_node.setdefault(info["node_id"], {})[rank] = (info["pid"], info["stack_file"])
        stacks, unreadable, refs = {}, [], {}
        for node_id, targets in by_node.items():
            if node_id == driver_node:  # read here, no task to start; a task if this process may not
                try:
                    stacks.update(_dump_stacks_of(targets))
                    continue
                except OSError:
                    pass
            refs[node_id] = _dump_remote_stacks.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            ).remote(targets)
        for node_id, ref in refs.items():
            try:
                stacks.update(ray.get(ref, timeout=timeout_s))
            except (RayError, GetTimeoutError, OSError) as err:
                for rank in by_node[node_id]:
                    stacks[rank] = f"(could not dump stacks: {type(err).__name__}: {err})"
                    unreadable.append(rank)
        return stacks, unreadable

class WorkerGroup(RankCaller):
    """One Ray actor per bundle of `pool`, one torch.distributed world; see the module docstring."""

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type,
        *,
        init_args: Sequence[Any] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        name_prefix: str | None = None,
        bundle_share: float = 1.0,
        method_specs: Mapping[str, MethodSpec] | None = None,
        call_timeout_s: float | None = 1800.0,
        init_timeout_s: float = 300.0,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.pool = pool
        self.worker_cls = worker_cls
        self.name = name_prefix or worker_cls.__name__
        self.call_timeout_s = call_timeout_s
        self.poll_interval_s = poll_interval_s
        self._method_specs = dict(method_specs or {})
        for method_name in self._method_specs:
            lookup_method_spec(worker_cls, method_name)  # fail now on a typo, not at the first call
        self._broken: str | None = None
        self._dp_layout: DPLayout | None = None
        pool.claim_share(self.name, bundle_share)
        host_cls = ray.remote(_WorkerHost)
        self._actors = [
            host_cls.options(
                num_cpus=pool.cpus_per_process * bundle_share,
                num_gpus=pool.gpus_per_process * bundle_share,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group,
                    placement_group_bundle_index=slot.bundle_index,
                    placement_group_capture_child_tasks=False,
                ),
            ).remote(worker_cls, self.name, slot.rank)
            for slot in pool.slots
        ]
        # Until describe() returns we do not know nodes/pids; error messages show '?' for them.
        self.worker_infos: list[dict[str, Any]] = [{"node_ip": None, "pid": None} for _ in self._actors]
        try:
            self.worker_infos = self._gather([actor.describe.remote() for actor in self._actors],
                                             "describe (actor start)", init_timeout_s)
            master_port = ray.get(self._actors[0].bind_rendezvous_store.remote(init_timeout_s),
                                  timeout=init_timeout_s)
            envs = self._build_rank_envs(master_port, dict(env or {}))
            args, kwargs = tuple(init_args), dict(init_kwargs or {})
            self._gather([actor.construct.remote(rank_env, args, kwargs)
                          for actor, rank_env in zip(self._actors, envs)],
                         f"{worker_cls.__name__}.__init__", init_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._broken = None
        _LIVE_GROUPS.add(self)

    # ----------------------------------------------------------------------------------------- set-up

    def _build_rank_envs(self, master_port: int, extra: dict[str, str]) -> list[dict[str, str]]:
        ranks_on_node: dict[str, list[int]] = {}
        for rank, info in enumerate(self.worker_infos):
            ranks_on_node.setdefault(info["node_id"], []).append(rank)
        envs = []
        for slot, info in zip(self.pool.slots, self.worker_infos):
            peers = ranks_on_node[info["node_id"]]
            local_rank = peers.index(slot.rank)
            rank_env = {
                "MASTER_ADDR": self.worker_infos[0]["node_ip"],
                "MASTER_PORT": str(master_port),
                "RANK": str(slot.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(len(peers)),
                ENV_GROUP_NAME: self.name,
                ENV_POOL_NODE: str(slot.pool_node),
                ENV_DEVICE: self.pool.device,
                ENV_LOCAL_DEVICE: str(_local_device_index(info)) if self.pool.device == "cuda" else "",
            }
            info.update(master_port=str(master_port), local_rank=local_rank, pool_node=slot.pool_node, bundle=slot.bundle_index,
                        local_device=rank_env[ENV_LOCAL_DEVICE] or None)
            rank_env.update(extra)
            envs.append(rank_env)
        return envs

    def as_peers(self) -> "PeerGroup":
        """This group as another group's worker calls it (training rank 0 streaming weights to the rollout
        workers, say): the same calls, dispatch and failure naming; pickled into that worker."""
        return PeerGroup(self)

    # ----------------------------------------------------------------------------------------- reporting / teardown

    def placement_table(self) -> list[dict[str, Any]]:
        """One row per rank: where it runs (node, pid, GPU) — what the launcher prints at start."""
        return [
            {"group": self.name, "rank": rank, "pool_node": info.get("pool_node"), "bundle": info.get("bundle"),
             "node_ip": info["node_ip"], "pid": info["pid"], "local_rank": info.get("local_rank"),
             "gpu_ids": ",".join(info.get("gpu_ids", [])) or "-", "local_device": info.get("local_device") or "-"}
            for rank, info in enumerate(self.worker_infos)
        ]

    def format_placement_table(self) -> str:
        return format_table(self.placement_table())

    def shutdown(self) -> None:
        """Kill the actors and give the group's bundle share back to the pool; safe to call twice."""
        _LIVE_GROUPS.discard(self)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead or Ray gone: nothing to kill
                pass
        self._actors = []
        self.pool.release_share(self.name)

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class PeerGroup(RankCaller):
    """A started group's ranks, called from inside another group's worker (:meth:`WorkerGroup.as_peers`).

    It owns nothing: it neither starts nor shuts down the ranks. A failure it sees marks only this view
    broken; the error it raises names the failed peer, and when it reaches the driver the peer's own group
    learns of it there (:meth:`RankCaller._peer_death`)."""

    def __init__(self, group: WorkerGroup):
        self.name, self.worker_cls = group.name, group.worker_cls
        self.call_timeout_s, self.poll_interval_s = group.call_timeout_s, group.poll_interval_s
        self.worker_infos = [dict(info) for info in group.worker_infos]
        self._actors = list(group._actors)
        self._method_specs = dict(group._method_specs)
        self._broken = None
        self._dp_layout = group._dp_layout
