"""The embedded gateway on the real default model, through the official `openai` client on a live
loopback server: greedy output (temperature 0) is exactly transformers' greedy `generate` on the
same prompt ids, streamed or not, for completions and chat, and a stop string cuts real text."""
from __future__ import annotations

import pytest


from gateway.settings import Settings
from tests.helpers import hf_greedy, openai_client_on
from workers.prompts import encode_record

pytestmark = pytest.mark.slow
MAX_NEW = 32
PROMPTS = [
    {"prompt": "The capital of France is"},
    {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"prompt": "Repeat after me: the quick brown fox jumps over the lazy dog. "
               "The quick brown fox jumps over the lazy dog. The quick brown"},
    {"messages": [{"role": "user", "content": "List three primary colours."}]},
]


@pytest.fixture(scope="module")
def served(real_runtime):
    with openai_client_on(real_runtime, Settings(max_batch=4), timeout=120) as served:
        yield served


@pytest.fixture(scope="module")
def references(real_runtime):
    """Per prompt: (prompt ids, greedy output ids without the stop token, its text)."""
    rt, out = real_runtime, []
    for record in PROMPTS:
        ids = encode_record(rt.tokenizer, record)
        ref = hf_greedy(rt.hf_model, ids, MAX_NEW, eos=sorted(rt.stop_token_ids))
        out.append((ids, ref, rt.tokenizer.decode(ref, skip_special_tokens=True)))
    return out


def ask(client, record: dict, stream: bool, **kw):
    """(text, finish_reason, usage or None) for one record, through the matching endpoint."""
    model = "smollm2-135m"
    if "messages" in record:
        r = client.chat.completions.create(model=model, messages=record["messages"],
                                           max_tokens=MAX_NEW, temperature=0, stream=stream,
                                           **({"stream_options": {"include_usage": True}} if stream else {}), **kw)
        if not stream:
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, reason, chunks[-1].usage
    r = client.completions.create(model=model, prompt=record["prompt"], max_tokens=MAX_NEW,
                                  temperature=0, stream=stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {}), **kw)
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    chunks = list(r)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, reason, chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_through_the_api_is_transformers_greedy(served, references, real_runtime, stream):
    _, client = served
    stops = real_runtime.stop_token_ids
    for record, (ids, ref, ref_text) in zip(PROMPTS, references):
        text, reason, usage = ask(client, record, stream)
        assert text == ref_text, record
        ended_by_stop = bool(ref) and ref[-1] in stops
        assert reason == ("stop" if ended_by_stop else "length")
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(ref)


def test_a_stop_string_cuts_real_text(served, references):
    _, client = served
    record, (_, _, ref_text) = PROMPTS[2], references[2]
    stop = ref_text[len(ref_text) // 3:len(ref_text) // 3 + 6]
    for stream in (False, True):
        text, reason, _ = ask(client, record, stream, stop=[stop])
        assert text == ref_text[:ref_text.find(stop)] and reason == "stop"


def test_the_shipped_length_predictor_tells_long_answers_from_short_on_real_prompts(served, real_runtime):
    """The gateway predicts from its first request with the weights shipped for the default
    model (fitted on prompts the load tests do not send): on load-test prompts it has not seen,
    open chat questions (answers of hundreds of tokens) against one-tool-call agentic tasks
    (tens)."""
    import numpy as np

    from loadtest.workload import load_workload
    from workers.contract import SamplingParams

    emb, _ = served
    learner = emb.step_loop.lengths
    assert learner is not None and learner.weights is not None and learner.weights.dim == 576
    verifier = real_runtime.verifier(prefix_cache_mb=0)
    verifier.features = True

    def predicted(kind: str) -> float:
        out = []
        for i, record in enumerate(load_workload(kind)[:6]):
            ids = encode_record(real_runtime.tokenizer, record)
            done = verifier.prefill(f"{kind}{i}", ids, SamplingParams(), 4)
            verifier.release(f"{kind}{i}")
            mu, _, _ = learner.belief(done.features, 0)
            out.append(np.exp(mu))
        return float(np.median(out))

    assert predicted("chat") > 3 * predicted("agentic")
