"""Fixtures shared by the fault-injection modules (test_faults.py, test_redis_faults.py,
test_replicas.py)."""
from __future__ import annotations

import signal

import pytest

from test_faults import OwnRedis


@pytest.fixture
def own_redis():
    """A redis-server of our own (never the shared one), resumed before it is stopped should a
    test end while it is paused (SIGSTOP)."""
    server = OwnRedis()
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.close()
