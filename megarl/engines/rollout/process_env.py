"""Environment variables set while a rollout engine starts: the engines read several at construction only (vLLM's
in-process engine core, its model runner; the GPUs SGLang's worker processes see), and this process's own
environment must be as it was afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment_set(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ inside the block; each variable back to its value (or unset) after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
