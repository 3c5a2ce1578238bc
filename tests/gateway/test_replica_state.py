"""The replica state machine (gateway/engines/replica.py): every transition of the table is
allowed and reported once, every other one is refused loudly and changes nothing."""

from __future__ import annotations

import itertools

import pytest

from gateway.config import ModelConfig
from gateway.engines.logs import EngineLog
from gateway.engines.progress import LoadProgress
from gateway.engines.replica import TRANSITIONS, InvalidTransition, Replica, ReplicaState
from gateway.metrics import GatewayMetrics

S = ReplicaState
ALLOWED = [(old, new) for old, targets in TRANSITIONS.items() for new in sorted(targets, key=str)]
REFUSED = [(a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a]]


def replica_in(state: ReplicaState, seen: list) -> Replica:
    replica = Replica("m", (), ModelConfig(name="m"), lambda r, old: seen.append((old, r.state)))
    replica._state = state  # the starting point of the transition under test
    return replica


def test_every_state_has_a_row_and_the_lifecycle_is_reachable():
    assert set(TRANSITIONS) == set(S)
    path = [S.STARTING, S.READY, S.PARKING, S.PARKED, S.WAKING, S.READY, S.DRAINING,
            S.STOPPING, S.STOPPED]  # fmt: skip
    seen: list = []
    replica = replica_in(S.STOPPED, seen)
    for state in path:
        replica.set_state(state)
    assert [new for _, new in seen] == path


@pytest.mark.parametrize(("old", "new"), ALLOWED, ids=[f"{a.value}->{b.value}" for a, b in ALLOWED])
async def test_allowed_transition_is_made_and_reported(old, new):
    seen: list = []
    replica = replica_in(old, seen)
    before = replica.changed
    replica.set_state(new, "because")
    assert replica.state is new and seen == [(old, new)]
    assert before.is_set() and not replica.changed.is_set()  # waiters woken, a fresh event


@pytest.mark.parametrize(("old", "new"), REFUSED, ids=[f"{a.value}->{b.value}" for a, b in REFUSED])
def test_other_transitions_are_refused(old, new):
    seen: list = []
    replica = replica_in(old, seen)
    with pytest.raises(InvalidTransition, match=f"{old.value} -> {new.value}"):
        replica.set_state(new)
    assert replica.state is old and seen == []


def test_failed_and_backoff_show_the_last_log_lines_from_its_file(tmp_path):
    replica = replica_in(S.STARTING, [])
    replica.log = EngineLog(tmp_path / "replica-0.log", 2**20, 2)
    for line in ["x" * 5000, "loading", "Traceback", "OSError: no such file"]:
        replica.log.write(line)
    info = replica.describe()
    assert "last_log_lines" not in info and info["log"] == str(tmp_path / "replica-0.log")
    replica.set_state(S.FAILED)
    shown = replica.describe()["last_log_lines"]
    assert shown == ["x" * 1000, "loading", "Traceback", "OSError: no such file"]


def test_a_starting_replica_shows_its_load_progress_and_only_then():
    replica = replica_in(S.STARTING, [])
    replica.progress = LoadProgress("weights", 45.0)
    assert replica.describe()["progress"]["stage"] == "weights"
    assert replica.describe()["progress"]["percent"] == 45.0
    replica.set_state(S.READY)
    assert "progress" not in replica.describe()


def test_metrics_follow_the_state_and_forget_a_stopped_replica():
    metrics = GatewayMetrics()
    replica = Replica("m", (), ModelConfig(name="m"), metrics.replica_changed, index=1)
    replica.set_state(S.STARTING)
    replica.set_state(S.READY)

    def value(state: str) -> float | None:
        return metrics.registry.get_sample_value(
            "modelyard_replica_state", {"model": "m", "replica": "1", "state": state}
        )

    assert value("ready") == 1 and value("starting") == 0 and value("parked") == 0
    replica.set_state(S.STOPPING)
    replica.set_state(S.STOPPED)
    assert value("ready") is None and value("stopping") is None
