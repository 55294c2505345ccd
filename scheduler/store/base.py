"""The state store interface, the data a step writes, and the codec every store shares.

A state store persists what a scheduler needs to survive a restart (docs/design.md, "State in Redis"):
every live request's full record and the tenants' virtual times. The scheduler is the one writer;
gateways may read (`get`) to fetch a result.

Writes come in two sizes. `add` writes a request once, at admission. `commit_step` writes one
step's changes, append-only where the data is append-only (output tokens, τ history), so a step
costs O(what the step did), not O(what the requests hold).

The codec turns a `Request` into JSON-able dicts and back. It is pure and shared by both stores, so
the memory store has the same value semantics as Redis: a caller never holds the store's objects.
"""
from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from scheduler.request import Request, RequestStats, Status
from scheduler.alpha import AlphaEstimate
from workers.contract import SamplingParams

Account = tuple[int, str]      # (priority class, tenant): one fairness account

DEFAULT_PREFIX = "specgate:"
DEFAULT_ENDED_TTL_S = 3600.0   # how long an ended record stays fetchable


@dataclass(frozen=True)
class StepWrite:
    """What one scheduler step changed.

    appended:     request id -> output tokens committed this step (appended, never rewritten).
    updated:      stats of requests served or whose status changed this step.
    ended:        final stats of requests that reached a terminal state: they leave the live set,
                  their record is kept for the store's ended TTL. Need not repeat in `updated`.
    virtual_time: current values of the fairness accounts that changed (accounts not named keep
                  their stored value; accounts are never deleted).
    """
    appended: Mapping[str, Sequence[int]] = field(default_factory=dict)
    updated: Sequence[RequestStats] = ()
    ended: Sequence[RequestStats] = ()
    virtual_time: Mapping[Account, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.appended or self.updated or self.ended or self.virtual_time)

    def touched(self) -> set[str]:
        """Every request this step writes something of: whose followers it wakes."""
        return {*self.appended, *(s.request_id for s in self.updated),
                *(s.request_id for s in self.ended)}

    def stats_by_id(self) -> dict[str, RequestStats]:
        """Every request whose stats this step writes; an ended entry wins over an updated one."""
        out = {s.request_id: s for s in self.updated}
        out.update((s.request_id, s) for s in self.ended)
        return out


@dataclass(frozen=True)
class Tail:
    """A request's output from some index on, and its stats as they were stored with it."""
    tokens: list[int]
    stats: RequestStats
    meta: dict
    prompt_ids: list[int] | None = None       # when asked for


@dataclass
class StoredState:
    """What a new scheduler loads after a restart."""
    requests: list[Request]                                    # live ones, admission order
    virtual_time: dict[Account, float] = field(default_factory=dict)


class StoreFull(Exception):
    """The store refused a write for want of memory (Redis at `maxmemory`, `noeviction`): nothing
    of it was written. Not an outage: waiting does not make room (scheduler/store/writer.py)."""


class Watch(Protocol):
    async def wait(self, timeout_s: float) -> bool:
        """Until the watched request's next commit (True) or `timeout_s` (False); raises a
        Redis error once the store's notifications have stopped (Redis away)."""


class RecordReader(Protocol):
    """What readers of requests (followers, a stored response's reads) use of a store: a
    `StateStore` has it, and so has a reader of several stores (gateway/assembly/fleet.py)."""
    remote: bool

    def get(self, request_id: str) -> Request | None: ...

    def tail(self, request_id: str, start: int, *, prompt: bool = False) -> Tail | None: ...

    def watch(self, request_id: str) -> AbstractAsyncContextManager[Watch]: ...


@runtime_checkable
class StateStore(Protocol):
    # Does a call wait on the network (Redis)? Then callers on an event loop make it elsewhere.
    remote: bool

    def add(self, req: Request) -> None:
        """Persist a newly admitted request. ValueError if its id is already stored (live, or
        ended and still within the TTL). One round trip."""

    def commit_step(self, step: StepWrite) -> None:
        """Persist one step, all or nothing. KeyError (and nothing written) if the step names a
        request that is not live in this store; ValueError if an ended one is not terminal.
        One round trip; none for an empty step."""

    def end_requests(self, ended: Sequence[RequestStats]) -> None:
        """End live requests (terminal stats) as `commit_step(StepWrite(ended=ended))` does, in
        a way a full store still takes: what the step loop writes when a step's write was
        refused with StoreFull, so that its requests end rather than stay live for ever. It
        adds no data (their stats replace their stats; their keys get the ended TTL)."""

    def load(self) -> StoredState:
        """Every live request with its full record, in admission order, and the virtual times."""

    def get(self, request_id: str) -> Request | None:
        """A live or recently ended request; None if unknown or expired."""

    def tail(self, request_id: str, start: int, *, prompt: bool = False) -> Tail | None:
        """What a reader following a request needs: the output tokens from index `start` on and
        its stats now, in one consistent read (and its prompt, when asked: a reader needs it
        once); None if unknown or expired. One round trip, O(new tokens)."""

    def watch(self, request_id: str) -> AbstractAsyncContextManager[Watch]:
        """A reader's wait for the request's commits (scheduler/store/watch.py): enter it on the
        event loop that waits, before the read it must not miss a commit after. Waiting holds no
        thread; a commit (or its `add`) after entering wakes it, from any process over the same
        store."""

    def save_model(self, name: str, doc: dict[str, Any]) -> bool:
        """Keep a learned model's weights (plain JSON data with an integer "version") under
        `name`, unless the store already holds a version at least as new: replicas that train
        the same model keep the newest, and a restart finds it. True if it was kept."""

    def load_model(self, name: str) -> dict[str, Any] | None:
        """The weights last kept under `name`; None if none."""

    def close(self) -> None: ...


def model_version(doc: Any) -> int:
    """A model document's version (ValueError unless it is a mapping with an integer version).

    >>> model_version({"version": 3, "w": [0.5]})
    3
    """
    version = doc.get("version") if isinstance(doc, Mapping) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError("a model document needs an integer 'version'")
    return version


def check_step(step: StepWrite, live: Iterable[str] | Mapping[str, Any]) -> None:
    """The validation both stores apply before writing anything (`live`: a set or a dict)."""
    for rid in step.appended:
        if rid not in live:
            raise KeyError(f"commit_step: request {rid!r} is not live")
    for s in step.updated:
        if s.request_id not in live:
            raise KeyError(f"commit_step: request {s.request_id!r} is not live")
    for s in step.ended:
        if s.request_id not in live:
            raise KeyError(f"commit_step: request {s.request_id!r} is not live")
        if not s.status.terminal:
            raise ValueError(f"commit_step: ended request {s.request_id!r} is {s.status.value}")


# ---- codec: pure functions, Request <-> JSON-able dicts ------------------------------------------
# Fields are taken from the dataclasses, so a field added to RequestStats is persisted without
# touching this file. Decoding ignores unknown keys and defaults missing ones, so records written
# by a neighbouring version of specgate still load during a rolling restart.
_STATS_FIELDS = tuple(f.name for f in fields(RequestStats))
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def stats_to_dict(s: RequestStats, *, tau_history: bool = True) -> dict[str, Any]:
    """All fields of `s`; `tau_history=False` leaves out the one that grows every step (the Redis
    store keeps it in a list of its own and appends to it).

    >>> d = stats_to_dict(RequestStats("r1", "acme", 2.5, prompt_len=3, max_tokens=16))
    >>> d["status"], d["tau_history"], d["last_served_s"]
    ('queued', [], 2.5)
    """
    d = {name: getattr(s, name) for name in _STATS_FIELDS}
    d["status"] = s.status.value
    d["estimate"] = asdict(s.estimate)
    if tau_history:
        d["tau_history"] = [int(t) for t in s.tau_history]
    else:
        del d["tau_history"]
    return d


def stats_from_dict(d: Mapping[str, Any]) -> RequestStats:
    """Inverse of `stats_to_dict`.

    >>> s = stats_from_dict({"request_id": "r1", "tenant": "acme", "arrival_s": 2.5,
    ...                      "prompt_len": 3, "max_tokens": 16, "status": "preempted",
    ...                      "tau_history": [2, 3], "last_served_s": 4.0})
    >>> s.status, s.tau_history, s.last_served_s
    (<Status.PREEMPTED: 'preempted'>, [2, 3], 4.0)
    """
    kw = {name: d[name] for name in _STATS_FIELDS if name in d}
    kw["status"] = Status(kw.get("status", Status.QUEUED))
    kw["tau_history"] = [int(t) for t in kw.get("tau_history", ())]
    if "estimate" in kw:
        kw["estimate"] = AlphaEstimate(**kw["estimate"])
    s = RequestStats(**kw)
    if "last_served_s" in d:            # __post_init__ resets it to arrival_s
        s.last_served_s = d["last_served_s"]
    return s


def sampling_to_dict(p: SamplingParams) -> dict[str, Any]:
    d = {name: getattr(p, name) for name in _SAMPLING_FIELDS}
    d["logit_bias"] = [list(pair) for pair in p.logit_bias]     # as JSON gives it back
    return d


def sampling_from_dict(d: Mapping[str, Any]) -> SamplingParams:
    return SamplingParams(**{name: d[name] for name in _SAMPLING_FIELDS if name in d})


def params_to_dict(req: Request) -> dict[str, Any]:
    """What is fixed at admission, except the prompt (stored apart: it is the large part)."""
    return {"sampling": sampling_to_dict(req.sampling),
            "stop_token_ids": [int(t) for t in req.stop_token_ids],
            "stop": list(req.stop),
            "drafter": req.drafter,
            "meta": dict(req.meta)}


def request_to_dict(req: Request) -> dict[str, Any]:
    """The full record as a JSON-able dict: `params_to_dict` plus prompt, stats and output."""
    return {"prompt_ids": [int(t) for t in req.prompt_ids],
            **params_to_dict(req),
            "stats": stats_to_dict(req.stats),
            "output_ids": [int(t) for t in req.output_ids]}


def request_from_dict(d: Mapping[str, Any]) -> Request:
    """Inverse of `request_to_dict`; lists come back as the tuples `Request` declares.

    >>> import json
    >>> sampling = SamplingParams(temperature=0.5, seed=7, logit_bias=((9, -2.5),), constraint='{"type": "json_object"}')
    >>> req = Request(RequestStats("r1", "acme", 0.0, prompt_len=2, max_tokens=8), [5, 6],
    ...               sampling, stop_token_ids=(2,), stop=("\\n",))
    >>> back = request_from_dict(json.loads(json.dumps(request_to_dict(req))))
    >>> back.sampling == sampling, back.sampling.logit_bias, back.stop_token_ids, back.stop
    (True, ((9, -2.5),), (2,), ('\\n',))
    """
    return Request(stats=stats_from_dict(d["stats"]),
                   prompt_ids=[int(t) for t in d.get("prompt_ids", ())],
                   sampling=sampling_from_dict(d.get("sampling", {})),
                   stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
                   stop=tuple(d.get("stop", ())),
                   drafter=d.get("drafter"),
                   output_ids=[int(t) for t in d.get("output_ids", ())],
                   meta=dict(d.get("meta") or {}))


def account_to_str(account: Account) -> str:
    """A fairness account as a hash field name: the class first, so the tenant may hold ':'.

    >>> account_to_str((1, "acme:eu")), account_from_str("1:acme:eu")
    ('1:acme:eu', (1, 'acme:eu'))
    """
    cls, tenant = account
    return f"{int(cls)}:{tenant}"


def account_from_str(key: str) -> Account:
    cls, _, tenant = key.partition(":")
    return int(cls), tenant
