"""Gateway test fixtures: a real Redis server (tests/redis_server.py) and per-test prefixes."""
from __future__ import annotations

from typing import Iterator

import pytest

from redis_server import delete_prefix, redis_server, unique_prefix


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """$REDIS_URL, or an embedded redis-server started once per session and removed after."""
    with redis_server() as url:
        yield url


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test (or real deployment) uses; its keys are deleted afterwards."""
    prefix = unique_prefix()
    yield prefix
    delete_prefix(redis_url, prefix)


@pytest.fixture(params=["memory", "redis"])
def store(request) -> tuple[str | None, str]:
    """(store URL, prefix) for each kind of state store: None (in process) and a real Redis."""
    if request.param == "memory":
        return None, "specgate:"
    return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
