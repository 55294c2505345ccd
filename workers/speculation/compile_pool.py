"""Compiles in processes of their own, so that a compile past its time limit can be ended.

The engine (xgrammar) compiles in C++ and cannot be interrupted from another thread: a schema
that takes a minute to compile would hold its thread, and on a small machine the CPU, for that
minute. Here each compile runs in a child process (`compile_child.serve`, at a lower priority,
one compiler thread); a child that has not answered within `timeout_s` is killed and a new one
started in its place, and the caller gets `CompileTimeout` at once. Nobody else waits on it.

Children are forked from multiprocessing's fork server with the engine already imported, so a
replacement is ready in the time it takes to fork and read the tokenizer, not the seconds a
fresh interpreter takes to import the engine and torch. Each child builds the
engine's view of the tokenizer once, from the JSON its parent serialized once. The pool starts
at the first compile, or when its owner asks (`warm`).

What comes back is what the caller asks for: success and the grammar's size (the caller compiles
again in its own process, which is faster than reading a serialized grammar back, and now known
to be bounded), or the serialized grammar itself (Ray mode ships it to the verifier replicas,
workers/speculation/grammars.py). A serialized grammar can be far larger than its schema, so it
is refused past `max_bytes` before it is sent.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from workers.speculation.compile_child import serve
from workers.speculation.constraints import (GENERIC_REFUSAL, CompilerBusy, CompileTimeout,
                                             ConstraintError, SchemaTooComplex, engine_refusal)

__all__ = ["Compiled", "CompilePool"]

log = logging.getLogger(__name__)

STARTUP_S = 120.0     # the most a child may take to start (the first imports the engine)


@dataclass(frozen=True)
class Compiled:
    """A compile's answer: the serialized grammar when asked for, and its size in memory."""
    serialized: str | None
    memory_bytes: int


@dataclass
class _Child:
    process: Any
    conn: Any


class CompilePool:
    def __init__(self, info_json: Callable[[], str], *, workers: int = 2, timeout_s: float = 5.0,
                 threads: int = 1) -> None:
        """`info_json()`: the engine's tokenizer info, serialized (called once, at the first
        start); `workers`: child processes; `timeout_s`: the most one compile may take."""
        if workers < 1:
            raise ValueError("a compile pool needs at least one process")
        self.workers = workers
        self.timeout_s = timeout_s
        self.threads = threads
        self.compiles = 0                 # compiles the children ran (diagnostic; tests)
        self.kills = 0                    # compiles ended by their time limit
        self._make_info = info_json
        self._info: str | None = None
        self._info_lock = threading.Lock()
        self._idle: list[_Child] = []
        self._alive = 0                   # children started or starting
        self._ready_once = False
        self._cond = threading.Condition()
        self._closed = False

    def compile(self, kind: str, schema: dict[str, Any], *, serialize: bool = False,
                max_bytes: int | None = None) -> Compiled:
        """Compile a parsed constraint in a child. Raises CompileTimeout (the child is killed),
        CompilerBusy (no child came free within the time limit), SchemaTooComplex (serialized
        past `max_bytes`) or ConstraintError (the engine refused it; its words in `detail`)."""
        child = self._take()
        try:
            child.conn.send((kind, schema, (max_bytes or 2**62) if serialize else None))
            answered = child.conn.poll(self.timeout_s)
            status, payload, size = child.conn.recv() if answered else ("timeout", None, 0)
        except (EOFError, OSError):                       # the child died under this compile
            self._replace(child)
            raise ConstraintError(f"the schema cannot be used: {GENERIC_REFUSAL}",
                                  detail="the compile process died") from None
        if status == "timeout":
            self.kills += 1
            self._replace(child)
            raise CompileTimeout(self.timeout_s)
        self._give_back(child)
        self.compiles += 1
        if status == "error":
            raise engine_refusal(payload)
        if status == "too_big":
            raise SchemaTooComplex(f"the compiled schema is {size:,} bytes; the most allowed is "
                                   f"{max_bytes:,} (grammar_max_shipped_mb)", "grammar_max_shipped_mb")
        return Compiled(payload, size)

    def warm(self) -> None:
        """Start the children now, in the background (a serving process that has a model: the
        first constrained request then finds them ready instead of waiting seconds for them)."""
        with self._cond:
            self._top_up()

    def close(self) -> None:
        """Stop every idle child (tests; a serving process's children end with it)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            _stop(child)

    # ---- children -------------------------------------------------------------------------------
    def _take(self) -> _Child:
        with self._cond:
            self._top_up()
            wait = self.timeout_s if self._ready_once else STARTUP_S
            deadline = time.monotonic() + wait
            while not self._idle:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or not self._alive:      # none coming (starts failed)
                    raise CompilerBusy(self.timeout_s)
                self._cond.wait(left)
            return self._idle.pop()

    def _give_back(self, child: _Child) -> None:
        with self._cond:
            self._idle.append(child)
            self._cond.notify()

    def _replace(self, child: _Child) -> None:
        _stop(child)
        with self._cond:
            self._alive -= 1
            self._top_up()

    def _top_up(self) -> None:
        """Start children (in the background) until `workers` are alive or starting; under _cond."""
        while not self._closed and self._alive < self.workers:
            self._alive += 1
            threading.Thread(target=self._start_child, name="specgate-grammar-start", daemon=True).start()

    def _start_child(self) -> None:
        child = None
        try:
            info = self._info_json()
            ctx = _context()
            conn, theirs = ctx.Pipe()
            process = ctx.Process(target=serve, args=(theirs, info, self.threads), daemon=True,
                                  name="specgate-grammar")
            process.start()
            theirs.close()
            child = _Child(process, conn)
            if not conn.poll(STARTUP_S) or conn.recv()[0] != "ready":
                raise RuntimeError(f"no answer from a grammar compile process in {STARTUP_S:g} s")
        except Exception:
            log.exception("starting a grammar compile process failed")
            if child is not None:
                _stop(child)
            with self._cond:
                self._alive -= 1               # the next compile tries again
                self._cond.notify_all()
            return
        with self._cond:
            self._ready_once = True
            self._idle.append(child)
            self._cond.notify()

    def _info_json(self) -> str:
        with self._info_lock:
            if self._info is None:
                self._info = self._make_info()
            return self._info


def _stop(child: _Child) -> None:
    try:
        child.conn.close()
    except OSError:
        pass
    child.process.kill()
    child.process.join(timeout=5)


_CONTEXT: Any = None


def _context() -> Any:
    """The fork server's context, the engine imported there once (so children fork with it)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["__main__", "workers.speculation.compile_child", "xgrammar"])
        _CONTEXT = ctx
    return _CONTEXT
