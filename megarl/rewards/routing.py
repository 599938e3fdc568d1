"""Which scorer handles which `data_source`: a default table of "module:function" strings, resolved lazily.

Lazy resolution means a scorer module (e.g. the synthetic task, owned by the data package) only has to exist
when a sample of its data source is scored. Built-in scorers take `(solution_str, ground_truth) -> float`.
Leaves out: the custom per-batch function, which replaces routing altogether (see `manager.py`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Callable

GSM8K = "megarl.rewards.gsm8k:score_gsm8k"
BOXED_MATH = "megarl.rewards.boxed_math:score_boxed_math"
SYNTHETIC_DIGITS = "megarl.rewards.synthetic_task:score_digits"

DEFAULT_ROUTES: dict[str, str] = {
    "openai/gsm8k": GSM8K,
    "gsm8k": GSM8K,
    "math": BOXED_MATH,
    "lighteval/MATH": BOXED_MATH,
    "DigitalLearningGmbH/MATH-lighteval": BOXED_MATH,
    "math_dapo": BOXED_MATH,
    "synthetic/digits": SYNTHETIC_DIGITS,
}

ScorerFn = Callable[[str, str], float]


def resolve_scorer(target: str | ScorerFn) -> ScorerFn:
    """A callable as-is, or import "package.module:function"."""
    if callable(target):
        return target
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"scorer reference must look like 'package.module:function', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import scorer module {module_name!r} for {target!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AttributeError(f"scorer {target!r}: module {module_name!r} has no callable {attr!r}")
    return fn


class ScorerRouter:
    """data_source -> scorer, with caller entries layered over `DEFAULT_ROUTES`; imports on first use."""

    def __init__(self, routes: Mapping[str, str | ScorerFn] | None = None, *, use_defaults: bool = True):
        self._routes: dict[str, str | ScorerFn] = dict(DEFAULT_ROUTES) if use_defaults else {}
        self._routes.update(routes or {})
        self._resolved: dict[str, ScorerFn] = {}

    def known_sources(self) -> list[str]:
        return sorted(self._routes)

    def check_known(self, data_source: str, index: int | None = None) -> None:
        if data_source not in self._routes:
            where = "" if index is None else f" (sample {index})"
            raise ValueError(
                f"no reward scorer for data_source {data_source!r}{where}; known: {', '.join(self.known_sources())}"
                " (add a route or pass a custom reward function)"
            )

    def scorer_name(self, data_source: str) -> str:
        target = self._routes[data_source]
        return target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))

    def scorer_for(self, data_source: str) -> ScorerFn:
        self.check_known(data_source)
        if data_source not in self._resolved:
            self._resolved[data_source] = resolve_scorer(self._routes[data_source])
        return self._resolved[data_source]
