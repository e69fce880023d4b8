"""The typed config machine under TrainConfig and JobSpec: how values are read, and the one line a
bad one becomes."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import ValidationError

from fsdpkit.errors import UserError
from fsdpkit.settings import Bool, Float, Int, NodeRange, Nodes, Settings, Str, load, option


class Inner(Settings):
    retries: Int = option(3, "tries", ge=0)
    mode: Literal["fast", "safe"] = option("fast", "how", what="a mode")


class Item(Settings):
    key: Str = option(..., "the key")


class Outer(Settings):
    rate: Float = option(0.1, "a rate", ge=0, le=1)
    steps: Int | None = option(None, "steps", ge=1)
    on: Bool = option(False, "switch")
    precision: Literal["bf16", "fp32"] = option("fp32", "dtype", alias_values={"1": "bf16", "0": "fp32"})
    nodes: Nodes = option(NodeRange(1, 1), "nodes")
    labels: dict[str, Str] = option(default_factory=dict, help="labels")
    items: list[Item] = option(default_factory=list, help="items")
    inner: Inner = option(default_factory=Inner)


@pytest.mark.parametrize(("doc", "expected"), [
    ({"rate": "0.5", "steps": "7", "on": "yes"}, {"rate": 0.5, "steps": 7, "on": True}),
    ({"steps": 3.0, "on": 0}, {"steps": 3, "on": False}),
    ({"steps": "none"}, {"steps": None}),
    ({"precision": 1}, {"precision": "bf16"}),
    ({"labels": {"team": 7, "gpu": True}}, {"labels": {"team": "7", "gpu": "true"}}),
    ({"nodes": 4}, {"nodes": NodeRange(4, 4)}),
    ({"nodes": "2:8"}, {"nodes": NodeRange(2, 8)}),
])
def test_values_are_read_the_same_from_yaml_and_flags(doc, expected):
    got = load(Outer, doc)
    assert {k: getattr(got, k) for k in expected} == expected


@pytest.mark.parametrize(("doc", "message"), [
    ({"steps": 1.5}, "steps: expected an integer, got 1.5"),
    ({"steps": True}, "steps: expected an integer, got True"),
    ({"rate": True}, "rate: expected a number, got True"),
    ({"rate": "nan"}, "rate: expected a finite number, got 'nan'"),
    ({"rate": 2}, "rate: 2.0 is out of range; it must be <= 1"),
    ({"steps": 0}, "steps: 0 is out of range; it must be >= 1"),
    ({"on": "maybe"}, "on: expected true or false, got 'maybe'"),
    ({"precision": "fp16"}, "precision: 'fp16' is not allowed; choose one of: bf16, fp32"),
    ({"inner": {"mode": "slow"}}, "inner.mode: 'slow' is not a mode; choose one of: fast, safe"),
    ({"inner": {"retries": -1}}, "inner.retries: -1 is out of range; it must be >= 0"),
    ({"inner": {"colour": 1}}, "inner.colour: unknown field; allowed: mode, retries"),
    ({"inner": 3}, "inner: expected a mapping of retries, mode, got 3"),
    ({"items": [{"key": "a"}, {}]}, "items[1].key: required"),
    ({"items": "a"}, "items: expected a list, got 'a'"),
    ({"labels": {"a": None}}, "labels.a: expected a string, got None"),
    ({"nodes": "4:2"}, "nodes: '4:2' must be >= 1, and MIN <= MAX"),
    ({"nodes": "two"}, "nodes: 'two' must be a count (2) or an elastic range"),
])
def test_a_bad_value_is_one_line_naming_its_field(doc, message):
    with pytest.raises(UserError) as e:
        load(Outer, doc)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_flat_names_for_one_namespace_of_options():
    with pytest.raises(UserError, match=r"^retries: -1 is out of range"):
        load(Outer, {"inner": {"retries": -1}}, flat=True)


def test_frozen_and_written_back_as_read():
    got = load(Outer, {"nodes": "2:4"})
    with pytest.raises(ValidationError):
        got.rate = 0.2
    assert got.model_dump()["nodes"] == "2:4" and load(Outer, got.model_dump()) == got
