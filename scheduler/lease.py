"""One holder at a time, in Redis: the guarantee behind "one central scheduler".

Ray Serve replaces a replica by starting the new one while the old drains (a rolling update, a
restart after a crash that is not yet noticed), so for a while two scheduler replicas can be
alive over the same requests. Both stepping them would verify each request twice and corrupt its
KV. The scheduler therefore steps only while it holds this lease: `try_acquire` takes it if it is
free (or already ours), `renew` keeps it (call well within `ttl_s`), `release` hands it over at
once. A holder that dies without releasing loses it when the TTL runs out.
"""
from __future__ import annotations

from typing import Any

# KEYS[1] = lease key, ARGV[1] = holder, ARGV[2] = ttl in ms
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    def __init__(self, client: Any, key: str, holder: str, ttl_s: float = 10.0) -> None:
        """`client`: a redis-py client; `holder`: this process's unique id."""
        self.client = client
        self.key = key
        self.holder = holder
        self.ttl_ms = int(ttl_s * 1000)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def try_acquire(self) -> bool:
        if self.client.set(self.key, self.holder, nx=True, px=self.ttl_ms):
            return True
        return self.renew()                     # already ours (a retry after a slow answer)

    def renew(self) -> bool:
        return bool(self._renew(keys=[self.key], args=[self.holder, self.ttl_ms]))

    def release(self) -> None:
        self._release(keys=[self.key], args=[self.holder])

    def holder_now(self) -> str | None:
        value = self.client.get(self.key)
        return value.decode() if isinstance(value, bytes) else value
