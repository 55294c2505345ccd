"""KV affinity on Ray Serve: a request router for the verifier deployment.

Why Serve's custom request routing (`RequestRouter`, alpha in Ray 2.60) and not multiplexing or
one deployment per GPU: multiplexing routes by a model id with a best-effort timeout and falls back
to any replica, which would send a verification to a replica without the request's KV; a
deployment per replica gives up Serve's replica management and autoscaling. A router sees the
call's arguments and every running replica, so it can honour a pin exactly and still let Serve
add, replace and drain replicas.

Rules (`rank_replicas`, pure):
- a call naming `replica=<id>` (every call after a request's prefill, see `VerifierPool`) goes to
  that replica; if it is gone, to the others, whose answer says the request is not resident;
- replicas named in `avoid` (seen to die) are used only when no other is left;
- a call naming `affinity=<key>` (draft workers: the calling verifier replica's id) goes to the
  replica the key hashes to (rendezvous hashing), so a key's drafter state stays in one place;
- a call naming none (a new request's prefill) goes where KV room is: the replica with the largest
  share of its KV pool free, in eighths of a pool, from the `free` the call carries (each
  replica's latest report, see `VerifierPool.kv_budgets`; a replica that has not reported yet
  holds none), the rule by which the planner plans the start (scheduler/kv_budget.py
  `placement_key`); where the planner placed it (`prefer`, `Plan.homes`), there, unless some
  replica has not reported yet (the planner does not know it; it is empty, and goes first). Without `free` (no replica has reported a KV pool), or among equals, the replica holding the
  fewest requests, from the `loads` the call carries: the one scheduler knows where every request
  lives (Serve's own routing stats are refreshed only every few seconds, so a burst would all land
  on one replica); a replica it has not used yet holds none. Ties go to the replica given the
  fewest requests so far (`assigned`), so sequential requests alternate, then by replica id.
"""
from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from scheduler.kv_budget import placement_key


def rank_replicas(replicas: Sequence[str], pinned: str | None, loads: Mapping[str, int] | None = None,
                  assigned: Mapping[str, int] | None = None, avoid: Sequence[str] = (),
                  affinity: str | None = None,
                  free: Mapping[str, float] | None = None,
                  prefer: str | None = None) -> list[list[str]]:
    """Replica ids in ranks of preference, from the running replicas, the call's pin, free KV
    shares, the planner's placement and loads.

    >>> rank_replicas(["a", "b", "c"], "a", {"a": 3, "b": 1})
    [['a']]
    >>> rank_replicas(["a", "b", "c"], None, {"a": 3, "b": 1}), rank_replicas(["a", "b", "c"], "gone", {"a": 3, "b": 1})
    ([['c'], ['b'], ['a']], [['c'], ['b'], ['a']])
    >>> rank_replicas(["a", "b"], None, {}, {"a": 5, "b": 4})
    [['b'], ['a']]

    The largest share of the KV pool free first (in eighths), then loads; a replica without a
    report is empty:
    >>> rank_replicas(["a", "b", "c"], None, {"a": 3, "b": 1}, free={"a": 0.9, "b": 0.2, "c": 0.9})
    [['c'], ['a'], ['b']]
    >>> rank_replicas(["a", "b", "c"], None, {"a": 3, "b": 1}, free={"a": 0.99, "b": 0.98})
    [['c'], ['b'], ['a']]

    The planner's placement (`prefer`) among the replicas that have reported; one that has not
    is unknown to the planner, and empty, so it comes first:
    >>> rank_replicas(["a", "b"], None, {"a": 3, "b": 1}, free={"a": 0.9, "b": 0.9}, prefer="a")
    [['a'], ['b']]
    >>> rank_replicas(["a", "b", "c"], None, {"a": 3, "b": 1}, free={"a": 0.9, "b": 0.9}, prefer="a")
    [['c'], ['a'], ['b']]
    """
    if pinned is not None and pinned in replicas:
        return [[pinned]]
    # Replicas the caller saw die may still be listed until Serve notices; use them only if
    # nothing else is left.
    replicas = [rid for rid in replicas if rid not in avoid] or list(replicas)
    if affinity is not None:
        # Rendezvous hashing: each key prefers the replica with the highest hash of (key, replica);
        # adding or removing a replica moves only the keys that preferred it.
        return [[rid] for rid in sorted(replicas, key=lambda rid: _weight(affinity, rid), reverse=True)]
    loads, assigned, free = loads or {}, assigned or {}, free or {}
    # a replica that has not reported holds nothing yet
    return [[rid] for rid in sorted(replicas, key=lambda rid: (
        bool(free) and rid in free, prefer is None or rid != prefer,
        *placement_key(None, free.get(rid, 1.0), loads.get(rid, 0)), assigned.get(rid, 0), rid))]


def _weight(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


class KVAffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: Sequence[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = (pending_request.kwargs or {}) if pending_request is not None else {}
        ranks = rank_replicas(list(by_id), kwargs.get("replica"), kwargs.get("loads"),
                              kwargs.get("assigned"), kwargs.get("avoid") or (), kwargs.get("affinity"),
                              kwargs.get("free"), kwargs.get("prefer"))
        return [[by_id[rid] for rid in rank] for rank in ranks]
