"""The generic reader's rules, which every section's keys follow: one test per rule, each problem
named ``file: key.path: problem``, a value with a problem read as its default."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.reader import Reader


def reader(data: Any, path: str = "s") -> tuple[Reader, list[str]]:
    problems: list[str] = []
    return Reader(data, path, problems, "f.yaml"), problems


def test_a_section_must_be_a_mapping():
    r, problems = reader([1, 2])
    assert problems == ["f.yaml: s: must be a mapping, got list"]
    assert r.data == {}
    _, problems = reader("text", path="")
    assert problems == ["f.yaml: (top level): must be a mapping, got str"]


def test_an_absent_section_is_empty():
    r, problems = reader(None)
    assert r.data == {} and problems == []


def test_nested_sections_and_list_items_name_their_key_path():
    r, problems = reader({"a": {"b": [{"c": 1}]}})
    item = r.section("a").item("b", 0, {"c": "x"})
    item.string_list("c")
    assert problems == ["f.yaml: s.a.b[0].c: must be a list of non-empty strings, got 'x'"]


@pytest.mark.parametrize("value", ["3", True, [1]])
def test_numbers_must_be_numbers(value):
    r, problems = reader({"k": value})
    assert r.number("k", 7) == 7
    assert problems == [f"f.yaml: s.k: must be a number, got {value!r}"]


def test_integers_must_be_integers():
    r, problems = reader({"k": 1.5, "ok": 3})
    assert r.integer("k", 2) == 2
    assert r.integer("ok", 2) == 3
    assert problems == ["f.yaml: s.k: must be an integer, got 1.5"]


@pytest.mark.parametrize(
    ("value", "bounds", "problem"),
    [
        (0, {"minimum": 1}, "must be >= 1, got 0"),
        (0, {"minimum": 0, "exclusive_min": True}, "must be > 0, got 0"),
        (11, {"maximum": 10}, "must be <= 10, got 11"),
        (11, {"minimum": 1, "maximum": 10}, "must be >= 1 and <= 10, got 11"),
    ],
)
def test_numbers_must_be_within_their_bounds(value, bounds, problem):
    r, problems = reader({"k": value})
    assert r.number("k", 5, **bounds) == 5
    assert problems == [f"f.yaml: s.k: {problem}"]


def test_numbers_on_their_bounds_are_accepted():
    r, problems = reader({"low": 1, "high": 10, "seconds": 0.001})
    assert r.number("low", 5, minimum=1, maximum=10) == 1
    assert r.number("high", 5, minimum=1, maximum=10) == 10
    assert r.duration("seconds", 5) == 0.001
    assert problems == []


def test_durations_must_be_more_than_zero():
    r, problems = reader({"k": 0})
    assert r.duration("k", 2.0) == 2.0
    assert problems == ["f.yaml: s.k: must be > 0, got 0"]


@pytest.mark.parametrize("value", ["", 5])
def test_strings_must_be_non_empty_strings(value):
    r, problems = reader({"k": value})
    assert r.string("k", "d") == "d"
    assert problems == [f"f.yaml: s.k: must be a non-empty string, got {value!r}"]


def test_strings_with_choices_must_be_one_of_them():
    r, problems = reader({"k": "c"})
    assert r.string("k", "a", choices=("a", "b")) == "a"
    assert problems == ["f.yaml: s.k: must be one of a, b, got 'c'"]


def test_booleans_must_be_true_or_false():
    r, problems = reader({"k": "yes"})
    assert r.boolean("k", True) is True
    assert problems == ["f.yaml: s.k: must be true or false, got 'yes'"]


@pytest.mark.parametrize("value", ["a", ["a", ""], [1]])
def test_string_lists_must_hold_non_empty_strings(value):
    r, problems = reader({"k": value})
    assert r.string_list("k") == ()
    assert problems == [f"f.yaml: s.k: must be a list of non-empty strings, got {value!r}"]


def test_sizes_take_a_byte_count_or_a_unit():
    r, problems = reader({"a": 1024, "b": "512MiB", "c": "4MB"})
    assert (r.size("a", None), r.size("b", None), r.size("c", None)) == (
        1024,
        512 * 2**20,
        4 * 10**6,
    )
    assert problems == []


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("lots", "invalid size 'lots': expected e.g. 512MiB, 2GiB or a byte count"),
        (True, "invalid size True: expected e.g. 512MiB or a byte count"),
        (1.5, "invalid size 1.5: expected e.g. 512MiB or a byte count"),
    ],
)
def test_sizes_must_parse(value, problem):
    r, problems = reader({"k": value})
    assert r.size("k", 9) == 9
    assert problems == [f"f.yaml: s.k: {problem}"]


@pytest.mark.parametrize("value", [0, "0MiB"])
def test_sizes_must_be_positive(value):
    r, problems = reader({"k": value})
    assert r.size("k", 9) == 9
    assert problems == ["f.yaml: s.k: must be positive"]


def test_a_required_secret_needs_its_variable_name():
    r, problems = reader({})
    assert r.env_secret("key_env", required=True) == (None, None)
    assert problems == ["f.yaml: s.key_env: is required (the name of an environment variable)"]


def test_a_secrets_variable_name_must_be_valid():
    r, problems = reader({"key_env": "1-KEY"})
    assert r.env_secret("key_env", required=True) == (None, None)
    assert problems == ["f.yaml: s.key_env: '1-KEY' is not a valid environment variable name"]


def test_a_secrets_variable_must_be_set(monkeypatch):
    monkeypatch.setenv("EMPTY_KEY", "")
    monkeypatch.delenv("UNSET_KEY", raising=False)
    r, problems = reader({"a": "EMPTY_KEY", "b": "UNSET_KEY"})
    assert r.env_secret("a", required=True) == ("EMPTY_KEY", None)
    assert r.env_secret("b", required=False) == ("UNSET_KEY", None)
    assert problems == [
        "f.yaml: s.a: environment variable EMPTY_KEY is not set or empty",
        "f.yaml: s.b: environment variable UNSET_KEY is not set or empty",
    ]


def test_a_secrets_variable_may_be_unset_where_allowed(monkeypatch):
    monkeypatch.delenv("UNSET_KEY", raising=False)
    monkeypatch.setenv("SET_KEY", "sk-1")
    r, problems = reader({"a": "UNSET_KEY", "b": "SET_KEY"})
    assert r.env_secret("a", required=False, must_be_set=False) == ("UNSET_KEY", None)
    assert r.env_secret("b", required=True) == ("SET_KEY", "sk-1")
    assert problems == []


def test_keys_nobody_read_are_unknown():
    r, problems = reader({"known": 1, "typo": 2})
    r.number("known", 0)
    r.finish()
    assert problems == ["f.yaml: s.typo: unknown key"]


def test_absent_values_read_as_their_default():
    r, problems = reader({})
    assert r.number("n", 1.5) == 1.5
    assert r.string("s", "x") == "x"
    assert r.boolean("b", False) is False
    assert r.string_list("l") == ()
    assert r.size("z", 7) == 7
    r.finish()
    assert problems == []
