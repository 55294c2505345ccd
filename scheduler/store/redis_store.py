"""RedisStore: scheduler state in a Redis server, so a restarted scheduler recovers every request.

Layout (`P` = the prefix, default "specgate:"; `ID` = a request id):

    P live       sorted set   live request ids, scored by admission sequence (load order)
    P seq        string       admission sequence counter (INCR)
    P vt         hash         "<priority class>:<tenant>" -> virtual time (float as text)
    P rec:ID     hash         v       record format version (1)
                              seq     admission sequence
                              prompt  JSON list of prompt token ids          (written once, at add)
                              params  JSON: sampling, stop_token_ids, stop,  (written once, at add)
                                      drafter, meta (the gateway's)
                              stats   JSON: RequestStats without tau_history (rewritten per step)
    P out:ID     list         committed output tokens                        (RPUSH per step)
    P tau:ID     list         τ per step, RequestStats.tau_history           (RPUSH per step)
    P model:NAME string       a learned model's weights, JSON with a "version" (the newest kept)
    P commits    channel      pub/sub: the ids each commit (and `add`) touched, published in it
                              (scheduler/store/redis_watch.py: followers wake on it)
    O ID         string       with an `owner` (O, NAME): NAME, the writer that holds the request
                              (set at `add`, so an adopter's add moves it; it expires with the
                              record): where any replica over the same Redis finds it

The kind comes before the id (`rec:ID`, not `ID:rec`), so no id can make one request's key equal
another's. A step therefore writes O(what it did): a few tokens, one small JSON and a τ per served
request. An ended request leaves `live` and its three keys get a TTL (PEXPIRE).

Round trips: `commit_step` is one MULTI/EXEC (its PUBLISH included); `add` is one EVALSHA (a
Lua script, because the duplicate check, the sequence number and the writes must be one atomic
step); `get` is one MULTI/EXEC; `load` is a ZRANGE then one pipeline per 500 requests;
`end_requests` (the step loop's write when Redis is full) one EVALSHA.

One writer: the scheduler. `commit_step` checks ids against the live ids this object knows (from
its own `add`s and its last `load`) instead of asking the server, which keeps a step at one round
trip; a new scheduler process opens a new store and calls `load` first. Other processes (gateways)
may open stores over the same prefix to `get` results. Keys for one request live in different
hash slots, so this is for a single Redis server (or a replicated one), not Redis Cluster.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, AsyncIterator, Iterable, Sequence

import redis

from scheduler.request import Request, RequestStats
from scheduler.store.base import (DEFAULT_ENDED_TTL_S, DEFAULT_PREFIX, Account, StepWrite,
                                  StoredState, StoreFull, Tail, Watch, account_from_str,
                                  account_to_str, check_step, model_version, params_to_dict,
                                  request_from_dict, stats_from_dict, stats_to_dict)
from scheduler.store.redis_client import REDIS_TIMEOUT_S, redis_client, store_full
from scheduler.store.redis_watch import RedisCommits, channel_of, message_of
from scheduler.store.watch import Waiter

FORMAT_VERSION = 1
_LOAD_CHUNK = 500        # requests per pipeline in load(): bounds one reply's size

# KEYS: rec, out, tau, live, seq, commits[, owner].  ARGV: id, prompt, params, stats, owner
# name, n_out, out..., tau...  Returns 0 if the id is already stored (live or ended within its
# TTL), else its sequence number.
_ADD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local seq = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[1], 'v', '%d', 'seq', seq, 'prompt', ARGV[2], 'params', ARGV[3],
           'stats', ARGV[4])
if KEYS[7] then redis.call('SET', KEYS[7], ARGV[5]) end
local function push(key, first, last)
  -- unpack() is bounded by Lua's C stack: push long lists in slices
  for i = first, last, 1000 do
    redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, last)))
  end
end
local n_out = tonumber(ARGV[6])
push(KEYS[2], 7, 6 + n_out)
push(KEYS[3], 7 + n_out, #ARGV)
redis.call('ZADD', KEYS[4], seq, ARGV[1])
redis.call('PUBLISH', KEYS[6], cjson.encode({ARGV[1]}))
return seq
""" % FORMAT_VERSION

# KEYS: model key.  ARGV: document (JSON), its version. Keeps the newer; 1 if it was kept.
_SAVE_MODEL_LUA = """
local held = redis.call('GET', KEYS[1])
if held then
  local v = cjson.decode(held)['version']
  if v and tonumber(v) >= tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

# KEYS: live, then rec, out, tau of each request, then the commits channel (its followers wake:
# PUBLISH adds no data either).  ARGV: the ended TTL (ms), then each request's
# id and stats (JSON).  NOTE: ZREM first. It adds nothing, so a full Redis runs it; and once a
# script has written, Redis lets it run to its end (it cannot stop an atomic script halfway), the
# HSETs included, which a full Redis refuses on their own. Each replaces a request's stats with
# stats of the same shape: the script adds no data, which is what a store at `maxmemory` may take.
_END_LUA = """
local n = (#ARGV - 1) / 2
local ids = {}
for i = 1, n do ids[i] = ARGV[2 * i] end
redis.call('ZREM', KEYS[1], unpack(ids))
for i = 1, n do
  redis.call('HSET', KEYS[3 * i - 1], 'stats', ARGV[2 * i + 1])
  for k = 3 * i - 1, 3 * i + 1 do redis.call('PEXPIRE', KEYS[k], ARGV[1]) end
end
redis.call('PUBLISH', KEYS[#KEYS], cjson.encode(ids))
return n
"""


def _dumps(obj: Any) -> str:
    # Compact, and numpy scalars (workers may hand them over) become plain numbers.
    return json.dumps(obj, separators=(",", ":"), default=_plain)


def _plain(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class RedisStore:
    remote = True                          # every call is a round trip, bounded by the client's timeout

    def __init__(self, client: redis.Redis, prefix: str = DEFAULT_PREFIX, *,
                 ended_ttl_s: float = DEFAULT_ENDED_TTL_S, owns_client: bool = False,
                 commits: RedisCommits | None = None,
                 owner: tuple[str, str] | None = None) -> None:
        """`client`: any redis-py client (not connected until first used). `owns_client`: close it
        in `close()`. `commits`: the subscriber `watch` waits on (`from_url` makes one); a store
        without one, over a bare client (a writer: replica adoption), has followers read only
        when their wait times out. `owner`: (key prefix, this writer's name): each request's
        owner key (layout above), for readers of every writer's requests (gateway/fleet.py)."""
        if ended_ttl_s <= 0:
            raise ValueError("ended_ttl_s must be > 0")
        self.prefix = prefix
        self.ended_ttl_ms = max(1, round(ended_ttl_s * 1000))
        self._r = client
        self._owns_client = owns_client
        self._add_script = client.register_script(_ADD_LUA)
        self._save_model_script = client.register_script(_SAVE_MODEL_LUA)
        self._end_script = client.register_script(_END_LUA)
        self._live_key, self._seq_key, self._vt_key = prefix + "live", prefix + "seq", prefix + "vt"
        self._channel = channel_of(prefix)
        self._commits = commits
        self._owners, self._owner = owner if owner is not None else (None, "")
        # The writer's view: live id -> τ entries already stored (what the next step appends after).
        self._taus: dict[str, int] = {}
        self._outs: dict[str, int] = {}         # live id -> output tokens already stored

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, *,
                 ended_ttl_s: float = DEFAULT_ENDED_TTL_S,
                 timeout_s: float | None = None,
                 owner: tuple[str, str] | None = None) -> "RedisStore":
        """Over a client of its own, every call bounded by `timeout_s` (redis_client.py)."""
        timeout_s = REDIS_TIMEOUT_S if timeout_s is None else timeout_s
        return cls(redis_client(url, timeout_s), prefix, ended_ttl_s=ended_ttl_s, owns_client=True,
                   commits=RedisCommits(url, prefix, timeout_s), owner=owner)

    def _keys(self, rid: str) -> tuple[str, str, str]:
        p = self.prefix
        return p + "rec:" + rid, p + "out:" + rid, p + "tau:" + rid

    def _expiring(self, rid: str) -> tuple[str, ...]:
        """The keys an ended request's TTL applies to: its three, and its owner key."""
        keys = self._keys(rid)
        return keys if self._owners is None else (*keys, self._owners + rid)

    # ---- writes -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        rid, s = req.request_id, req.stats
        rec, out, tau = self._keys(rid)
        outputs, taus = [int(t) for t in req.output_ids], [int(t) for t in s.tau_history]
        keys = [rec, out, tau, self._live_key, self._seq_key, self._channel]
        seq = self._add_script(
            keys=keys if self._owners is None else [*keys, self._owners + rid],
            args=[rid, _dumps([int(t) for t in req.prompt_ids]), _dumps(params_to_dict(req)),
                  _dumps(stats_to_dict(s, tau_history=False)), self._owner, len(outputs),
                  *outputs, *taus])
        if not seq:
            raise ValueError(f"request {rid!r} is already stored")
        self._taus[rid] = len(taus)
        self._outs[rid] = len(outputs)

    def commit_step(self, step: StepWrite) -> None:
        if not step:
            return                              # nothing to write: no round trip
        known = self._taus
        check_step(step, known)                 # before any write: all or nothing
        pipe = self._r.pipeline(transaction=True)
        # Idempotent: the lists are trimmed back to what this writer knows is stored before the
        # push, so a write retried after its reply was lost (Redis restarting) adds nothing twice.
        new_outs = {}
        for rid, tokens in step.appended.items():
            if tokens:
                out, stored = self._keys(rid)[1], self._outs.get(rid, 0)
                self._trim(pipe, out, stored)
                pipe.rpush(out, *[int(t) for t in tokens])
                new_outs[rid] = stored + len(tokens)
        new_counts = {}
        for rid, s in step.stats_by_id().items():
            rec, _, tau = self._keys(rid)
            pipe.hset(rec, "stats", _dumps(stats_to_dict(s, tau_history=False)))
            new_counts[rid] = self._push_history(pipe, tau, known[rid], s.tau_history)
        for s in step.ended:
            pipe.zrem(self._live_key, s.request_id)
            for key in self._expiring(s.request_id):
                pipe.pexpire(key, self.ended_ttl_ms)
        if step.virtual_time:
            pipe.hset(self._vt_key, mapping={account_to_str(a): repr(float(v))
                                             for a, v in step.virtual_time.items()})
        touched = step.touched()
        if touched:                             # in the transaction: heard once it is written
            pipe.publish(self._channel, message_of(touched))
        try:
            pipe.execute()
        except redis.ResponseError as exc:      # MULTI/EXEC: refused whole, nothing written
            if store_full(exc):
                raise StoreFull(str(exc)) from exc
            raise
        known.update(new_counts)                # only once the server has it
        self._outs.update(new_outs)
        for s in step.ended:
            known.pop(s.request_id, None)
            self._outs.pop(s.request_id, None)

    def end_requests(self, ended: Sequence[RequestStats]) -> None:
        """`StateStore.end_requests`: one EVALSHA that a full Redis runs (`_END_LUA`)."""
        if not ended:
            return
        keys, args = [self._live_key], [self.ended_ttl_ms]
        for s in ended:
            if not s.status.terminal:
                raise ValueError(f"end_requests: request {s.request_id!r} is {s.status.value}")
            keys.extend(self._keys(s.request_id))
            args += [s.request_id, _dumps(stats_to_dict(s, tau_history=False))]
        self._end_script(keys=keys + [self._channel], args=args)
        if self._owners is not None:            # PEXPIRE adds no data: a full Redis takes it
            pipe = self._r.pipeline(transaction=False)
            for s in ended:
                pipe.pexpire(self._owners + s.request_id, self.ended_ttl_ms)
            pipe.execute()
        for s in ended:
            self._taus.pop(s.request_id, None)
            self._outs.pop(s.request_id, None)

    def hand_over(self, request_ids: list[str]) -> None:
        """Requests another replica's store has taken over (this one's replica died): out of
        `live`, and their keys expire as an ended request's do. One MULTI/EXEC."""
        if not request_ids:
            return
        pipe = self._r.pipeline(transaction=True)
        pipe.zrem(self._live_key, *request_ids)
        for rid in request_ids:
            for key in self._keys(rid):
                pipe.pexpire(key, self.ended_ttl_ms)
            self._taus.pop(rid, None)
            self._outs.pop(rid, None)
        pipe.execute()

    @staticmethod
    def _push_history(pipe, key: str, stored: int, history: list[int]) -> int:
        """Queue the τ values beyond the `stored` ones; returns the new stored count. The history
        only grows; if it shrank, someone reset it, and the stored list is rewritten."""
        if len(history) < stored:
            pipe.delete(key)
            stored = 0
        if len(history) > stored:
            RedisStore._trim(pipe, key, stored)
            pipe.rpush(key, *[int(t) for t in history[stored:]])
        return len(history)

    @staticmethod
    def _trim(pipe, key: str, keep: int) -> None:
        """Queue cutting the list at `key` back to its first `keep` items."""
        if keep:
            pipe.ltrim(key, 0, keep - 1)
        else:
            pipe.delete(key)

    # ---- reads ------------------------------------------------------------------------------
    def watch(self, request_id: str) -> AbstractAsyncContextManager[Watch]:
        if self._commits is None:
            return _unwoken()
        return self._commits.watch(request_id)

    def load(self) -> StoredState:
        ids = [_text(x) for x in self._r.zrange(self._live_key, 0, -1)]
        requests: list[Request] = []
        vt: dict[Account, float] = {}
        for start in range(0, max(len(ids), 1), _LOAD_CHUNK):
            chunk = ids[start:start + _LOAD_CHUNK]
            pipe = self._r.pipeline(transaction=False)
            if start == 0:
                pipe.hgetall(self._vt_key)
            for rid in chunk:
                self._queue_read(pipe, rid)
            replies = pipe.execute()
            if start == 0:
                vt = {account_from_str(_text(k)): float(v) for k, v in replies[0].items()}
                replies = replies[1:]
            for i, rid in enumerate(chunk):
                req = self._decode(replies[3 * i:3 * i + 3])
                if req is not None:             # evicted by a maxmemory policy: nothing to do
                    requests.append(req)
        self._taus = {r.request_id: len(r.stats.tau_history) for r in requests}
        self._outs = {r.request_id: len(r.output_ids) for r in requests}
        return StoredState(requests, vt)

    def get(self, request_id: str) -> Request | None:
        pipe = self._r.pipeline(transaction=True)   # one consistent snapshot of the three keys
        self._queue_read(pipe, request_id)
        return self._decode(pipe.execute())

    def tail(self, request_id: str, start: int, *, prompt: bool = False) -> Tail | None:
        rec, out, _ = self._keys(request_id)
        pipe = self._r.pipeline(transaction=True)   # tokens and stats from one instant
        pipe.hmget(rec, "params", "stats", "prompt" if prompt else "v")
        pipe.lrange(out, max(0, int(start)), -1)
        (params, stats, prompt_ids), tokens = pipe.execute()
        if stats is None:
            return None
        return Tail([int(t) for t in tokens], stats_from_dict(json.loads(stats)),
                    dict(json.loads(params).get("meta") or {}) if params else {},
                    [int(t) for t in json.loads(prompt_ids)] if prompt and prompt_ids else None)

    def save_model(self, name: str, doc: dict[str, Any]) -> bool:
        version = model_version(doc)
        return bool(self._save_model_script(keys=[self.prefix + "model:" + name],
                                            args=[_dumps(doc), version]))

    def load_model(self, name: str) -> dict[str, Any] | None:
        held = self._r.get(self.prefix + "model:" + name)
        return None if held is None else json.loads(held)

    def close(self) -> None:
        if self._owns_client:
            self._r.close()

    def _queue_read(self, pipe, rid: str) -> None:
        rec, out, tau = self._keys(rid)
        pipe.hmget(rec, "prompt", "params", "stats")
        pipe.lrange(out, 0, -1)
        pipe.lrange(tau, 0, -1)

    @staticmethod
    def _decode(replies: Iterable[Any]) -> Request | None:
        (prompt, params, stats), outputs, taus = replies
        if prompt is None:
            return None
        return request_from_dict({"prompt_ids": json.loads(prompt), **json.loads(params),
                                  "stats": {**json.loads(stats), "tau_history": taus},
                                  "output_ids": outputs})


@asynccontextmanager
async def _unwoken() -> AsyncIterator[Watch]:
    """A store with no subscriber: a waiter nothing wakes (its waits time out)."""
    yield Waiter(asyncio.get_running_loop())
