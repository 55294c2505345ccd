"""A step's results as commits: the per-request bookkeeping between the worker's answer and the
store write (scheduler/loop.py persists, then streams, what this returns).

For each result: the KV it now holds (`KVResidency.hold`), its length re-predicted from the
features the worker reported, and its tokens cut at a stop token or its output limit
(`Request.commit`), their logprobs cut where the tokens were. A result that only prefilled
commits nothing. Loop thread only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from scheduler.request import Request, RequestStats, Status, StepRecord
from scheduler.residency import KVResidency
from workers.contract import StepResult

class Predict(Protocol):
    def __call__(self, req: Request, features: Sequence[float], committed: int, *,
                 touch: bool = True) -> None:
        """Re-predict `req`'s remaining length from `features`, which are of its first
        `committed` tokens; `touch`: re-rank it before the next plan."""


@dataclass
class Commits:
    """What a step committed: the policy's records, and each request's new tokens and logprobs."""
    records: list[StepRecord] = field(default_factory=list)
    appended: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)


def commit_results(results: Sequence[StepResult], requests: Mapping[str, Request],
                   limits: Mapping[str, int], kv: KVResidency, predict: Predict) -> Commits:
    """The commits of a step's `results` (module docstring); `requests`, `limits`: the loop's live
    requests and their output token limits, by id."""
    out = Commits()
    # bound once: this loop runs for every request of every step
    hold, served, appended, records = kv.hold, kv.served, out.appended, out.records.append
    for res in results:
        rid = res.request_id
        req = requests[rid]
        req.stats.prefill_left = res.pending
        hold(req.stats, res.kv_tokens, res.home)
        if not res.tokens:                         # only prefilled: nothing to commit
            if res.features is not None:           # ahead of its turn, now ready
                predict(req, res.features, len(req.output_ids))
            continue
        if res.features is not None:
            # the features are of the row that read the last accepted token
            predict(req, res.features, len(req.output_ids) + res.accepted, touch=False)
        tokens, record = req.commit(res, limits[rid])
        appended[rid] = tokens
        if res.logprobs is not None:
            out.logprobs[rid] = res.logprobs[:len(tokens)]      # cut where the tokens were
        records(record)
        served(rid)                                             # most recently served last
    return out


def unstored(appended: Mapping[str, Sequence[int]], ended: list[RequestStats]) -> list[RequestStats]:
    """Requests whose step the store refused: failed, with what the store holds of them (their
    tokens of that step, `appended`, were neither stored nor streamed, so a resumed stream gives
    exactly what was sent). Returns `ended`."""
    for s in ended:
        s.status, s.cause = Status.FAILED, "error"
        s.committed -= len(appended.get(s.request_id, ()))
    return ended
