"""Keeps megatron-core's optional wandb import out of megarl's processes.

megatron-core's ``__init__`` imports its timers and its inference engine, whose modules below ``try: import
wandb`` at import time, for timer and inference metrics megarl never sends there (megarl's trackers log from the
driver). With wandb installed (the ``[trackers]`` extra, and most verl
users' environments) that costs every process that imports megatron 0.8-1.7 s (measured on the CI machine:
4.05-4.91 s with it, 3.16-3.29 s without), every Ray worker and every rank of a test included. While exactly
those modules execute, ``import wandb`` fails as if it were not installed; everywhere else, the driver's
trackers included, wandb imports as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MEGATRON_MODULES_WITHOUT_WANDB = frozenset({
    "megatron.core.timers",
    "megatron.core.inference.contexts.dynamic_context",
    "megatron.core.inference.engines.dynamic_engine",
})


class _ExecWithoutWandb(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        sys.modules["wandb"] = None  # an ImportError for `import wandb` while this module executes
        try:
            self.loader.exec_module(module)
        finally:
            if "wandb" in sys.modules and sys.modules["wandb"] is None:
                del sys.modules["wandb"]


class _MegatronWithoutWandb(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in MEGATRON_MODULES_WITHOUT_WANDB or "wandb" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ExecWithoutWandb(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(finder, _MegatronWithoutWandb) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MegatronWithoutWandb())
