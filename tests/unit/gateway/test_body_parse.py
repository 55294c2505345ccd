"""Large request bodies are parsed off the event loop, one at a time per tenant
(gateway/http/parse.py); small ones inline; errors stay the client's 400."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from pydantic import BaseModel

from gateway.errors import ApiError
from gateway.http.parse import INLINE_BYTES, model_parser, parsed


class Doc(BaseModel):
    text: str


def _body(size: int) -> bytes:
    return json.dumps({"text": "x" * size}).encode()


def test_a_large_body_parses_on_a_thread_and_a_small_one_inline():
    threads = []

    def parse(body: bytes) -> Doc:
        threads.append(threading.current_thread())
        return model_parser(Doc)(body)

    async def main() -> tuple[Doc, Doc]:
        return (await parsed("a", _body(10), parse), await parsed("a", _body(INLINE_BYTES + 1), parse))

    small, large = asyncio.run(main())
    assert len(small.text) == 10 and len(large.text) == INLINE_BYTES + 1
    assert threads[0] is threading.main_thread()
    assert threads[1] is not threading.main_thread() and threads[1].name.startswith("specgate-body")


def test_the_loop_answers_while_a_large_body_parses():
    def slow(body: bytes) -> int:
        time.sleep(0.5)          # a parse that holds its thread (json.loads would hold the GIL too)
        return len(body)

    async def main() -> float:
        started = time.monotonic()
        task = asyncio.ensure_future(parsed("a", b"x" * (INLINE_BYTES + 1), slow))
        await asyncio.sleep(0.01)                  # the loop runs while the parse is under way
        answered = time.monotonic() - started
        assert await task == INLINE_BYTES + 1
        return answered

    assert asyncio.run(main()) < 0.4


def test_one_tenant_parses_one_large_body_at_a_time_and_another_is_not_kept_waiting():
    live: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    lock = threading.Lock()

    def parse_as(owner: str):
        def parse(body: bytes) -> str:
            with lock:
                live[owner] += 1
                most[owner] = max(most[owner], live[owner])
            time.sleep(0.1)
            with lock:
                live[owner] -= 1
            return owner
        return parse

    body = b"x" * (INLINE_BYTES + 1)

    async def main() -> tuple[list[str], float]:
        t0 = time.monotonic()
        attacker = [asyncio.ensure_future(parsed("a", body, parse_as("a"))) for _ in range(4)]
        await asyncio.sleep(0.02)
        await parsed("b", body, parse_as("b"))    # not queued behind the four
        waited = time.monotonic() - t0
        return await asyncio.gather(*attacker), waited

    done, waited = asyncio.run(main())
    assert done == ["a"] * 4
    assert most == {"a": 1, "b": 1}
    assert waited < 0.35        # four of a's in a row would take 0.4 s before b's turn


def test_a_large_invalid_body_is_still_a_400_naming_what_is_wrong():
    async def main() -> None:
        await parsed("a", b"[" * 5 + b" " * INLINE_BYTES, model_parser(Doc))

    with pytest.raises(ApiError) as err:
        asyncio.run(main())
    assert err.value.status == 400 and "not valid JSON" in err.value.message


def test_a_tenants_turns_serve_each_event_loop_of_the_process():
    # an asyncio lock belongs to the loop it first waited on: apps built one after another (tests,
    # several servers in a process) each run their own loop, and the same tenant parses in each
    def slow(body: bytes) -> int:
        time.sleep(0.05)
        return len(body)

    async def contended() -> list[int]:
        body = b"x" * (INLINE_BYTES + 1)
        return await asyncio.gather(*(parsed("same", body, slow) for _ in range(3)))

    for _ in range(2):
        assert asyncio.run(contended()) == [INLINE_BYTES + 1] * 3
