"""One tenant's output cannot make text cost quadratic time (issue 50): an output of byte tokens
that never form a character (each decodes alone to U+FFFD; a `logit_bias` can force one) costs
decoding in proportion to its length, live (`RequestStream`), on a resume (gateway/replay.py), to
a follower, and on a Responses GET or stream (gateway/responses/service.py), and the text shown
is what a full decode of the tokens gives.

Work is counted as tokens handed to the real SmolLM2 tokenizer's `decode`: doubling the output
must at most about double it (a window that grows with the output quadruples it)."""
from __future__ import annotations

import asyncio
import random

import pytest

from gateway.replay import Cursor, Replayer
from gateway.responses.objects import Header
from gateway.responses.service import ResponseService
from gateway.responses.store import MemoryResponses
from gateway.service import GenerateInput, GenerateOutput, GenerationService
from gateway.tenancy.records import Tenant
from gateway.text import _BYTE_LEVEL, HOLD_TOKENS, OutputText
from scheduler.loop import Delta, Finished, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats, Status
from scheduler.store import MemoryStore, StepWrite
from workers.fake_worker import FakeWorker
from workers.model.loader import load_tokenizer, resolve_model

MODEL = "smollm2-135m"
N = 2000                     # output tokens; each test also runs 2 N
PER_TOKEN = 4 * (5 + 2 * HOLD_TOKENS + 2)     # decoded tokens per output token: a bounded window


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(resolve_model(progress=False)), progress=False)


class Counted:
    """The real tokenizer, its `decode` counting the tokens it is handed (the work text costs);
    everything else is the tokenizer's own."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def byte_tokens(tok, n: int, seed: int = 0) -> list[int]:
    """`n` tokens, each a lone UTF-8 continuation byte (0x80-0xBF): each decodes alone to U+FFFD
    and no run of them ever forms a character, so a full decode is n replacement characters."""
    char_of = {b: ch for ch, b in _BYTE_LEVEL.items()}
    vocab = tok.get_vocab()
    ids = [vocab[char_of[b]] for b in range(0x80, 0xC0)]
    assert all(tok.decode([i]) == "\ufffd" for i in ids)
    r = random.Random(seed)
    return [r.choice(ids) for _ in range(n)]


def linear(work: dict[int, int]) -> None:
    """Doubling the output at most about doubles the work, and each token costs a bounded window."""
    (n, small), (n2, big) = sorted(work.items())
    assert n2 == 2 * n and small >= n, work          # every token was decoded (and counted)
    assert big <= 2.2 * small, work
    assert big <= PER_TOKEN * n2, work


def record(rid: str, tenant: Tenant, prompt: list[int], tokens: list[int],
           status: Status = Status.FINISHED) -> Request:
    stats = RequestStats(rid, tenant.name, 0.0, prompt_len=len(prompt), max_tokens=8192,
                         status=status, cause="max_tokens" if status.terminal else None,
                         tenant_id=tenant.id)
    return Request(stats, list(prompt), output_ids=list(tokens))


# ---- live ------------------------------------------------------------------------------------------
def live(tok, tokens: list[int]) -> tuple[int, list, GenerateOutput]:
    """The service's own stream fed the step loop's events by hand, 1 to 6 tokens a step (the loop
    is not started); returns (decoded tokens, chunks, output)."""
    policy = make_policy("fcfs", max_batch=4, token_budget=64, aging_bound_s=None)
    counted = Counted(tok)
    service = GenerationService(StepLoop(policy, FakeWorker(context_limit=16384), MemoryStore()),
                                counted, models=[MODEL])
    counted.decoded = 0                     # what building the service decoded is not the stream's

    async def go():
        stream = service.stream(GenerateInput(tenant=Tenant("acme"), model=MODEL,
                                              prompt_ids=tok.encode("Say:"), max_tokens=8192))
        r, i = random.Random(1), 0
        while i < len(tokens):
            k = r.randint(1, 6)
            stream.sink(Delta(stream.request_id, tuple(tokens[i:i + k])))
            i += k
        stats = RequestStats(stream.request_id, "acme", 0.0, prompt_len=3, max_tokens=8192,
                             status=Status.FINISHED, cause="max_tokens")
        stream.sink(Finished(stream.request_id, Status.FINISHED, "length", stats))
        items = [item async for item in stream]
        await stream.aclose()
        return items
    items = asyncio.run(go())
    return counted.decoded, items[:-1], items[-1]


def test_a_live_stream_of_byte_tokens_decodes_in_linear_time_and_shows_them(tok):
    work = {}
    for n in (N, 2 * N):
        tokens = byte_tokens(tok, n)
        work[n], chunks, out = live(tok, tokens)
        assert out.text == tok.decode(tokens, skip_special_tokens=True) == "\ufffd" * n
        assert "".join(c.text for c in chunks) == out.text
        # the replacement characters go out as they come, not all at the end
        assert sum(1 for c in chunks if c.text) >= n // (HOLD_TOKENS + 6)
    linear(work)


# ---- resumed and followed --------------------------------------------------------------------------
def test_a_resumed_stream_of_byte_tokens_decodes_in_linear_time(tok):
    acme = Tenant("acme")
    work = {}
    for n in (N, 2 * N):
        tokens = byte_tokens(tok, n, seed=n)
        counted = Counted(tok)
        replayer = Replayer(MemoryStore(), counted)
        req = record("chatcmpl-r", acme, tok.encode("Say:"), tokens)

        async def go(cursor):
            return [item async for item in replayer.stream(req, cursor)]
        for cursor in (Cursor(), Cursor(chars=n // 2), Cursor(tokens=n // 3)):
            items = asyncio.run(go(cursor))
            out = items[-1]
            assert out.text == tok.decode(tokens) and len(out.token_ids) == n
            if cursor.tokens is not None:        # the text its first tokens showed
                seen = OutputText(tok, req.prompt_ids)
                seen.push(tokens[:cursor.tokens])
                shown = len(seen.text)
            else:
                shown = cursor.chars or 0
            assert "".join(c.text for c in items[:-1]) == out.text[shown:]
        work[n] = counted.decoded
    linear(work)


def test_a_follower_decodes_only_the_tokens_it_has_not_seen(tok):
    """A running request followed as steps commit its tokens: each read decodes the new tokens
    only, so following costs the output once, however many reads it takes."""
    acme = Tenant("acme")
    work = {}
    for n in (N, 2 * N):
        tokens = byte_tokens(tok, n, seed=n + 1)
        store, counted = MemoryStore(), Counted(tok)
        req = record("chatcmpl-f", acme, tok.encode("Say:"), [], Status.RUNNING)
        store.add(req)
        replayer = Replayer(store, counted)

        async def commit():
            for i in range(0, n, 16):
                last = i + 16 >= n
                stats = RequestStats(req.request_id, "acme", 0.0, prompt_len=3, max_tokens=8192,
                                     status=Status.FINISHED if last else Status.RUNNING,
                                     cause="max_tokens" if last else None, tenant_id=acme.id,
                                     committed=min(n, i + 16))
                store.commit_step(StepWrite(appended={req.request_id: tokens[i:i + 16]},
                                            updated=() if last else (stats,),
                                            ended=(stats,) if last else ()))
                await asyncio.sleep(0.0005)

        async def go():
            opened = await replayer.open(acme, req.request_id)
            writer = asyncio.create_task(commit())
            items = [item async for item in replayer.stream(opened)]
            await writer
            return items
        items = asyncio.run(go())
        assert items[-1].text == tok.decode(tokens)
        assert len(items) > 3                  # its text went out read by read, not at the end
        work[n] = counted.decoded
    linear(work)


# ---- the Responses API -------------------------------------------------------------------------------
def test_a_responses_get_and_stream_of_byte_tokens_decode_in_linear_time(tok):
    acme = Tenant("acme")
    work_get, work_stream = {}, {}
    for n in (N, 2 * N):
        tokens = byte_tokens(tok, n, seed=n + 2)
        rid = f"resp_{n}"
        responses, records, counted = MemoryResponses(3600.0), MemoryStore(), Counted(tok)
        responses.put(Header(rid, acme.id, MODEL, 1_700_000_000, [{"role": "user", "content": "hi"}]))
        records.add(record(rid, acme, tok.encode("Say:"), tokens))
        svc = ResponseService(None, responses, records, counted, cancel=lambda _: None)

        async def get():
            return await svc.retrieve(acme, rid)

        async def events():
            return [ev async for ev in await svc.retrieve(acme, rid, stream=True)]
        # ended, not yet kept in the response store: the text of its record, decoded once
        body = asyncio.run(get())
        assert body["output"][0]["content"][0]["text"] == tok.decode(tokens) == "\ufffd" * n
        work_get[n] = counted.decoded
        # kept with its text (as its end does): a GET decodes nothing
        assert svc.finalize(rid)
        kept = counted.decoded
        assert asyncio.run(get())["output"][0]["content"][0]["text"] == "\ufffd" * n
        assert counted.decoded == kept
        # its stream: a delta per token whose text completes a piece, decoded once
        evs = asyncio.run(events())
        deltas = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
        assert deltas == "\ufffd" * n and evs[-1]["type"] == "response.incomplete"
        work_stream[n] = counted.decoded - kept
    linear(work_get)
    linear(work_stream)
