"""What a compile process runs (workers/speculation/compile_pool.py), and the one way a schema is
compiled, in that process or in the caller's (`compile_schema`).

A child builds the engine's view of the tokenizer once, from the JSON its parent sent, then
answers jobs on its pipe until the pipe closes: ("ok", serialized or None, the grammar's size in
memory), ("too_big", None, the serialized size) or ("error", the engine's message). It runs at
a lower priority than the serving process and with one compiler thread: on a small machine a
compile then takes its CPU from what is idle, not from the steps. A job that runs too long is
not answered at all: the parent kills the child.
"""
from __future__ import annotations

import json
import os
from typing import Any

# Output is compact JSON: no whitespace between tokens, separators "," and ":" (grammar.py).
SEPARATORS = (",", ":")
NICENESS = 10


def compile_schema(compiler: Any, kind: str, schema: dict[str, Any]) -> Any:
    """The engine's compiled grammar (xgrammar.CompiledGrammar) of a parsed constraint.
    json_object: strict_mode off, so that {"type": "object"} admits any properties."""
    return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                        separators=SEPARATORS, strict_mode=kind == "json_schema")


def serve(conn: Any, info_json: str, threads: int) -> None:
    """The child's loop (a multiprocessing target): jobs (kind, schema, serialize: the most bytes
    to send back serialized, or None for none) in, answers out."""
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    conn.send(("ready", None, 0))
    while True:
        try:
            kind, schema, serialize = conn.recv()
        except (EOFError, OSError):
            return                                  # the parent is gone or closed the pipe
        try:
            grammar = compile_schema(compiler, kind, schema)
            answer = ("ok", None, int(grammar.memory_size_bytes))
            if serialize is not None:
                text = grammar.serialize_json()
                answer = ("ok", text, answer[2]) if len(text) <= serialize else ("too_big", None, len(text))
        except Exception as e:                     # the engine's refusal, with its reason
            answer = ("error", str(e), 0)
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return
