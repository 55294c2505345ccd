"""The event loop's lag on /metrics (gateway/looplag.py): measured by the serving process itself,
so it shows work that holds the loop, whoever's request it is."""
from __future__ import annotations

import time

import httpx

from gateway.builders.embedded import build_embedded
from gateway.http.server import background_server
from gateway.looplag import LAG_EVERY_S, LAG_METRIC
from gateway.settings import Settings
from test_metrics import ADMIN, scrape, value

HELD_S = 0.6


def lag(c: httpx.Client) -> tuple[float, float, float]:
    """(observations, seconds in all, observations of more than 0.25 s)."""
    s = scrape(c)
    count = value(s, LAG_METRIC + "_count")
    return (count, value(s, LAG_METRIC + "_sum"),
            count - value(s, LAG_METRIC + "_bucket", le="0.25"))


def test_the_lag_is_exported_and_rises_while_the_loop_is_held():
    emb = build_embedded(Settings(fake_worker=True, admin_key=ADMIN))

    @emb.app.get("/hold")
    async def hold() -> dict:                  # deliberately blocks the event loop
        time.sleep(HELD_S)
        return {}

    emb.start()
    try:
        with background_server(emb.app) as url, httpx.Client(base_url=url, timeout=10) as c:
            time.sleep(5 * LAG_EVERY_S)
            n0, sum0, late0 = lag(c)
            assert n0 >= 2                                  # the task runs with the app
            assert late0 == 0 and sum0 < 0.25 * n0          # an idle loop is on time
            assert c.get("/hold").status_code == 200
            time.sleep(3 * LAG_EVERY_S)
            n1, sum1, late1 = lag(c)
            assert n1 > n0
            assert late1 - late0 >= 1                       # the hold was seen as one late wake-up
            assert sum1 - sum0 >= HELD_S - LAG_EVERY_S - 0.05
    finally:
        emb.stop()
