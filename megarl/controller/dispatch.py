"""How a driver-side call fans out to the ranks of a worker group and how the per-rank results come back.

A worker method declares its contract with the driver once, where it is implemented:
`@register(dispatch=..., collect=..., reads=...)`. The driver calls it through a group by the method itself,
`group.call(ActorRolloutRefWorker.update_actor, batch)` (a name a reader, an IDE and a call graph can follow;
a misspelt one fails at import), and `WorkerGroup.call` reads the declaration: `reads` names the
`TrainBatch` fields the method reads, and only those travel to the ranks (the rest stays with the driver);
`plan_dispatch` / `collect_results` below fan the arguments out and the results in. Dispatch modes:

- ONE_TO_ALL: every rank gets the same arguments.
- ALL_TO_ALL: every argument is a sequence with one entry per rank.
- DP_SPLIT: every batch-like argument (tensor, list, tuple, dict, dataclass) is split along dim 0 into
  `dp_size` chunks; rank r gets chunk `dp_rank(r)`, so TP/PP/CP peers of one DP replica receive the same chunk.
  Scalars are passed unchanged to every rank.

Collect modes: ALL (list in rank order), RANK0 (rank 0's result), DP_COLLECT (concatenate the results of
the one collect rank per DP replica, in dp order — e.g. TP rank 0 on the last PP stage).

The DP layout comes from the workers: a worker class defines `get_dp_info(self) -> DPInfo` (or a
`(dp_rank, dp_size, is_collect_rank)` tuple) once its parallel state is initialised. A class without it is
treated as pure data parallel (every rank its own replica). Pure Python: no Ray here, so worker classes can
import this module. Leaves out: the RPC itself (see `worker_group.py`) and batch (de)serialisation.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence, Union

from megarl.batch import TrainBatch
from megarl.controller.batch_split import concat_batches, split_batch

DP_INFO_METHOD = "get_dp_info"
_SPEC_ATTRIBUTE = "__megarl_method_spec__"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_SPLIT = "dp_split"


class Collect(enum.Enum):
    ALL = "all"
    RANK0 = "rank0"
    DP_COLLECT = "dp_collect"


TRAIN_BATCH_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainBatch))


@dataclass(frozen=True)
class MethodSpec:
    dispatch: Dispatch = Dispatch.ONE_TO_ALL
    collect: Collect = Collect.ALL
    # The TrainBatch fields the method reads; None: the method takes no batch (or all of it)
    reads: Optional[tuple[str, ...]] = None


DEFAULT_METHOD_SPEC = MethodSpec()
WorkerMethod = Union[str, Callable]  # a worker class's method (what the driver passes), or its name (tests)


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL, collect: Collect = Collect.ALL, *,
             reads: Optional[Sequence[str]] = None) -> Callable:
    """Declare a worker method's contract: how its arguments fan out, how its results come back and, for a
    method taking a :class:`~megarl.batch.TrainBatch`, the fields it reads (read by `WorkerGroup.call`)."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register(dispatch=...) needs a Dispatch member, got {dispatch!r}")
    if not isinstance(collect, Collect):
        raise TypeError(f"register(collect=...) needs a Collect member, got {collect!r}")
    if reads is not None:
        unknown = sorted(set(reads) - TRAIN_BATCH_FIELDS)
        if unknown:
            raise ValueError(f"register(reads=...): {unknown} are not TrainBatch fields "
                             f"(its fields: {sorted(TRAIN_BATCH_FIELDS)})")
        reads = tuple(reads)
    spec = MethodSpec(dispatch, collect, reads)

    def mark(method: Callable) -> Callable:
        setattr(method, _SPEC_ATTRIBUTE, spec)
        return method

    return mark


def method_spec(method: Callable) -> MethodSpec:
    """The contract ``method`` was declared with (:func:`register`), or the default one."""
    return getattr(method, _SPEC_ATTRIBUTE, DEFAULT_METHOD_SPEC)


def method_name_of(worker_cls: type, method: WorkerMethod) -> str:
    """The name to call ``method`` by on ``worker_cls``'s ranks. A method object must be one of
    ``worker_cls``'s own (its class or a base of it): another class's method of the same name is refused."""
    if isinstance(method, str):
        return method
    name = getattr(method, "__name__", None)
    if name is None or not any(vars(klass).get(name) is method for klass in worker_cls.__mro__):
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} is not a method of the worker class "
                        f"{worker_cls.__name__}")
    return name


def lookup_method_spec(worker_cls: type, method: WorkerMethod,
                       overrides: dict[str, MethodSpec] | None = None) -> MethodSpec:
    """Return the spec of `worker_cls`'s `method`: explicit override, then `@register`, then ONE_TO_ALL/ALL."""
    method_name = method_name_of(worker_cls, method)
    found = getattr(worker_cls, method_name, None)
    if found is None or not callable(found):
        public = sorted(name for name in dir(worker_cls) if not name.startswith("_") and callable(getattr(worker_cls, name)))
        raise AttributeError(f"{worker_cls.__name__} has no method {method_name!r}; its methods: {public}")
    if overrides and method_name in overrides:
        return overrides[method_name]
    return method_spec(found)


def shipped(batch: TrainBatch, reads: Sequence[str]) -> TrainBatch:
    """``batch`` with the fields not in ``reads`` set to None (no copy of the tensors it keeps)."""
    return dataclasses.replace(batch, **{name: None for name in TRAIN_BATCH_FIELDS if name not in reads})


def ship_reads(spec: MethodSpec, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with every TrainBatch cut to the fields the method declared it reads."""
    if spec.reads is None:
        return args, kwargs

    def cut(value: Any) -> Any:
        return shipped(value, spec.reads) if isinstance(value, TrainBatch) else value

    return tuple(cut(v) for v in args), {name: cut(v) for name, v in kwargs.items()}


class RankGroup(Protocol):
    """What the driver's role facades need of a worker group (Ray's :class:`WorkerGroup` or the in-process
    one): call a worker method on every rank, by the method itself."""

    world_size: int

    def call(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> Any: ...

    def call_async(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def dp_layout(self) -> "DPLayout": ...


class DPInfo(NamedTuple):
    dp_rank: int
    dp_size: int
    is_collect_rank: bool


@dataclass(frozen=True)
class DPLayout:
    """Data-parallel position of every rank of a worker group (index = global rank)."""

    dp_ranks: tuple[int, ...]
    dp_size: int
    collect_ranks: tuple[int, ...]  # global rank of the collect rank of DP replica 0, 1, ...

    @classmethod
    def from_infos(cls, infos: Sequence[DPInfo | tuple], *, group_name: str = "worker group") -> "DPLayout":
        """Validate the per-rank reports and build the layout; every DP replica needs exactly one collect rank."""
        if not infos:
            raise ValueError(f"{group_name}: no ranks reported DP info")
        parsed = []
        for rank, info in enumerate(infos):
            try:
                dp_rank, dp_size, is_collect = info
            except (TypeError, ValueError) as err:
                raise ValueError(f"{group_name}: rank {rank} {DP_INFO_METHOD}() returned {info!r}, "
                                 "expected (dp_rank, dp_size, is_collect_rank)") from err
            parsed.append(DPInfo(int(dp_rank), int(dp_size), bool(is_collect)))
        sizes = {info.dp_size for info in parsed}
        if len(sizes) != 1:
            raise ValueError(f"{group_name}: ranks disagree on dp_size: {[info.dp_size for info in parsed]}")
        dp_size = sizes.pop()
        if dp_size < 1 or len(parsed) % dp_size != 0:
            raise ValueError(f"{group_name}: dp_size {dp_size} does not divide world size {len(parsed)}")
        collect_ranks: list[int | None] = [None] * dp_size
        members = [0] * dp_size
        for rank, info in enumerate(parsed):
            if not 0 <= info.dp_rank < dp_size:
                raise ValueError(f"{group_name}: rank {rank} reports dp_rank {info.dp_rank} outside [0, {dp_size})")
            members[info.dp_rank] += 1
            if info.is_collect_rank:
                if collect_ranks[info.dp_rank] is not None:
                    raise ValueError(f"{group_name}: DP replica {info.dp_rank} has two collect ranks "
                                     f"({collect_ranks[info.dp_rank]} and {rank})")
                collect_ranks[info.dp_rank] = rank
        expected = len(parsed) // dp_size
        for dp_rank in range(dp_size):
            if members[dp_rank] != expected:
                raise ValueError(f"{group_name}: DP replica {dp_rank} has {members[dp_rank]} ranks, expected {expected}")
            if collect_ranks[dp_rank] is None:
                raise ValueError(f"{group_name}: DP replica {dp_rank} has no collect rank")
        return cls(tuple(info.dp_rank for info in parsed), dp_size, tuple(collect_ranks))  # type: ignore[arg-type]

    @classmethod
    def pure_data_parallel(cls, world_size: int) -> "DPLayout":
        return cls(tuple(range(world_size)), world_size, tuple(range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.dp_ranks)


RankArgs = tuple[tuple[Any, ...], dict[str, Any]]


def plan_dispatch(
    dispatch: Dispatch,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    world_size: int,
    layout: DPLayout | None = None,
    method_name: str = "method",
) -> list[RankArgs]:
    """Return the (args, kwargs) each rank receives. DP_SPLIT needs `layout`.

    DP chunks are shared objects: ranks of the same DP replica get the very same chunk object, so the caller
    can put each chunk into the object store once.
    """
    if dispatch is Dispatch.ONE_TO_ALL:
        return [(args, kwargs)] * world_size
    if dispatch is Dispatch.ALL_TO_ALL:
        for position, value in enumerate(args):
            _check_per_rank(value, world_size, f"{method_name}: positional argument {position}")
        for name, value in kwargs.items():
            _check_per_rank(value, world_size, f"{method_name}: argument {name!r}")
        return [
            (tuple(value[rank] for value in args), {name: value[rank] for name, value in kwargs.items()})
            for rank in range(world_size)
        ]
    if dispatch is Dispatch.DP_SPLIT:
        if layout is None:
            raise ValueError(f"{method_name}: DP_SPLIT needs the DP layout of the group")
        if layout.world_size != world_size:
            raise ValueError(f"{method_name}: DP layout covers {layout.world_size} ranks, group has {world_size}")
        split_args = [_split_or_broadcast(value, layout.dp_size, f"{method_name}: positional argument {i}")
                      for i, value in enumerate(args)]
        split_kwargs = {name: _split_or_broadcast(value, layout.dp_size, f"{method_name}: argument {name!r}")
                        for name, value in kwargs.items()}
        per_replica = [
            (tuple(chunks[d] for chunks in split_args), {name: chunks[d] for name, chunks in split_kwargs.items()})
            for d in range(layout.dp_size)
        ]
        return [per_replica[layout.dp_ranks[rank]] for rank in range(world_size)]
    raise ValueError(f"unknown dispatch mode {dispatch!r}")


def _check_per_rank(value: Any, world_size: int, label: str) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"{label}: ALL_TO_ALL needs a list with one entry per rank ({world_size}), got {got}")


def _split_or_broadcast(value: Any, dp_size: int, label: str) -> list[Any]:
    if isinstance(value, (int, float, str, bool, bytes, type(None))):
        return [value] * dp_size
    return split_batch(value, dp_size, path=label)


def collect_results(collect: Collect, results: list[Any], *, layout: DPLayout | None = None,
                    method_name: str = "method") -> Any:
    """Combine the per-rank results (index = global rank) according to `collect`."""
    if collect is Collect.ALL:
        return list(results)
    if collect is Collect.RANK0:
        return results[0]
    if collect is Collect.DP_COLLECT:
        if layout is None:
            raise ValueError(f"{method_name}: DP_COLLECT needs the DP layout of the group")
        return concat_batches([results[rank] for rank in layout.collect_ranks], path=f"{method_name} result")
    raise ValueError(f"unknown collect mode {collect!r}")
