"""A worker without a model: the step loop's `Worker` calls, with configurable acceptance and cost.

Every request has a fixed "true" continuation (`token_at(request_id, position)`), so what a loop
streams can be checked token by token, across preemption, eviction and restarts. Each step draws,
per request, how many of its drafts the target would accept: successes in a row with probability
α (the request's own, from `alpha`), capped by the tree depth the plan allowed, then the bonus.
With a `FakeClock`, a step advances time by `step_cost(batch size, tree tokens)` seconds, so tests
and simulations run in simulated time.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from workers.contract import Prefilled, SamplingParams, StepResult, TokenLogprob, WorkItem


def token_at(request_id: str, position: int, vocab: int = 1000) -> int:
    """The token a request's target produces at output `position` (0 = first output token);
    never 0, 1 or 2, so tests can use those as stop tokens on purpose."""
    return 3 + (zlib.crc32(request_id.encode()) + 7919 * position) % (vocab - 3)


def fake_logprob(request_id: str, position: int, k: int, vocab: int = 1000) -> TokenLogprob:
    """What the fake worker reports as the logprobs of `token_at(request_id, position)`: the
    chosen token at a made-up log-probability, and `k` alternatives with the chosen one first
    (deterministic, so the gateway's rendering can be checked against it)."""
    tok = token_at(request_id, position, vocab)
    lp = -0.25 * (1 + position % 4)
    top = tuple((tok if i == 0 else 3 + (tok + 11 * i) % (vocab - 3), lp - i) for i in range(k))
    return lp, top


@dataclass
class FakeClock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Fake:
    output_len: int       # output tokens committed so far
    pending: int = 0      # context tokens without KV yet (chunked prefill)
    prompt_len: int = 0
    logprobs: int | None = None   # SamplingParams.logprobs

    def kv_tokens(self, block: int) -> int:
        """KV slots held: the context and one more, in whole blocks (as the verifier grows)."""
        return -(-(self.prompt_len + self.output_len + 1) // block) * block


class FakeWorker:
    def __init__(self, *, alpha: float | Callable[[str], float] = 0.6, context_limit: int = 4096,
                 step_cost: Callable[[int, int], float] | None = None, clock: FakeClock | None = None,
                 seed: int = 0, fail_on: Callable[[Sequence[WorkItem]], bool] | None = None,
                 kv_block: int = 16):
        self.alpha = alpha if callable(alpha) else (lambda _rid, a=alpha: a)
        self.context_limit = context_limit
        self.step_cost = step_cost or (lambda batch, tokens: 0.01 + 0.001 * tokens)
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.fail_on = fail_on                      # raise in step() when this says so (failure tests)
        self.kv_block = kv_block
        self.prefills: list[tuple[str, int]] = []   # (request id, tokens prefilled), in order
        self.batches: list[list[str]] = []          # request ids of every step, in order
        self.tenants: dict[str, str] = {}           # request id -> the tenant its prefill named
        self.dropped_tenants: list[str] = []        # `drop_tenant` calls, in order
        self._resident: dict[str, _Fake] = {}

    def resident(self) -> list[str]:
        return list(self._resident)

    def prefix_cache_usage(self) -> tuple[int, int] | None:
        return None                         # no prefix cache

    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str = "default",
                drafter: str | None = None, defer: bool = False) -> Prefilled:
        if request_id in self._resident:
            raise ValueError(f"request {request_id!r} is already admitted")
        self.prefills.append((request_id, len(token_ids)))
        self.tenants[request_id] = tenant
        pending = len(token_ids) - 1 if defer else 0
        fake = self._resident[request_id] = _Fake(len(token_ids) - prompt_len, pending, prompt_len,
                                                  sampling.logprobs)
        if self.clock is not None and not defer:
            self.clock.now += self.step_cost(1, len(token_ids))
        return Prefilled(pending=pending, kv_tokens=fake.kv_tokens(self.kv_block))

    def kv_tokens(self) -> int:
        """KV slots held by every resident request."""
        return sum(f.kv_tokens(self.kv_block) for f in self._resident.values())

    def release(self, request_id: str) -> None:
        self._resident.pop(request_id, None)

    def evict(self, request_id: str) -> None:
        self.release(request_id)            # no drafter state to keep apart

    def drop_tenant(self, tenant: str) -> None:
        self.dropped_tenants.append(tenant)  # no caches: only recorded (tests)

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        if self.fail_on is not None and self.fail_on(items):
            raise RuntimeError("injected step failure")
        self.batches.append([i.request_id for i in items])
        out, chunks = [], 0
        for item in items:
            fake = self._resident[item.request_id]   # KeyError if not resident, like the verifier
            chunk = min(max(item.prefill, 0), fake.pending)
            fake.pending -= chunk
            chunks += chunk
            if fake.pending or not item.decode:
                out.append(StepResult(item.request_id, (), 0, 0, prefilled=chunk, pending=fake.pending,
                                      kv_tokens=fake.kv_tokens(self.kv_block)))
                continue
            depth = item.budget.max_depth if item.budget.speculates else 0
            a = self.alpha(item.request_id)
            accepted = 0
            while accepted < depth and self.rng.random() < a:
                accepted += 1
            tokens = tuple(token_at(item.request_id, fake.output_len + k) for k in range(accepted + 1))
            logprobs = None if fake.logprobs is None else tuple(
                fake_logprob(item.request_id, fake.output_len + k, fake.logprobs) for k in range(len(tokens)))
            fake.output_len += len(tokens)
            out.append(StepResult(item.request_id, tokens, accepted, item.budget.max_nodes if depth else 0,
                                  draft_depth=depth, prefilled=chunk,
                                  kv_tokens=fake.kv_tokens(self.kv_block), logprobs=logprobs))
        if self.clock is not None:
            # a chunk's rows cost what they would as tree rows (the step's cost per token)
            self.clock.now += self.step_cost(len(items), sum(r.tree_tokens for r in out) + chunks)
        return out


class PacedFakeWorker(FakeWorker):
    """The fake worker, sleeping `step_s` per step: a stand-in for a real step's cost, so the
    gateway's own overhead can be measured against something."""

    def __init__(self, step_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_s = step_s

    def step(self, items):
        if self.step_s:
            time.sleep(self.step_s)
        return super().step(items)
