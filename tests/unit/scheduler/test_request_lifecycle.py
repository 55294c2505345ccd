import math

import pytest

from scheduler.request import Request, RequestStats, Status, StepRecord, finish_reason


@pytest.mark.parametrize("status, cause, expected", [
    (Status.FINISHED, "eos", "stop"),
    (Status.FINISHED, "stop", "stop"),
    (Status.FINISHED, "stop_string", "stop"),
    (Status.FINISHED, None, "stop"),
    (Status.FINISHED, "length", "length"),
    (Status.FINISHED, "max_tokens", "length"),
    (Status.FINISHED, "content_filter", "content_filter"),
    (Status.CANCELLED, None, "abort"),
    (Status.CANCELLED, "client_disconnected", "abort"),
    (Status.FAILED, "oom", "error"),
    (Status.QUEUED, None, None),
    (Status.RUNNING, None, None),
    (Status.PREEMPTED, None, None),
])
def test_finish_reason_table(status, cause, expected):
    assert finish_reason(status, cause) == expected


def test_unknown_finish_cause_is_an_error():
    with pytest.raises(ValueError):
        finish_reason(Status.FINISHED, "because")


def test_terminal_states():
    assert {s for s in Status if s.terminal} == {Status.FINISHED, Status.CANCELLED, Status.FAILED}


def test_record_step_accounts_tau_service_and_wait():
    s = RequestStats("r", "t", arrival_s=1.0, prompt_len=5, max_tokens=100)
    assert s.last_served_s == 1.0 and s.mean_tau is None and math.isinf(s.tau_stderr)
    s.record_step(StepRecord("r", verified=5, committed=3, tried=3, drafted=4, accepted=2,
                             draft_s=0.008, draft_depth=4), start_s=4.0, end_s=4.5)
    s.record_step(StepRecord("r", verified=5, committed=1, tried=1, drafted=4, accepted=0),
                  start_s=5.0, end_s=5.5)
    assert (s.committed, s.attained, s.n_steps, s.tau_history) == (4, 10, 2, [3, 1])
    assert s.mean_tau == 2.0
    assert s.tau_stderr == pytest.approx(1.0)          # sd √2 over √2 steps
    assert s.max_wait_s == 3.0                         # arrival 1.0 → first step at 4.0
    assert s.first_served_s == 4.0 and s.last_served_s == 5.5
    assert s.in_steps_s == pytest.approx(1.0)          # two steps of 0.5 s; 3.5 s waiting
    assert s.status is Status.RUNNING
    assert (s.accepted_sum, s.tried_sum) == (2, 4)
    # the sizing estimate (scheduler/alpha.py): 2 accepted then a failure, 0 then a failure,
    # decayed 0.85 a step over the prior 3 : 1; drafting 2 ms a level
    accepted, rejected = 2 * 0.85, 1 * 0.85 + 1
    assert s.estimate.alpha == pytest.approx((accepted + 3) / (accepted + rejected + 4))
    assert s.estimate.draft_s == pytest.approx(0.002) and s.estimate.misses == 1


def test_end_requires_a_terminal_state():
    s = RequestStats("r", "t", 0.0, 1, 10)
    with pytest.raises(ValueError):
        s.end(Status.PREEMPTED, None, 1.0)
    s.end(Status.FINISHED, "length", 2.0)
    assert s.finish_reason == "length" and s.finished_s == 2.0


def test_full_record_wraps_the_policy_view():
    r = Request(RequestStats("r9", "t", 0.0, 3, 10), prompt_ids=[1, 2, 3])
    assert r.request_id == "r9" and not hasattr(r.stats, "prompt_ids")
