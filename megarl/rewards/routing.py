"""Which scorer handles which `data_source`: default tables of "module:function" strings (exact names, and
name prefixes such as `aime*`), resolved lazily. The defaults cover every data_source verl's default scorer
routes except its code-execution ones (`codecontests`, `apps`, `codeforces`, `taco`).

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
# A final "Answer: ..." line (DAPO's prompt asks for it) or the last \boxed{}, whichever comes last.
MATH_ANSWER = "megarl.rewards.boxed_math:score_math_answer"
SYNTHETIC_DIGITS = "megarl.rewards.synthetic_task:score_digits"
SYNTHETIC_SHAPES = "megarl.rewards.synthetic_task:score_shapes"

# Every data_source that verl's default scorer routes, to the scorer of the same kind here.
DEFAULT_ROUTES: dict[str, str] = {
    "openai/gsm8k": GSM8K,
    "gsm8k": GSM8K,
    "math": MATH_ANSWER,
    "lighteval/MATH": BOXED_MATH,
    "DigitalLearningGmbH/MATH-lighteval": BOXED_MATH,
    "HuggingFaceH4/MATH-500": BOXED_MATH,
    "hiyouga/geometry3k": BOXED_MATH,
    "math_dapo": MATH_ANSWER,
    "math_dapo_reasoning": MATH_ANSWER,
    "synthetic/digits": SYNTHETIC_DIGITS,
    "synthetic/shapes": SYNTHETIC_SHAPES,  # megarl.data.shapes_task: one word or number, bare or boxed
}
# Families named by a prefix, as verl does (``aime2024``, ``aime_2025``, ``numina_olympiads``, ...).
DEFAULT_PREFIX_ROUTES: dict[str, str] = {
    "aime": MATH_ANSWER,
    "numina_": MATH_ANSWER,
}
# verl scores these by running the response's code against test cases; megarl has no built-in sandbox.
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CUSTOM_SCORER_HINT = ("set reward_model.custom_function.path=<file.py> (and .name=<function>, called as "
                      "fn(data_source, solution_str, ground_truth, extra_info) -> float) to score it yourself")

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
    """data_source -> scorer: caller entries, then ``DEFAULT_ROUTES``, then the longest matching prefix of
    ``DEFAULT_PREFIX_ROUTES``; imports on first use."""

    def __init__(self, routes: Mapping[str, str | ScorerFn] | None = None, *, use_defaults: bool = True):
        self._routes: dict[str, str | ScorerFn] = dict(DEFAULT_ROUTES) if use_defaults else {}
        self._routes.update(routes or {})
        self._prefixes: dict[str, str | ScorerFn] = dict(DEFAULT_PREFIX_ROUTES) if use_defaults else {}
        self._resolved: dict[str, ScorerFn] = {}

    def known_sources(self) -> list[str]:
        return sorted(self._routes) + sorted(f"{prefix}*" for prefix in self._prefixes)

    def _target(self, data_source: str) -> str | ScorerFn | None:
        if data_source in self._routes:
            return self._routes[data_source]
        prefixes = [p for p in self._prefixes if data_source.startswith(p)]
        return self._prefixes[max(prefixes, key=len)] if prefixes else None

    def check_known(self, data_source: str, index: int | None = None) -> None:
        if self._target(data_source) is None:
            where = "" if index is None else f" (sample {index})"
            if data_source in CODE_SOURCES:
                raise ValueError(f"data_source {data_source!r}{where} is scored by running code against tests, "
                                 f"which megarl does not build in; {CUSTOM_SCORER_HINT}")
            raise ValueError(
                f"no reward scorer for data_source {data_source!r}{where}; known: {', '.join(self.known_sources())}"
                f"; {CUSTOM_SCORER_HINT}"
            )

    def scorer_name(self, data_source: str) -> str:
        target = self._target(data_source)
        return target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))

    def scorer_for(self, data_source: str) -> ScorerFn:
        self.check_known(data_source)
        if data_source not in self._resolved:
            self._resolved[data_source] = resolve_scorer(self._target(data_source))
        return self._resolved[data_source]
