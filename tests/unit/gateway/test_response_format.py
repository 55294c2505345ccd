"""response_format as the request's constraint (gateway/schemas.py): the shapes OpenAI's clients
send become `SamplingParams.constraint`; anything else is refused with the field named."""
from __future__ import annotations

import json

import pytest

from gateway.schemas import constraint_of


def test_text_or_nothing_is_no_constraint():
    assert constraint_of(None) is None
    assert constraint_of({"type": "text"}) is None
    assert constraint_of({}) is None


def test_json_formats_become_the_workers_constraint_with_the_schemas_key_order_kept():
    assert json.loads(constraint_of({"type": "json_object"})) == {"type": "json_object"}
    schema = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}
    c = constraint_of({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(c) == {"type": "json_schema", "schema": schema}
    assert list(json.loads(c)["schema"]["properties"]) == ["zeta", "alpha"]     # the output's order


@pytest.mark.parametrize("fmt", [
    {"type": "regex"}, {"type": 5}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema", "json_schema": {"schema": "not an object"}},
])
def test_other_shapes_are_refused(fmt):
    with pytest.raises(ValueError):
        constraint_of(fmt)
