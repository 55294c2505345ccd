import json

import pytest

from scheduler.profile import StepCostModel

CURVES = [(1, [1, 8, 16, 64], [0.040, 0.076, 0.080, 0.140]), (4, [4, 32], [0.068, 0.108]),
          (8, [8, 64], [0.088, 0.168])]


@pytest.mark.parametrize("batch, tokens, step_s", [
    (1, 1, 0.040), (1, 16, 0.080), (1, 64, 0.140), (4, 4, 0.068), (8, 64, 0.168),  # measured
    (1, 12, 0.078),                         # between two points of one curve
    (1, 112, 0.200),                        # past the last point: last segment's slope
    (6, 32, (0.108 + (0.088 + 0.08 * 24 / 56)) / 2),   # halfway between batch 4 and 8
])
def test_interpolation(batch, tokens, step_s):
    assert StepCostModel(CURVES)(batch, tokens) == pytest.approx(step_s)


def test_monotone_in_tokens_and_batch_over_the_measured_range():
    m = StepCostModel(CURVES)
    for b in range(1, 9):
        row = [m(b, n) for n in range(b, 200)]
        assert row == sorted(row)
    assert all(m(b, 64) <= m(b + 1, 64) for b in range(1, 8))


def test_default_profile_ships_with_its_source():
    import json
    from importlib import resources

    doc = json.loads(resources.files("scheduler").joinpath("profiles/default.json").read_text())
    m = StepCostModel.from_json()
    assert m.source.startswith("specgate bench profile") and doc["date"] and doc["device"]
    first = doc["curves"][0]
    assert m(first["batch"], first["tokens"][0]) == pytest.approx(first["step_s"][0])


def test_profile_from_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"source": "test", "curves": [
        {"batch": 1, "tokens": [1, 2], "step_s": [1.0, 2.0]}]}))
    m = StepCostModel.from_json(path)
    assert m(3, 3) == pytest.approx(3.0) and m.source == "test"


@pytest.mark.parametrize("curves", [[], [(1, [2, 1], [0.1, 0.2])], [(1, [1, 2], [0.1])]])
def test_bad_profiles_are_refused(curves):
    with pytest.raises(ValueError):
        StepCostModel(curves)
