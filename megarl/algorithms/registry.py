"""Name -> function registries for the algorithm layer.

One small `Registry` class backs every family (advantage estimators, policy losses, KL estimators), so the
trainer can pick an implementation from a config string and a typo fails with the list of valid names.
Leaves out: any notion of config objects; callers pass plain names.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions of one family (the family name appears in errors)."""

    def __init__(self, family: str):
        self.family = family
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding `fn` under `name`; registering a taken name is an error, not an override."""

        def add(fn: F) -> F:
            if name in self._table:
                raise ValueError(f"{self.family} {name!r} is already registered (by {self._table[name].__qualname__})")
            self._table[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.family} {name!r}; registered: {', '.join(sorted(self._table))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        return name in self._table
