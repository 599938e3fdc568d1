"""Keeps two costs of importing megatron-core out of megarl's processes: its optional wandb import, and the
import of torch's compiler stack that its ``jit_fuser`` decorator triggers.

* megatron-core's ``__init__`` imports its timers and its inference engine, whose modules ``try: import wandb``
  (and the timers ``torch.utils.tensorboard``) at import time, for timer and inference metrics megarl never sends
  there (megarl's trackers log from the driver). With wandb installed (the ``[trackers]`` extra, and most verl
  users' environments) that costs every process that imports megatron 0.8-1.7 s (measured on the CI machine:
  4.05-4.91 s with it, 3.16-3.29 s without), tensorboard's writer another 0.3-0.5 s. While exactly those modules
  execute, those imports fail as if the packages were not installed; everywhere else, the driver's trackers
  included, they import as usual.
* ``megatron.core.jit.jit_fuser`` is ``torch.compile``, applied as a decorator to a few dozen small functions
  when their modules are imported; the first ``torch.compile(fn)`` imports torch's dynamo and inductor (2-3.5 s
  on the CI machine) although nothing is compiled until a decorated function is called, and most of them are
  never called in a given run (fusions megarl leaves off, architectures it is not running). megarl's
  ``jit_fuser`` decorates the same way and calls ``torch.compile`` on a function's first call instead: the same
  compiled function from then on, and the compiler stack is imported only by a process that needs it.

Every Ray worker and every rank of a test imports megatron; these are seconds of each one's start.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

# megatron module -> the optional imports it tries at import time that megarl's processes go without
MEGATRON_OPTIONAL_IMPORTS_SKIPPED = {
    "megatron.core.timers": ("wandb", "torch.utils.tensorboard"),
    "megatron.core.inference.contexts.dynamic_context": ("wandb",),
    "megatron.core.inference.engines.dynamic_engine": ("wandb",),
}
MEGATRON_JIT_MODULE = "megatron.core.jit"


def compile_on_first_call(fn: Callable | None = None, **compile_kwargs: Any) -> Callable:
    """``torch.compile`` as a decorator (bare or with keyword arguments) that compiles at the first call."""
    if fn is None:
        return functools.partial(compile_on_first_call, **compile_kwargs)
    compiled: Callable | None = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        import torch

        if torch.compiler.is_compiling():  # traced inside another compiled function: inline it, as dynamo does
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, **compile_kwargs)
        return compiled(*args, **kwargs)

    run.compile_on_first_call = True
    return run


def _without(packages: tuple[str, ...], exec_module: Callable) -> None:
    skipped = [name for name in packages if name not in sys.modules]  # one already imported costs nothing more
    for name in skipped:
        sys.modules[name] = None  # an ImportError for `import <name>` while this module executes
    try:
        exec_module()
    finally:
        for name in skipped:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


class _GuardedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str):
        self.loader = loader
        self.name = name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self.name == MEGATRON_JIT_MODULE:
            self.loader.exec_module(module)
            import torch

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = compile_on_first_call
        else:
            _without(MEGATRON_OPTIONAL_IMPORTS_SKIPPED[self.name], lambda: self.loader.exec_module(module))


class _MegatronImportGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MEGATRON_JIT_MODULE and name not in MEGATRON_OPTIONAL_IMPORTS_SKIPPED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _GuardedLoader(spec.loader, name)
        return spec


def install() -> None:
    if not any(isinstance(finder, _MegatronImportGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MegatronImportGuard())
