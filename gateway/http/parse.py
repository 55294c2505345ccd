"""Request bytes → a JSON value or a validated model, with every way they can be wrong an OpenAI
400 naming the field, and large bodies parsed off the event loop, one at a time per tenant.

Parsing and validating are proportional to the body (up to `max_body_bytes`, 2 MiB by default).
On the event loop a tenant's megabyte bodies would hold the loop that writes every tenant's
streams and answers /health; so a body over `INLINE_BYTES` is parsed on a small pool of its own,
and a tenant parses one such body at a time: however many it sends at once, it occupies at most
one of the pool's threads, and another tenant's large body takes the other. Small bodies (nearly
all) are parsed inline, where a thread hop would cost more than the parse.

The per-tenant turns are locks kept by tenant id, so they are as many as the tenants served; one
set per event loop (an asyncio lock belongs to the loop it first waited on), gone with its loop.
"""
from __future__ import annotations

import asyncio
import json
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from gateway import errors

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

INLINE_BYTES = 64 * 1024      # a body up to this size parses inline (well under a millisecond)
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specgate-body")
_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = \
    weakref.WeakKeyDictionary()


async def parsed(owner: str, body: bytes, parse: Callable[[bytes], T]) -> T:
    """`parse(body)`: inline for a small body; otherwise on the body pool, after `owner`'s
    earlier large bodies (module docstring)."""
    if len(body) <= INLINE_BYTES:
        return parse(body)
    loop = asyncio.get_running_loop()
    turns = _TURNS.setdefault(loop, {})
    async with turns.setdefault(owner, asyncio.Lock()):
        return await loop.run_in_executor(_POOL, parse, body)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(body: bytes) -> Any:
    """Request bytes → a JSON value, or ApiError 400 saying what is wrong with them."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid("the request body is not valid UTF-8", code="invalid_body") from None
    if not text.strip():
        raise errors.invalid("the request body is empty; send a JSON object", code="invalid_body")
    try:
        obj = json.loads(text, parse_constant=_no_constants)
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")    # only pairs make characters
        return obj
    except UnicodeEncodeError:
        raise errors.invalid("the request body is not valid JSON text: a \\u escape is an "
                             "unpaired surrogate (\\ud800-\\udfff)", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise errors.invalid(f"the request body is not valid JSON: {exc.msg} at line "
                             f"{exc.lineno} column {exc.colno}", code="invalid_json") from None
    except RecursionError:
        raise errors.invalid("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:                   # NaN/Infinity, or an integer of > 4300 digits
        raise errors.invalid(f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def field_names(*models: type[BaseModel]) -> frozenset[str]:
    """Every field name of these models and the models they contain (for error `param`s)."""
    names: set[str] = set()
    seen: set[type] = set()
    todo = list(models)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for name, f in m.model_fields.items():
            names.add(name)
            for t in _types_in(f.annotation):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    todo.append(t)
    return frozenset(names)


def _types_in(annotation: Any) -> list[Any]:
    out, todo = [], [annotation]
    while todo:
        a = todo.pop()
        out.append(a)
        todo.extend(getattr(a, "__args__", ()) or ())
        origin = getattr(a, "__origin__", None)
        if origin is not None:
            todo.append(origin)
    return out


def model_parser(model: type[M]) -> Callable[[bytes], M]:
    """Request bytes → `model`, or ApiError 400 naming the field (`parsed`'s `parse`)."""
    fields = field_names(model)

    def parse(body: bytes) -> M:
        obj = parse_json(body)
        if not isinstance(obj, dict):
            raise errors.invalid(f"the request body must be a JSON object, not "
                                 f"{type(obj).__name__}", code="invalid_body")
        try:
            return model.model_validate(obj)
        except ValidationError as exc:
            raise errors.from_validation_errors(exc.errors(include_url=False), fields) from None
        except RecursionError:
            raise errors.invalid("the request body is nested too deeply", code="invalid_body") from None

    return parse
