"""Drafters by name. One protocol and a registry, so the engine never branches on a drafter's kind.

``create_drafter("ngram", max_ngram=3)`` builds a drafter from the default registry (the built-ins
plus anything added with ``register_drafter``). A ``Registry`` can also be built on its own, e.g. one
per deployment or per test, so that registrations do not leak between them.

``merge:a+b`` names the merge of registered drafters ``a`` and ``b`` (``workers.drafters.merge``);
options go to each part by name: ``create_drafter("merge:ngram+suffix", suffix={"min_prob": 0.2})``.
``names()`` lists the registered drafters plus the merges in ``LISTED_MERGES`` whose parts are
registered; ``knows(name)`` accepts any valid merge.

A name that is a model directory (it holds config.json) is a model drafter
(``workers.drafters.model``): ``create_drafter("/path/to/draft", mode="widths")``; it can be part
of a merge too (``merge:ngram+/path/to/draft``: SpecInfer's small model plus prompt lookup).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from workers.drafters.base import Drafter, NoneDrafter
from workers.drafters.merge import MergeDrafter
from workers.contract import TapSpec
from workers.drafters.neural.draft_model import read_spec
from workers.drafters.memory import load_draft
from workers.drafters.model import is_model_dir
from workers.drafters.ngram import NgramDrafter
from workers.drafters.suffix import SuffixDrafter

__all__ = ["DrafterFactory", "BUILTIN_DRAFTERS", "LISTED_MERGES", "MERGE_PREFIX", "Registry", "register_drafter",
           "create_drafter", "drafter_names", "is_drafter_name", "taps_of"]

DrafterFactory = Callable[..., Drafter]


def _ngram(**options) -> NgramDrafter:
    # One-token matches too (min_ngram=1): since a few tree nodes cost next to nothing (the lean
    # forward prices a handful of rows about as one) and the speculation controller sizes each
    # request's tree by its acceptance, drafting right after the text diverges from the prompt
    # pays. Measured with the engine alone, min_ngram 2 against 1: fewer steps and less time on
    # copy, extract and chat (README.md, "Drafters, draft models and workloads").
    return NgramDrafter(**{"min_ngram": 1, **options})


def _grammar(grammars=None, **options) -> Drafter:
    # Imported here: the grammar engine takes a second to import, and only constrained requests
    # need it. It drafts from the tokenizer's compiled grammars, which the runtime owns.
    if grammars is None:
        raise ValueError("the grammar drafter needs the tokenizer's grammars (workers.speculation.grammar.Grammars); "
                         "BatchWorker adds it to constrained requests' drafters by itself")
    from workers.drafters.grammar import GrammarDrafter

    return GrammarDrafter(grammars, **options)


BUILTIN_DRAFTERS: Mapping[str, DrafterFactory] = {
    "none": NoneDrafter,
    "ngram": _ngram,
    "suffix": SuffixDrafter,
    "grammar": _grammar,
}

MERGE_PREFIX = "merge:"
# Merges listed by names() (so that name checks against the list accept them), when their parts are.
LISTED_MERGES: tuple[str, ...] = ("merge:ngram+suffix",)


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

    def create(self, name: str, *, device: str | torch.device | None = None, **options: object) -> Drafter:
        """`device`: where a drafter that runs a model keeps its weights, KV and tensors (a model
        directory, alone or in a merge; None: 'auto', workers/model/device.py); a `BatchWorker` passes its
        verifier's. Drafters that run no model take no device."""
        factory = self._factories.get(name)
        if factory is not None:
            return factory(**options)
        if is_model_dir(name):
            return load_draft(name, device=device if device is not None else "auto", **options)
        parts = self._merge_parts(name)
        for key in options:
            if key not in parts:
                raise ValueError(f"drafter {name!r}: option {key!r} names none of its parts {parts}")
        return MergeDrafter([self.create(p, device=device, **dict(options.get(p) or {})) for p in parts],
                            name=name)

    def names(self) -> list[str]:
        return sorted([*self._factories, *(m for m in LISTED_MERGES if self.knows(m))])

    def knows(self, name: str) -> bool:
        """Whether ``create(name)`` can build it: a registered name or a merge of registered names."""
        if name in self._factories or is_model_dir(name):
            return True
        try:
            self._merge_parts(name)
        except ValueError:
            return False
        return True

    def _merge_parts(self, name: str) -> list[str]:
        """The parts of ``merge:a+b+...`` (≥ 2, distinct, registered); ValueError for anything else."""
        if not name.startswith(MERGE_PREFIX):
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(self.names())}")
        parts = name[len(MERGE_PREFIX):].split("+")
        if len(parts) < 2 or len(set(parts)) != len(parts):
            raise ValueError(f"drafter {name!r}: a merge names 2 or more distinct drafters, as in merge:ngram+suffix")
        for p in parts:
            if p not in self._factories and not is_model_dir(p):
                raise ValueError(f"drafter {name!r}: unknown part {p!r}; available: {', '.join(sorted(self._factories))}")
        return parts


# The process-wide registry of factories (no other state): what deployment configs name.
_DEFAULT = Registry()


def register_drafter(name: str, factory: DrafterFactory, *, replace: bool = False) -> None:
    _DEFAULT.register(name, factory, replace=replace)


def create_drafter(name: str, *, device: str | torch.device | None = None, **options: object) -> Drafter:
    return _DEFAULT.create(name, device=device, **options)


def drafter_names() -> list[str]:
    return _DEFAULT.names()


def is_drafter_name(name: str) -> bool:
    return _DEFAULT.knows(name)


def taps_of(name: str) -> TapSpec | None:
    """The target taps a drafter name reads, without loading it: a feedback-memory draft's
    directory, or a merge holding one (for a verifier whose drafters run elsewhere: Ray mode's
    replicas, gateway/ray_serve/draft_pool.py)."""
    parts = name[len(MERGE_PREFIX):].split("+") if name.startswith(MERGE_PREFIX) else [name]
    for part in parts:
        if is_model_dir(part):
            spec = read_spec(part)
            if spec.memory_layers:
                return TapSpec(spec.memory_layers, spec.sink, spec.window)
    return None
