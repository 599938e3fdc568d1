"""A one-entry cache keyed by a tensor's identity and version.

Every attention layer of a forward receives the same mask / ``cu_seqlens`` tensor; what is derived from
it (a prepared mask, host-side bounds) is computed for the first layer and reused by the others. The
entry holds a weak reference, so the cache never keeps a micro-batch alive, and the tensor's ``_version``
so an in-place change is noticed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


class LastTensorMemo:
    def __init__(self):
        self._ref, self._version, self._value = None, -1, None

    def get(self, tensor: torch.Tensor, compute: Callable[[], Any]) -> Any:
        """``compute()`` for ``tensor``, or the value stored for it when ``tensor`` is the one seen last."""
        if self._ref is not None and self._ref() is tensor and self._version == tensor._version:
            return self._value
        value = compute()
        self._ref, self._version, self._value = weakref.ref(tensor), tensor._version, value
        return value
