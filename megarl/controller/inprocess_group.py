"""A one-rank worker group that runs the worker in the driver process, without Ray.

Same calling surface as :class:`megarl.controller.worker_group.WorkerGroup` (``call``, ``world_size``,
``shutdown``) and the same dispatch/collect rules, for a world of size 1. It exists for machines where Ray
is not installed (the lent GPU box) and for stepping through a whole training step in one debugger. It
leaves out everything that needs more than one process.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from megarl.controller.device_oom import naming_out_of_memory
from megarl.controller.profiling import stage_range
from megarl.controller.dispatch import (DPLayout, WorkerMethod, collect_results, lookup_method_spec, method_name_of,
                                       plan_dispatch, ship_reads)
from megarl.controller.worker_env import ENV_DEVICE, ENV_GROUP_NAME, ENV_LOCAL_DEVICE, ENV_POOL_NODE


class InProcessWorkerGroup:
    world_size = 1

    def __init__(self, worker_cls: type, *, device: str, init_kwargs: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, name_prefix: str | None = None):
        self.name = name_prefix or worker_cls.__name__
        self.worker_cls = worker_cls
        rank_env = {
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", ENV_DEVICE: device,
            ENV_LOCAL_DEVICE: "0" if device == "cuda" else "", ENV_GROUP_NAME: self.name, ENV_POOL_NODE: "0",
            **dict(env or {}),
        }
        if "MASTER_PORT" not in os.environ or os.environ.get(ENV_GROUP_NAME) is None:
            from megarl.engines.megatron.parallel import bind_rendezvous_store

            rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(bind_rendezvous_store()))
        # restored by shutdown(): a process started later from this one must not inherit a dead group's port
        self._saved_env = {key: os.environ.get(key) for key in rank_env}
        os.environ.update(rank_env)
        try:
            with naming_out_of_memory("construct", 0):
                self.worker = worker_cls(**dict(init_kwargs or {}))
        except BaseException:
            # A half-built worker may have joined torch.distributed; leave the process as it found it.
            from megarl.engines.megatron.parallel import destroy_megatron_parallel

            destroy_megatron_parallel()
            self._restore_env()
            raise
        self.dp_layout = DPLayout.pure_data_parallel(1)

    def call(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> Any:
        method_name = method_name_of(self.worker_cls, method)
        spec = lookup_method_spec(self.worker_cls, method_name)
        args, kwargs = ship_reads(spec, args, kwargs)
        ((rank_args, rank_kwargs),) = plan_dispatch(spec.dispatch, args, kwargs, world_size=1, layout=self.dp_layout,
                                                     method_name=f"{self.name}.{method_name}")
        with naming_out_of_memory(method_name, 0), stage_range(method_name):
            result = getattr(self.worker, method_name)(*rank_args, **rank_kwargs)
        return collect_results(spec.collect, [result], layout=self.dp_layout, method_name=method_name)

    def call_async(self, method: WorkerMethod, *args: Any, **kwargs: Any) -> "CompletedCall":
        """:meth:`call`, run now (one process has nothing to overlap with); ``.get()`` returns its result."""
        return CompletedCall(self.call(method, *args, **kwargs))

    def shutdown(self) -> None:
        """Release what the worker holds, including torch.distributed, so another run can start here."""
        if self.worker is not None and hasattr(self.worker, "close"):
            self.worker.close()
        self.worker = None
        self._restore_env()

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}


class CompletedCall:
    """The in-process group's answer to ``call_async``: already done."""

    def __init__(self, result: Any):
        self._result = result

    def get(self) -> Any:
        return self._result
