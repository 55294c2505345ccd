"""The compiled grammars of one tokenizer: each distinct grammar compiled once per process, held
while a request needs it, and compiled within bounds when serving.

**Keys.** A constraint's grammar is keyed by its canonical form (workers/speculation/schema_caps.py:
the schema less the keywords that only annotate), so constraints that differ only in a
description share one compile.

**One compile per grammar.** A compile of a key already in flight is not started again: the
second caller waits for the first's answer, error included (`_entry`).

**Held, not only cached.** Entries live in a bounded LRU (`cache_size`) unless pinned: a `Pin`
keeps its grammar until it is released or dropped (its finalizer unpins). The gateway pins a
request's grammar when it checks the request and keeps the pin as long as the request lives, so a
queued request's grammar is still here at its prefill, however many others were compiled
meanwhile: nothing compiles on the step loop's thread. The batch worker pins it again while the
request is resident, for the grammar drafter's first proposal.

**Bounded compiles.** Without a pool (tools, tests, `specgate generate`) a miss compiles here.
Serving (`use_pool`), a miss compiles first in a child process with a time limit
(workers/speculation/compile_pool.py): a schema past it is `CompileTimeout`, its process killed.
Then either this process compiles it again (`ships=False`: faster than reading a serialized
grammar back, and now known to be bounded), or it keeps what the child serialized
(`ships=True`: Ray mode's scheduler, which only ships grammars to its verifier replicas, where
`install` reads them back, compiling nothing).

The engine (and torch, which it imports) is imported at the first use, not with this module: a
Ray scheduler replica makes its `Grammars` at start and may never see a constraint.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

from workers.speculation.compile_child import compile_schema
from workers.speculation.compile_pool import CompilePool
from workers.speculation.constraints import engine_refusal
from workers.speculation.schema_caps import canonical_key

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

__all__ = ["DEFAULT_CACHE_SIZE", "Grammars", "Pin", "RawVocabulary"]

# Unpinned compiled grammars kept per process; a schema's compiled form is a few hundred KB at most.
DEFAULT_CACHE_SIZE = 256


@runtime_checkable
class RawVocabulary(Protocol):
    """A tokenizer that is no Hugging Face one but lists its tokens' text (the gateway's stand-in
    for the fake worker, gateway/text.py): taken as a raw vocabulary."""

    def pieces(self) -> list[str]: ...


class Pin:
    """One holder's claim on a compiled grammar: never evicted until `release()` (idempotent) is
    called or the pin is garbage."""
    __slots__ = ("release", "__weakref__")

    def __init__(self, grammars: "Grammars", key: str) -> None:
        self.release = weakref.finalize(self, grammars._unpin, key)


@dataclass
class _Entry:
    grammar: "xgr.CompiledGrammar | None" = None
    serialized: str | None = None              # what a shipping process keeps and ships
    pins: int = 0


class Grammars:
    """The constraints of one tokenizer (module docstring); thread-safe: the gateway's threads
    compile to validate while the step loop reads them to admit. The engine's view of the
    tokenizer (`make_info()`) is built at its first use, not here."""

    def __init__(self, make_info: Callable[[], "xgr.TokenizerInfo"], vocab: int, stop_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, *, ships: bool = False):
        """`vocab`: the model's logits per row (the info's vocab_size must equal it); `ships`:
        keep serialized grammars to send elsewhere, never compile one here."""
        self.vocab = vocab
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})
        if not self.stop_token_ids:
            raise ValueError("a grammar needs at least one stop token to end the output with")
        self.ships = ships
        self.compiles = 0                     # grammars compiled for this object (here or in its pool)
        self._make_info = make_info
        self._info: "xgr.TokenizerInfo | None" = None
        self._compiler: "xgr.GrammarCompiler | None" = None
        self._token_ids: dict[bytes, int] | None = None
        self._pool: CompilePool | None = None
        self._max_shipped: int | None = None
        self._lru: OrderedDict[str, _Entry] = OrderedDict()      # unpinned, at most cache_size
        self._held: dict[str, _Entry] = {}                       # pinned
        self._inflight: dict[str, Future] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab: int, stop_token_ids: Iterable[int],
                       cache_size: int = DEFAULT_CACHE_SIZE, *, ships: bool = False) -> "Grammars":
        """For a Hugging Face tokenizer and a model with `vocab` logits, which may exceed the
        tokenizer's vocabulary: the engine never allows the padding ids. A `RawVocabulary` is
        taken as the raw list of its tokens' text."""
        stops = list(stop_token_ids)

        def raw() -> "xgr.TokenizerInfo":
            import xgrammar as xgr

            return xgr.TokenizerInfo(tokenizer.pieces(), xgr.VocabType.RAW, vocab_size=vocab,
                                     stop_token_ids=stops)

        def hugging_face() -> "xgr.TokenizerInfo":
            import xgrammar as xgr

            return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        make = raw if isinstance(tokenizer, RawVocabulary) else hugging_face
        return cls(make, vocab, stops, cache_size, ships=ships)

    def use_pool(self, *, workers: int, timeout_s: float, max_shipped_bytes: int | None = None) -> CompilePool:
        """Compile through a pool of `workers` processes from now on, each compile within
        `timeout_s` (serving; the first configuration stays). `max_shipped_bytes`: the largest
        serialized grammar a shipping process keeps. Starts nothing until the first compile."""
        with self._lock:
            if self._pool is None:
                self._pool = CompilePool(lambda: self._info_now().serialize_json(), workers=workers,
                                         timeout_s=timeout_s)
                self._max_shipped = max_shipped_bytes
            return self._pool

    # ---- lookups --------------------------------------------------------------------------------
    def compiled(self, constraint: str) -> "xgr.CompiledGrammar":
        """The compiled grammar of a constraint string (ConstraintError if it cannot be)."""
        import xgrammar as xgr

        _, entry = self._entry(constraint)
        if entry.grammar is None:                   # kept serialized here: read back once
            entry.grammar = xgr.CompiledGrammar.deserialize_json(entry.serialized, self._info_now())
        return entry.grammar

    def serialized(self, constraint: str) -> str:
        """The grammar serialized, as `install` reads it (a shipping process's)."""
        _, entry = self._entry(constraint)
        if entry.serialized is None:
            entry.serialized = entry.grammar.serialize_json()
        return entry.serialized

    def pin(self, constraint: str) -> Pin:
        """The constraint's grammar, compiled if it is not here, held until the pin goes."""
        key, entry = self._entry(constraint)
        return self._pin(key, entry)

    def pin_cached(self, constraint: str) -> Pin | None:
        """A pin if the grammar is here already, else None (and nothing compiled)."""
        key = canonical_key(constraint)[2]
        with self._lock:
            entry = self._find(key)
        return None if entry is None else self._pin(key, entry)

    def install(self, constraint: str, serialized: str) -> None:
        """Keep a grammar compiled elsewhere (what a shipping process sent), unless it is here."""
        key = canonical_key(constraint)[2]
        with self._lock:
            if self._find(key) is not None:
                return
        import xgrammar as xgr

        grammar = xgr.CompiledGrammar.deserialize_json(serialized, self._info_now())
        with self._lock:
            if self._find(key) is None:
                self._store(key, _Entry(grammar))

    def matcher(self, constraint: str, output: Sequence[int] = ()) -> "xgr.GrammarMatcher":
        """A matcher for the constraint, advanced past `output` (a re-admitted request's text)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(self.compiled(constraint), override_stop_tokens=self.stop_token_ids)
        advance(m, output)
        return m

    def bitmask(self, rows: int) -> "torch.Tensor":
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab)          # [rows, ceil(V / 32)] int32

    def token_of(self, text: str) -> int | None:
        """The id of the token whose text is exactly `text`, if there is one (ties: the lowest
        id, what a BPE merge would name)."""
        self._compiler_now()
        ids = self._token_ids
        return ids.get(text.encode("utf-8")) if ids is not None else None

    # ---- the cache ------------------------------------------------------------------------------
    def _entry(self, constraint: str) -> tuple[str, _Entry]:
        """The constraint's entry, compiled on a miss; a compile of the same key in flight is
        waited for, not repeated (its error is this caller's too)."""
        kind, schema, key = canonical_key(constraint)
        with self._lock:
            entry = self._find(key)
            if entry is not None:
                return key, entry
            flight = self._inflight.get(key)
            if flight is None:
                flight = self._inflight[key] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return key, flight.result()
        try:
            entry = self._build(kind, schema)
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            flight.set_exception(exc)
            raise
        with self._lock:
            self._store(key, entry)
            del self._inflight[key]
        flight.set_result(entry)
        return key, entry

    def _build(self, kind: str, schema: dict[str, Any]) -> _Entry:
        pool = self._pool
        if pool is not None and self.ships:
            done = pool.compile(kind, schema, serialize=True, max_bytes=self._max_shipped)
            self.compiles += 1
            return _Entry(serialized=done.serialized)
        if pool is not None:
            pool.compile(kind, schema)             # bounded there: this one is known to end
        compiler = self._compiler_now()
        try:
            grammar = compile_schema(compiler, kind, schema)
        except Exception as e:                     # the engine's refusal, with its reason
            raise engine_refusal(str(e)) from None
        self.compiles += 1
        return _Entry(grammar)

    def _find(self, key: str) -> _Entry | None:
        """Under _lock: the entry, touched as the most recent."""
        entry = self._held.get(key)
        if entry is None:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
        return entry

    def _store(self, key: str, entry: _Entry) -> None:
        """Under _lock."""
        if key in self._held or key in self._lru:
            return
        self._lru[key] = entry
        while len(self._lru) > self._cache_size:
            self._lru.popitem(last=False)

    def _pin(self, key: str, entry: _Entry) -> Pin:
        with self._lock:
            held = self._held.get(key)
            if held is None:                       # maybe evicted since it was found: back in
                self._lru.pop(key, None)
                held = self._held[key] = entry
            held.pins += 1
        return Pin(self, key)

    def _unpin(self, key: str) -> None:
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            entry.pins -= 1
            if entry.pins <= 0:
                del self._held[key]
                self._store(key, entry)

    def held(self) -> int:
        """Grammars pinned now (a diagnostic; tests)."""
        with self._lock:
            return len(self._held)

    # ---- the engine's view of the tokenizer -----------------------------------------------------
    def _info_now(self) -> "xgr.TokenizerInfo":
        with self._info_lock:
            if self._info is None:
                info = self._make_info()
                if info.vocab_size != self.vocab:
                    raise ValueError(f"the tokenizer info has {info.vocab_size} ids, the model {self.vocab}")
                self._info = info
            return self._info

    def _compiler_now(self) -> "xgr.GrammarCompiler":
        import xgrammar as xgr

        info = self._info_now()
        with self._info_lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                self._token_ids = {}
                for i, b in enumerate(info.decoded_vocab):
                    if b:
                        self._token_ids.setdefault(b, i)
            return self._compiler


def advance(matcher: "xgr.GrammarMatcher", tokens: Sequence[int]) -> None:
    """Accept committed tokens. Nothing is accepted past a stop token (the output ends there), and
    a token the grammar refuses means the mask was not applied: a bug, raised."""
    for t in tokens:
        if matcher.is_terminated():
            return
        if not matcher.accept_token(int(t)):
            raise RuntimeError(f"token {t} was committed although the grammar forbids it")
