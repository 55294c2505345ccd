"""A resumed stream shows exactly the text the live one showed, with the real tokenizer (byte-level
BPE: emoji and CJK characters split over several tokens), whatever the steps' grouping of tokens.

The live side is the service's own `RequestStream`, fed the step loop's events by hand (the loop
is not started: each test picks the grouping of tokens into steps); the replay is
gateway/replay.py's over a record holding the same tokens, resumed at every id the live stream
gave (content characters, as SSE ids, and output tokens, as gRPC's `Resume.after`)."""
from __future__ import annotations

import asyncio
import random

import pytest

from gateway.replay import Cursor, Replayer
from gateway.service import GenerateInput, GenerateOutput, GenerationService
from gateway.tenancy.records import Tenant
from scheduler.loop import Delta, Finished, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats, Status
from scheduler.store import MemoryStore
from workers.fake_worker import FakeWorker

MODEL = "smollm2-135m"
TEXTS = ("héllo 👋🏽 世界 naïve — ok 🤖🤖 ∑ x² done",
         "Здравствуй, мир! 🎉🎉 日本語のテキスト 😀😃😄\n\n  end ✨")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from workers.model.loader import resolve_model
    return AutoTokenizer.from_pretrained(resolve_model(progress=False))


def output_tokens(tok, seed: int) -> list[int]:
    """Text with multi-byte characters, then tokens drawn at random (byte pieces that may never
    form a character among them), then text again."""
    r = random.Random(seed)
    ids = tok.encode(r.choice(TEXTS), add_special_tokens=False)
    return ids + [r.randrange(len(tok)) for _ in range(12)] + tok.encode(r.choice(TEXTS),
                                                                          add_special_tokens=False)


def groups(tokens: list[int], seed: int) -> list[list[int]]:
    """The tokens as steps commit them: 1 to 6 a step."""
    r, out, i = random.Random(seed), [], 0
    while i < len(tokens):
        n = r.randint(1, 6)
        out.append(tokens[i:i + n])
        i += n
    return out


def live(service: GenerationService, steps: list[list[int]], stops: tuple[str, ...]):
    """The live stream's chunks and output, its tokens delivered in `steps`."""
    async def go():
        stream = service.stream(GenerateInput(tenant=Tenant("acme"), model=MODEL,
                                              prompt="Say hi 👋", max_tokens=1000, stop=stops))
        for group in steps:
            stream.sink(Delta(stream.request_id, tuple(group)))
        stats = RequestStats(stream.request_id, "acme", 0.0, prompt_len=3, max_tokens=1000,
                             status=Status.FINISHED, cause="max_tokens")
        stream.sink(Finished(stream.request_id, Status.FINISHED, "length", stats))
        items = [item async for item in stream]
        await stream.aclose()
        return stream.prep.request, items[:-1], items[-1]
    return asyncio.run(go())


def replay(replayer: Replayer, req: Request, tokens: list[int], cursor: Cursor):
    """The replay of a finished record holding `tokens`, after `cursor`."""
    stats = RequestStats(req.stats.request_id, "acme", 0.0, prompt_len=len(req.prompt_ids),
                         max_tokens=1000, status=Status.FINISHED, cause="max_tokens")
    record = Request(stats, list(req.prompt_ids), stop=req.stop, output_ids=list(tokens))

    async def go():
        return [item async for item in replayer.stream(record, cursor)]
    items = asyncio.run(go())
    assert isinstance(items[-1], GenerateOutput)
    return items[:-1], items[-1]


@pytest.fixture(scope="module")
def service(tokenizer):
    policy = make_policy("fcfs", max_batch=4, token_budget=64, aging_bound_s=None)
    loop = StepLoop(policy, FakeWorker(context_limit=4096), MemoryStore())   # never started
    return GenerationService(loop, tokenizer, models=[MODEL])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stop", [None, "世界", "🎉", "ok"])
def test_the_replay_shows_the_live_text_at_every_id(tokenizer, service, seed, stop):
    tokens = output_tokens(tokenizer, seed)
    stops = () if stop is None else (stop,)
    replayer = Replayer(service.step_loop.store, tokenizer)
    texts = set()
    for grouping in range(3):
        req, chunks, out = live(service, groups(tokens, 100 * seed + grouping), stops)
        assert "".join(c.text for c in chunks) == out.text
        texts.add(out.text)
        if stop is not None and stop in tokenizer.decode(tokens):
            assert out.finish_reason == "stop" and stop not in out.text
        # every id the live stream gave: the characters shown, and the tokens received
        chars, ntok = 0, 0
        for chunk in [None, *chunks]:
            if chunk is not None:
                chars, ntok = chars + len(chunk.text), ntok + len(chunk.token_ids)
            for cursor in (Cursor(chars=chars), Cursor(tokens=ntok)):
                rest, final = replay(replayer, req, tokens, cursor)
                assert "".join(c.text for c in rest) == out.text[chars:], (grouping, cursor)
                assert (final.text, final.token_ids, final.finish_reason) == \
                    (out.text, out.token_ids, out.finish_reason)
                if cursor.tokens is not None:     # the tokens after the cursor, in order
                    got = sum((c.token_ids for c in rest), ())
                    assert got == out.token_ids[ntok:ntok + len(got)]
    assert len(texts) == 1, "the text shown depends on how steps grouped the tokens"
