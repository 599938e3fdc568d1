"""torch.compile'd twins of small memory-bound functions, used on CUDA, with the eager function as fallback.

On an H200 the eager forms of the model's small pieces (RMSNorm, the log-prob of a chunk of logits) are ~10
elementwise kernels each, every one a full pass over fp32 temporaries; Inductor fuses each into one or two
kernels. Twins are made once per function (automatic dynamic shapes: the token count varies by micro-batch,
the hidden size does not). ``MEGARL_COMPILE=0`` turns every twin off; a compile failure warns once and runs the
eager function for the rest of the process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, Iterator

import torch

_twins: dict[Callable, Callable] = {}
_failed: set[Callable] = set()


def compile_wanted(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("MEGARL_COMPILE", "1") != "0"


def call(eager: Callable, device: torch.device, *args):
    """``eager(*args)``, through its compiled twin where that is wanted (CUDA) and has not failed."""
    if eager in _failed or not compile_wanted(device):
        return eager(*args)
    twin = _twins.get(eager)
    if twin is None:
        twin = _twins[eager] = torch.compile(eager)
    try:
        return twin(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager function is still correct
        warnings.warn(f"torch.compile of {eager.__qualname__} failed ({type(exc).__name__}: {exc}); using the "
                      f"eager function", RuntimeWarning)
        _failed.add(eager)
        return eager(*args)


@contextlib.contextmanager
def eager_only(*functions: Callable) -> Iterator[None]:
    """Within the block, ``functions`` run eager (benchmarks measure what their twins gain in one process)."""
    newly = set(functions) - _failed
    _failed.update(newly)
    try:
        yield
    finally:
        _failed.difference_update(newly)
