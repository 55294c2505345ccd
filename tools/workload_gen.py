"""Synthetic serving workloads for the simulator: tenants, arrivals, lengths, acceptance.

The default workload (`DEFAULT_TENANTS`, `WorkloadSpec()`) is meant to look like a shared
endpoint in front of the CPU engine, not to favour any policy. Its parameters, and why they are
plausible:

* **Tenants.** Four, one heavier: `chat` 40% of requests, `rag` 25%, `code` 20%, `agent` 15%;
  all priority class 0, weight 1.
* **Output lengths** are log-normal per tenant (median tokens, σ of ln), capped at max_tokens
  (a capped request finishes with "length"): chat 200 / 0.9 (ShareGPT and LMSYS-Chat answers:
  mean 200–350 tokens, long right tail), code 30 / 1.2 (completion-style traffic: the Azure code
  trace in Splitwise has a median output of a few tens of tokens), rag 120 / 0.7 (short grounded
  answers), agent 600 / 0.7 (long transcripts, plans, tool-call JSON). Overall: mean ≈ 284,
  median ≈ 154, p99 ≈ 1,900 tokens, squared coefficient of variation ≈ 1.8.
* **Prompt lengths** are log-normal too (medians 200 / 1,000 / 800 / 1,000 tokens, σ 0.5–0.8);
  the simulator charges each prompt once, in the request's first step (prefill).
* **Length predictor**: predicted = true length · exp(N(0, 0.9²)), capped at max_tokens: Kendall
  τ ≈ 0.6 with the truth over the mix (0.44–0.56 within a tenant) and 57% of predictions within a
  factor of 2, about what learned output-length predictors report (Kendall τ 0.5–0.6 on
  ShareGPT / LMSYS-Chat for the ranking predictor of Fu et al., "Efficient LLM Scheduling by
  Learning to Rank", 2024). The predictor's noise is drawn whether or not a run uses one, so a
  run with another `predictor_sigma` (or none) sees the same requests.
* **Acceptance.** Each request's true α is drawn from a per-tenant Beta: chat Beta(1.5, 4) (mean
  0.27), code Beta(6, 2) (0.75), rag Beta(5, 2) (0.71), agent Beta(3, 3) (0.50). We measured
  prompt-lookup drafting on this model from slower than plain decoding (open chat:
  drafts rarely match) to several times faster (copy / extract): acceptance really does differ
  this much by task.
* **Early steps mislead.** The α a request shows in its step t mixes in an independent "opening"
  α₀ ~ Beta(2, 2) with weight exp(−t ÷ 6): the first tokens of an answer (greetings, restating the
  question, headings, code fences) and drafters that have little generated context to match make
  early acceptance a poor guide to the rest. τ also has its own sampling noise: the number of
  accepted draft tokens is geometric.
* **Arrivals** are Poisson (exponential gaps), tenants interleaved at random by share. Real LLM
  traffic is burstier (BurstGPT, Wang et al. 2024, fits Gamma-distributed gaps to Azure OpenAI
  traces); `arrival_cv` > 1 draws Gamma gaps with that coefficient of variation, for sensitivity
  runs. The default stays Poisson, the usual assumption, which is the kinder one to FCFS.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TenantMix:
    name: str
    share: float                  # fraction of requests
    out_median: float             # output tokens, log-normal
    out_sigma: float
    prompt_median: float
    prompt_sigma: float
    alpha_a: float                # true acceptance α ~ Beta(alpha_a, alpha_b)
    alpha_b: float
    max_tokens: int = 2048
    priority: int = 0
    # per request max_tokens drawn log-uniformly from (LO, HI), as `loadtest --max-tokens LO-HI`
    # asks; None: every request asks for `max_tokens`
    max_tokens_range: tuple[int, int] | None = None


DEFAULT_TENANTS = (
    TenantMix("chat", 0.40, 200, 0.9, 200, 0.8, 1.5, 4.0),
    TenantMix("code", 0.20, 30, 1.2, 1000, 0.6, 6.0, 2.0, max_tokens=1024),
    TenantMix("rag", 0.25, 120, 0.7, 800, 0.5, 5.0, 2.0),
    TenantMix("agent", 0.15, 600, 0.7, 1000, 0.6, 3.0, 3.0, max_tokens=4096),
)

# What `specgate loadtest compare --max-tokens 8-256` sends the gateway (`--workload loadtest`):
# two tenants of the same mix (chat, copy, code, summarize, extract), ~300-token prompts, each
# request asking for a max_tokens drawn log-uniformly from 8-256, answers that would run on
# (log-normal, median 70) and mostly stop at that bound, drafts accepted at mixed rates (copy and
# extract high, chat low), and no length predictor (the gateway has none).
LOADTEST_TENANTS = tuple(
    TenantMix(name, 0.5, 70, 1.0, 300, 0.5, 2.0, 2.0, max_tokens=256, max_tokens_range=(8, 256))
    for name in ("tenant-a", "tenant-b"))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    tenants: tuple[TenantMix, ...] = DEFAULT_TENANTS
    predictor_sigma: float | None = 0.9   # ln-space error of the length predictor; None: none
    early_steps: float = 6.0              # steps over which the opening α fades (e-folding)
    early_alpha: tuple[float, float] = (2.0, 2.0)
    prefill: bool = True                  # charge each prompt's prefill pass
    arrival_cv: float = 1.0               # coefficient of variation of the gaps; 1: Poisson
    # The predictor re-predicting the remaining length as a request runs (the gateway's, from the
    # target's hidden state): ((committed c, σ of ln(remaining) error at c), ...), c ascending
    # from 0, as `specgate bench lengths` measures it; None: predictions at arrival only.
    repredict: tuple[tuple[int, float], ...] | None = None

    def repredict_at(self, committed: int) -> tuple[int, float]:
        """(checkpoint, σ): the latest checkpoint at or before `committed`, and its error."""
        best = self.repredict[0]
        for c, sigma in self.repredict:
            if c > committed:
                break
            best = (c, sigma)
        return best


@dataclass(slots=True)
class SimRequest:
    """Ground truth for one simulated request (the policy never sees output_len or alpha)."""
    index: int
    request_id: str
    tenant: str
    priority: int
    arrival_s: float
    prompt_len: int
    max_tokens: int
    output_len: int               # tokens it will produce (≤ max_tokens)
    hits_length: bool             # True when max_tokens cut it short
    predicted_len: int | None
    alpha: float
    alpha_early: float
    seed: int = 0
    extra: dict = field(default_factory=dict)
    natural_len: int = 0          # the length it would have without max_tokens
    pred_err: float = 0.0         # its predictor's N(0, 1) error draw at arrival

    def alpha_at(self, step: int, fade: float) -> float:
        """The α it shows in its step number `step` (0-based): α₀ fading into α."""
        w = math.exp(-step / fade)
        return w * self.alpha_early + (1.0 - w) * self.alpha


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def generate(spec: WorkloadSpec, n: int, seed: int) -> list[SimRequest]:
    """n requests with arrival_s = 0; `with_arrivals` spreads them out afterwards."""
    rng = random.Random(seed)
    # a stream of its own: where every bound is fixed, `rng`'s draws stay what they were
    bound_rng = random.Random(seed + 7919)
    names = [t for t in spec.tenants]
    weights = [t.share for t in spec.tenants]
    out = []
    for i in range(n):
        t = rng.choices(names, weights)[0]
        natural = max(1, round(_lognormal(rng, t.out_median, t.out_sigma)))
        bound = t.max_tokens
        if t.max_tokens_range is not None:
            lo, hi = t.max_tokens_range
            bound = min(hi, int(math.exp(bound_rng.uniform(math.log(lo), math.log(hi + 1)))))
        length = min(natural, bound)
        err = rng.gauss(0.0, 1.0)     # drawn either way: the same requests with or without one
        pred = None
        if spec.predictor_sigma is not None:
            pred = min(bound, max(1, round(natural * math.exp(
                spec.predictor_sigma * err))))
        out.append(SimRequest(
            index=i, request_id=f"r{i}", tenant=t.name, priority=t.priority, arrival_s=0.0,
            prompt_len=max(1, round(_lognormal(rng, t.prompt_median, t.prompt_sigma))),
            max_tokens=bound, output_len=length, hits_length=natural >= bound,
            predicted_len=pred, alpha=rng.betavariate(t.alpha_a, t.alpha_b),
            alpha_early=rng.betavariate(*spec.early_alpha), seed=rng.getrandbits(32),
            natural_len=natural, pred_err=err))
    return out


def with_arrivals(requests: list[SimRequest], rate: float, seed: int,
                  cv: float = 1.0) -> list[SimRequest]:
    """Arrivals at `rate` requests per second, in index order: Poisson (cv = 1), or Gamma gaps
    with coefficient of variation `cv` (burstier when cv > 1)."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    t = 0.0
    for r in requests:
        t += rng.expovariate(rate) if cv == 1.0 else rng.gammavariate(shape, 1.0 / (rate * shape))
        r.arrival_s = t
    return requests
