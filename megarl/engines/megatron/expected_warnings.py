"""Warnings every run on a machine without Transformer Engine and apex prints, many times over (once per import
per process): megatron-core says it falls back to torch's norms, optimizers and multi-tensor helpers, which is
what megarl runs on such a machine. They are hidden (in the driver by :func:`hide_expected_warnings`, in the
workers through ``PYTHONWARNINGS``, :func:`python_warnings_env`) and explained once by the driver
(:func:`explanation`). Anything else megatron says still shows.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Optional

# The start of each message, as warnings' filters match it.
EXPECTED = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
    "full scope is deprecated. Use empty cuda_graph_scope",  # megatron-core's own default, not a user setting
)


def hide_expected_warnings() -> None:
    for start in EXPECTED:
        warnings.filterwarnings("ignore", message=re.escape(start), category=UserWarning)


def python_warnings_env(existing: Optional[str] = None) -> str:
    """``PYTHONWARNINGS`` that hides the expected warnings in a new interpreter (kept: what was set before)."""
    ours = ",".join(f"ignore:{start}:UserWarning" for start in EXPECTED)
    return f"{existing},{ours}" if existing else ours


def explanation() -> Optional[str]:
    """One line for the start of a run when megatron-core runs without Transformer Engine / apex."""
    missing = [name for name in ("transformer_engine", "apex") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"megatron-core runs without {' and '.join(missing)} here: torch's norms, Adam and multi-tensor helpers "
            f"(expected; its warnings saying so are hidden)")
