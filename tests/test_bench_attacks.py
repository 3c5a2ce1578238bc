"""scripts/bench_attacks.py's pieces that need no fleet: which attacks --only selects, the
engine figures across an attack, and the bodies of issue 29's attacks (sizes as the issue
measured them)."""

from __future__ import annotations

import json

import pytest

from scripts.attacks.empty_messages import empty_messages_body
from scripts.attacks.engine_watch import engine_figures
from scripts.attacks.suite import ATTACKS, selected
from scripts.fuzzer.constraints import (
    Constraint,
    anyof_objects,
    constrained_body,
    pattern_properties,
    ref_chain,
    ref_chain_tools,
)

pytestmark = pytest.mark.timeout(60)


def test_only_selects_by_id_prefix() -> None:
    assert selected("1") == [n for n in ATTACKS if n[:2] in ("1a", "1b", "1c", "1d")]
    assert selected("h1") == ["h1a_deep_ref_schema", "h1b_lark_rule_chain", "h1c_tool_ref_chain"]
    assert len(selected("h")) == 9 and not any(n.startswith("h") for n in selected("1,2,3"))
    with pytest.raises(SystemExit):
        selected("zz")


def test_engine_figures() -> None:
    before = {"state": "ready", "pid": 1, "restarts": 0, "held": 0}
    crashed = {"state": "failed", "pid": None, "restarts": 4, "held": 0}
    states = ["ready", "backoff", "starting", "failed"]
    assert engine_figures(before, crashed, [1, 7, 9], states) == {
        "engine_alive_end": False,
        "engine_pid_changed": True,
        "engine_pids_seen": 3,
        "gateway_restarts": 4,
        "model_states_seen": "ready>backoff>starting>failed",
        "model_state_end": "failed",
    }
    assert engine_figures(before, before, [1], ["ready"])["engine_alive_end"]  # PID 1 lives


def body_bytes(c: Constraint, path: str = "/v1/chat/completions") -> int:
    return len(json.dumps(constrained_body(c, "smollm2", path, 8)))


def test_issue_29_bodies_are_their_size() -> None:
    assert 100_000 < body_bytes(Constraint("json_schema", ref_chain(3000))) < 110_000
    assert 85_000 < body_bytes(Constraint("tools", ref_chain_tools(2500))) < 90_000
    assert 70_000 < body_bytes(Constraint("json_schema", pattern_properties(2000))) < 80_000
    assert 550_000 < body_bytes(Constraint("json_schema", anyof_objects(5000, "v0_"))) < 650_000
    assert 3_900_000 < len(empty_messages_body()) < 4 * 2**20  # under the body limit
