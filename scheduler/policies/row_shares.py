"""Tenants' shares of a step's rows: what keeps one tenant's speculation and prefills from
slowing every other tenant's streams.

A step's cost grows with its rows (one root per decoding request, prefill chunks, draft nodes),
and every request in the step waits for all of them: a token's gap is the step's duration. The
tree sizing (scheduler/sizing.py) spends the rows where they commit the most tokens a second,
which is right for the batch as a whole and wrong for a neighbour: a tenant whose outputs draft
well (a repetitive stream) or whose prompts arrive in a flood fills the step with its own nodes
or chunks, and another tenant's stream, committing one token a step either way, gets each token
at the gap of a full step rather than of a step of roots (the step-cost profile prices both).

So in a step shared by several tenants, each tenant's chunks and nodes together take at most its
share of the rows beyond one per request: its weight's share among itself and its rivals (the
other tenants with a stream decoding in the step, whose gaps are at stake; a step in which
nobody else decodes holds nothing back), and at
least `floor` of them (a half by default: two tenants split a step evenly, and with more, none
takes over half; a tenant with more than half the weight keeps its weight's share). A share left
unused is not handed to the others: the rows a light tenant does not use are what keeps its gaps
short. Every tenant may take at least one row, so that a prompt always advances (the chunked
prefill's rule).

Rivals are by service tier (scheduler/tiers.py): a request's rows are held back only for the
streams of its own tier and those above it, which the tiers sell it no right to slow; the
tiers below have no claim on it (a `priority` request's prompt is not prefilled slower because a
`default` stream shares its step). The first tier holds nothing back at all, not even for its own
other tenants: it is sold as first with the tightest TTFT objectives, and its long prompts'
prefill is what those objectives are missed by (docs/benchmarks.md, the tiered simulation). A request with no rival, such as every request of a step with
one tenant, is not limited: its tenant's requests only slow each other, and its speculation is
what a single stream's speed rests on.
"""
from __future__ import annotations

from typing import Callable, Iterable

from scheduler.request import RequestStats
from scheduler.tiers import TIERS, tier_of

_RANK = {t: i for i, t in enumerate(TIERS)}
UNLIMITED = 1 << 30


class RowShares:
    """The row caps of one step's tenants, by tier, and what each tenant has taken so far
    (module docstring)."""

    __slots__ = ("caps", "taken", "spare", "floor")

    def __init__(self, caps: dict[tuple[int, str], int], spare: int, floor: float) -> None:
        self.caps, self.spare, self.floor = caps, spare, floor
        self.taken: dict[str, int] = {}

    @classmethod
    def of(cls, stats: Iterable[RequestStats], streams: Iterable[RequestStats],
           weight: Callable[[str], float], spare: int,
           floor: float | None) -> "RowShares | None":
        """The shares of a step of `stats`, of which `streams` decode (the gaps the shares keep
        short), with `spare` rows beyond one a request; None where nothing is limited (no request
        has a rival stream, or no `floor`: shares off).

        >>> from scheduler.request import RequestStats as R
        >>> step = [R("a1", "a", 0, 10, 99), R("a2", "a", 0, 10, 99), R("b1", "b", 0, 10, 99)]
        >>> RowShares.of(step, step, lambda t: 3.0 if t == "a" else 1.0, 40, 0.5).caps
        {(1, 'a'): 30, (1, 'b'): 20}
        >>> RowShares.of(step, step[:2], lambda t: 1.0, 40, 0.5).caps     # b has no stream here
        {(1, 'a'): 1073741824, (1, 'b'): 20}
        >>> RowShares.of(step[:2], step[:2], lambda t: 1.0, 40, 0.5) is None
        True
        >>> step[0].tier = "priority"                 # the first tier is never held back
        >>> RowShares.of(step, step, lambda t: 1.0, 40, 0.5).caps
        {(0, 'a'): 1073741824, (1, 'a'): 20, (1, 'b'): 20}
        >>> for s in step: s.tier = "priority"
        >>> RowShares.of(step, step, lambda t: 1.0, 40, 0.5) is None
        True
        """
        if floor is None:
            return None
        streaming: dict[str, int] = {}                 # tenant -> its best tier with a stream
        for s in streams:
            streaming[s.tenant] = min(streaming.get(s.tenant, len(TIERS)), cls.rank(s))
        caps: dict[tuple[int, str], int] = {}
        for s in stats:
            key = (cls.rank(s), s.tenant)
            if key not in caps:
                caps[key] = cls._cap(key, streaming, weight, spare, floor)
        if all(c == UNLIMITED for c in caps.values()):
            return None
        return cls(caps, spare, floor)

    @staticmethod
    def _cap(key: tuple[int, str], streaming: dict[str, int], weight: Callable[[str], float],
             spare: int, floor: float) -> int:
        rank, tenant = key
        rivals = [t for t, r in streaming.items() if r <= rank and t != tenant]
        if rank == 0 or not rivals:
            return UNLIMITED
        mine = weight(tenant)
        return max(int(spare * max(mine / (mine + sum(weight(t) for t in rivals)), floor)), 1)

    def room(self, s: RequestStats) -> int:
        """Rows `s`'s tenant may still take in this step for `s`. A request not in the step (one
        prefilled ahead of its turn) has the floor's share where the step holds others back."""
        rank = self.rank(s)
        cap = self.caps.get((rank, s.tenant))
        if cap is None:
            rivals = any(r <= rank and t != s.tenant for (r, t), c in self.caps.items()
                         if c != UNLIMITED)
            cap = max(int(self.spare * self.floor), 1) if rank and rivals else UNLIMITED
        return max(cap - self.taken.get(s.tenant, 0), 0)

    @staticmethod
    def rank(s: RequestStats) -> int:
        """`s`'s tier's place in the order of service (0: the first)."""
        return _RANK.get(tier_of(s.tier), 1)

    def take(self, s: RequestStats, rows: int) -> None:
        self.taken[s.tenant] = self.taken.get(s.tenant, 0) + rows
