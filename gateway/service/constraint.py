"""A request's constraint (structured outputs, a forced tool call) checked before it is admitted:
its size and shape first, then one bounded compile, then its grammar held for the request.

    caps      the parsed schema against `SchemaCaps` (workers/speculation/schema_caps.py): 400
              `schema_too_complex` naming the cap, before any compile;
    hit       a grammar compiled already is pinned and costs nothing more;
    tenant    a miss counts against the tenant's compiles in flight (`compiles_per_tenant`): one
              more is a 429 `compile_concurrency_exceeded`, so one tenant holds at most that many
              of the compile processes, each for at most the time limit;
    compile   in a compile process (workers/speculation/compile_pool.py), identical compiles in
              flight shared: past the time limit a 400 `schema_too_complex`; every process busy
              past it a 503 `grammar_compiler_busy` with Retry-After; the engine's refusal a 400
              in our words (its own are logged here, never sent).

Why a cap on concurrent compiles and not compile seconds charged to the tenant's token budget:
what one tenant's compiles take from the others is the pool's processes, and a count of them is
that share directly, checked in this process before the compile, with no round trip to the
limiter's store after it; the time limit bounds how long each is held.

The pin is kept as long as the request object lives (`hold_for`), through its queueing and every
prefill (an evicted request is prefilled again), so the step loop never compiles it.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from gateway import errors
from gateway.settings import Settings
from workers.speculation.constraints import (CompilerBusy, ConstraintError, SchemaTooComplex)
from workers.speculation.schema_caps import SchemaCaps

log = logging.getLogger(__name__)

PARAM = "response_format"


@dataclass(frozen=True)
class GrammarLimits:
    """What a schema may ask of this process's compiler (gateway/settings.py names each)."""
    caps: SchemaCaps = field(default_factory=SchemaCaps)
    compile_timeout_s: float = 5.0
    compile_workers: int = 2
    compiles_per_tenant: int = 1
    max_shipped_bytes: int = 16 * 2**20

    @classmethod
    def from_settings(cls, s: Settings) -> "GrammarLimits":
        caps = SchemaCaps(max_bytes=s.schema_max_bytes, max_depth=s.schema_max_depth,
                          max_properties=s.schema_max_properties, max_enum_values=s.schema_max_enum_values,
                          max_enum_chars=s.schema_max_enum_chars, max_pattern_chars=s.schema_max_pattern_chars,
                          max_repeat=s.schema_max_repeat, max_items=s.schema_max_items)
        return cls(caps, s.grammar_compile_timeout_s, s.grammar_compile_workers,
                   s.grammar_compiles_per_tenant, int(s.grammar_max_shipped_mb * 2**20))


class ConstraintCheck:
    def __init__(self, tokenizer: Any, vocab: int, stop_token_ids: Sequence[int], *,
                 grammars: Any = None, limits: GrammarLimits | None = None) -> None:
        """`grammars`: the tokenizer's compiled constraints (workers.speculation.grammars.Grammars),
        the worker's own when it runs in this process, so each schema compiles once; None: built
        from the tokenizer at the first constrained request."""
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.stop_token_ids = tuple(stop_token_ids)
        self.limits = limits or GrammarLimits()
        self._grammars = grammars
        if grammars is not None:          # a model's own: its processes start now, not at the
            self._bound(grammars).warm()  # first constrained request (which would wait seconds)
        self._compiling: Counter[str] = Counter()
        self._lock = threading.Lock()

    def check(self, constraint: str | None, tenant: str) -> Any:
        """A pin on the constraint's compiled grammar (workers.speculation.grammars.Pin), None
        without a constraint; raises ApiError (module docstring)."""
        if constraint is None:
            return None
        try:
            self.limits.caps.check(constraint)
        except SchemaTooComplex as e:
            raise errors.invalid(f"{PARAM}: {e}", PARAM, code="schema_too_complex") from None
        except ConstraintError as e:
            raise errors.invalid(f"{PARAM}: {e}", PARAM) from None
        grammars = self._grammars_now()
        pin = grammars.pin_cached(constraint)
        if pin is not None:
            return pin
        with self._compile_slot(tenant):
            return self._compile(grammars, constraint)

    def _compile(self, grammars: Any, constraint: str) -> Any:
        try:
            return grammars.pin(constraint)
        except SchemaTooComplex as e:
            raise errors.invalid(f"{PARAM}: {e}", PARAM, code="schema_too_complex") from None
        except ConstraintError as e:
            log.info("the grammar engine refused a schema: %s", e.detail or e)
            raise errors.invalid(f"{PARAM}: {e}", PARAM) from None
        except CompilerBusy as e:
            raise errors.overloaded("every grammar compiler is busy; retry later",
                                    retry_after_s=e.retry_after_s, code="grammar_compiler_busy") from None
        except Exception:            # a tokenizer the engine cannot read (the fake worker's)
            log.exception("compiling a constraint failed")
            raise errors.invalid("this deployment cannot serve structured outputs", PARAM) from None

    @contextlib.contextmanager
    def _compile_slot(self, tenant: str) -> Iterator[None]:
        """One of the tenant's `compiles_per_tenant`, for the compile's length; 429 if none is free."""
        with self._lock:
            if self._compiling[tenant] >= self.limits.compiles_per_tenant:
                raise errors.rate_limited(
                    f"this API key already has {self._compiling[tenant]} schema(s) compiling, the most "
                    f"allowed; retry when they are done", self.limits.compile_timeout_s,
                    code="compile_concurrency_exceeded")
            self._compiling[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._compiling[tenant] -= 1
                if not self._compiling[tenant]:
                    del self._compiling[tenant]

    def _grammars_now(self) -> Any:
        # the grammar engine (xgrammar) takes a while to import: only at the first constrained
        # request, and never in a process that serves none
        if self._grammars is None:
            from workers.speculation.grammars import Grammars

            try:
                grammars = Grammars.from_tokenizer(self.tokenizer, self.vocab, self.stop_token_ids)
            except ValueError:
                raise errors.invalid("this deployment serves no structured outputs (its model has no "
                                     "stop token)", PARAM) from None
            self._bound(grammars)
            self._grammars = grammars
        return self._grammars

    def _bound(self, grammars: Any) -> Any:
        """Serving: every compile through the compile pool (returned), within the time limit."""
        return grammars.use_pool(workers=self.limits.compile_workers, timeout_s=self.limits.compile_timeout_s,
                                 max_shipped_bytes=self.limits.max_shipped_bytes)


def hold_for(request: Any, pin: Any) -> None:
    """Keep `pin` as long as `request` lives (the step loop drops a request when it ends; a
    request refused before it gets there is dropped at once), then release it."""
    if pin is not None:
        weakref.finalize(request, pin.release)
