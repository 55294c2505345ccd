"""A `FinishedOnly` sink hears only how its request ended; the loop builds no `Delta` for it,
and a request beside it that streams still gets every token."""
from __future__ import annotations

from scheduler.events import FinishedOnly
from scheduler.loop import Delta, Finished
from scheduler.request import Status

from tests.unit.scheduler.test_step_loop import Collector, make_loop, request, run_to_end, truth


def test_a_finished_only_sink_gets_the_end_and_no_tokens():
    loop = make_loop()
    ends: list[Finished] = []
    streamed = Collector()
    loop.submit(request("quiet", max_tokens=12), FinishedOnly(ends.append))
    loop.submit(request("loud", max_tokens=12), streamed)
    run_to_end(loop)
    assert [e.request_id for e in ends] == ["quiet"] and ends[0].status is Status.FINISHED
    assert ends[0].stats.committed == 12
    assert streamed.tokens["loud"] == truth("loud", 12) and "loud" in streamed.finished


def test_finished_only_passes_on_nothing_but_the_end():
    seen = []
    sink = FinishedOnly(seen.append)
    sink(Delta("r", (1, 2)))
    assert seen == []
