"""Gateway test fixtures: every state-store-backed test runs in memory and on a real Redis
(`redis_url` / `redis_prefix` come from tests/conftest.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(params=["memory", "redis"])
def store(request) -> tuple[str | None, str]:
    """(store URL, prefix) for each kind of state store: None (in process) and a real Redis."""
    if request.param == "memory":
        return None, "specgate:"
    return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
