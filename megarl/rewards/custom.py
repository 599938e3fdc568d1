"""Load a user reward function from a Python file path.

The function must be callable as `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`;
a dict must carry "score" and its other keys become extra metrics (see `manager.py`).
Leaves out: sandboxing; the file runs with the trainer's privileges like any other code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

CustomRewardFn = Callable[[str, str, str, dict], "float | dict"]


def load_custom_reward_fn(path: str | Path, name: str = "compute_score") -> CustomRewardFn:
    """Import the file at `path` (under a unique module name, so two files with the same stem do not collide)
    and return its attribute `name`; errors name the file and the function."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"custom reward file not found: {path}")
    module_name = f"megarl_custom_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import custom reward file {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses/pickling inside the file look themselves up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ImportError(f"error while importing custom reward file {path}: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(f"custom reward file {path} has no function {name!r}; callables there: {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in custom reward file {path} is a {type(fn).__name__}, not a function")
    return fn
