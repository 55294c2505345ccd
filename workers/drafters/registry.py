"""Drafters by name. One protocol and a registry, so the engine never branches on a drafter's kind.

``create_drafter("ngram", max_ngram=3)`` builds a drafter from the default registry (the built-ins
plus anything added with ``register_drafter``). A ``Registry`` can also be built on its own, e.g. one
per deployment or per test, so that registrations do not leak between them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from workers.drafters.base import Drafter, NoneDrafter
from workers.drafters.ngram import NgramDrafter

__all__ = ["DrafterFactory", "BUILTIN_DRAFTERS", "Registry", "register_drafter", "create_drafter", "drafter_names"]

DrafterFactory = Callable[..., Drafter]


def _ngram(**options) -> NgramDrafter:
    # One-token matches are nearly always wrong on free text, and a wrong tree is not free.
    return NgramDrafter(**{"min_ngram": 2, **options})


BUILTIN_DRAFTERS: Mapping[str, DrafterFactory] = {
    "none": NoneDrafter,
    "ngram": _ngram,
}


class Registry:
    """Name → drafter factory. Factories take the drafter's options as keyword arguments."""

    def __init__(self, factories: Optional[Mapping[str, DrafterFactory]] = None) -> None:
        self._factories: dict[str, DrafterFactory] = dict(BUILTIN_DRAFTERS if factories is None else factories)

    def register(self, name: str, factory: DrafterFactory, *, replace: bool = False) -> None:
        if not name:
            raise ValueError("a drafter needs a non-empty name")
        if name in self._factories and not replace:
            raise ValueError(f"drafter {name!r} is already registered (pass replace=True to override)")
        self._factories[name] = factory

    def create(self, name: str, **options: object) -> Drafter:
        factory = self._factories.get(name)
        if factory is None:
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(self.names())}")
        return factory(**options)

    def names(self) -> list[str]:
        return sorted(self._factories)


# The process-wide registry of factories (no other state): what deployment configs name.
_DEFAULT = Registry()


def register_drafter(name: str, factory: DrafterFactory, *, replace: bool = False) -> None:
    _DEFAULT.register(name, factory, replace=replace)


def create_drafter(name: str, **options: object) -> Drafter:
    return _DEFAULT.create(name, **options)


def drafter_names() -> list[str]:
    return _DEFAULT.names()
