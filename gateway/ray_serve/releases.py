"""What Ray mode's release lists carry: a request id that finished, an `Evicted` one, or a
`DroppedTenant` (a removed tenant, whose caches every replica frees).

Releases ride along with other calls (verifier steps and prefills, draft calls), so the far side
learns late that a request went away. It must also learn how: a finished request's output is
something a learning drafter (suffix) keeps, while an evicted one will be prefilled again and
finish later, and must not be learned twice (`BatchWorker.evict`, `SuffixDrafter.evict`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Union


@dataclass(frozen=True, slots=True)
class Evicted:
    """A request whose KV and drafter state go, though it is not finished."""
    request_id: str


@dataclass(frozen=True, slots=True)
class DroppedTenant:
    """A removed tenant, by its immutable id: its prefix-cache blocks and drafters' caches go
    (`BatchWorker.drop_tenant`, `Drafter.drop_tenant`)."""
    tenant: str


Release = Union[str, Evicted, DroppedTenant]     # a bare id: finished (or cancelled)


def release_id(entry: str | Evicted) -> str:
    return entry.request_id if isinstance(entry, Evicted) else entry


class Releasing(Protocol):
    """What releases apply to: a worker (`BatchWorker`) or a drafter (`workers.drafters.base.Drafter`)."""

    def release(self, request_id: str) -> None: ...

    def evict(self, request_id: str) -> None: ...

    def drop_tenant(self, tenant: str) -> None: ...


def apply_releases(target: Releasing, entries: Iterable[Release]) -> None:
    """`target.release(id)` for finished requests, `target.evict(id)` for evicted ones,
    `target.drop_tenant(id)` for removed tenants."""
    for entry in entries:
        if isinstance(entry, Evicted):
            target.evict(entry.request_id)
        elif isinstance(entry, DroppedTenant):
            target.drop_tenant(entry.tenant)
        else:
            target.release(entry)
