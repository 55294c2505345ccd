"""`fills_dict`: the records built once per request per step stay frozen dataclasses, with the
signature, defaults, equality, `replace` and pickling they had."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from scheduler.alpha import AlphaEstimate
from workers.contract import NO_SPECULATION, StepResult, WorkItem
from workers.frozen import fills_dict


def test_the_records_keep_their_dataclass_behaviour():
    r = StepResult("a", (1, 2), 1, 3, features=(0.5,))
    assert (r.draft_s, r.kv_tokens, r.home, r.tree_tokens) == (0.0, 0, None, 4)
    assert r == StepResult("a", (1, 2), 1, 3, 0.0, 0, (0.5,))
    assert pickle.loads(pickle.dumps(r)) == r
    assert dataclasses.replace(r, accepted=2).accepted == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.accepted = 5
    with pytest.raises(TypeError):
        StepResult("a")
    assert hash(WorkItem("a", NO_SPECULATION)) == hash(WorkItem("a", NO_SPECULATION, 0, True))
    assert AlphaEstimate() == AlphaEstimate(0.0, 0.0, 0, 0.0, 0.75) and AlphaEstimate().alpha == 0.75


def test_post_init_still_runs_and_unfit_classes_are_refused():
    @fills_dict
    @dataclasses.dataclass(frozen=True)
    class Checked:
        n: int

        def __post_init__(self):
            if self.n < 0:
                raise ValueError("negative")

    assert Checked(1).n == 1
    with pytest.raises(ValueError):
        Checked(-1)
    @dataclasses.dataclass
    class Mutable:
        n: int

    @dataclasses.dataclass(frozen=True)
    class Listed:
        xs: list = dataclasses.field(default_factory=list)

    for unfit in (Mutable, Listed):
        with pytest.raises(TypeError):
            fills_dict(unfit)
