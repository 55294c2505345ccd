"""Scheduler state stores: in memory (the embedded default) or in Redis (survives restarts).

`open_store(url)` picks one from a URL; everything else programs against `StateStore`.
"""
from __future__ import annotations

from scheduler.store.base import (DEFAULT_ENDED_TTL_S, DEFAULT_PREFIX, StateStore, StepWrite,
                                  StoredState, Tail, request_from_dict, request_to_dict)
from scheduler.store.memory import MemoryStore

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(url: str | None, prefix: str = DEFAULT_PREFIX, *,
               ended_ttl_s: float = DEFAULT_ENDED_TTL_S, timeout_s: float | None = None,
               owner: tuple[str, str] | None = None) -> StateStore:
    """None or "memory://" -> MemoryStore (prefix and `owner` unused); "redis://", "rediss://"
    (TLS) or "unix://" (a socket path) -> RedisStore, each call bounded by `timeout_s` (default
    `redis_client.REDIS_TIMEOUT_S`), recording each request's `owner` (`RedisStore`). Opening
    does no I/O: the first call connects."""
    if url is None or url == "memory://":
        return MemoryStore(ended_ttl_s=ended_ttl_s)
    if url.startswith(_REDIS_SCHEMES):
        from scheduler.store.redis_store import RedisStore   # redis-py only when Redis is used
        return RedisStore.from_url(url, prefix, ended_ttl_s=ended_ttl_s, timeout_s=timeout_s,
                                   owner=owner)
    raise ValueError(f"unknown state store URL {url!r}; expected memory:// or redis://…")


__all__ = ["DEFAULT_ENDED_TTL_S", "DEFAULT_PREFIX", "MemoryStore", "StateStore", "StepWrite",
           "StoredState", "Tail", "open_store", "request_from_dict", "request_to_dict"]
