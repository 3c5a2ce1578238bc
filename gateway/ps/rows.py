"""``modelyard ps``'s rows from a ``GET /admin/models`` answer: one per model, each followed by one
per replica of a local model. They are the ``--json`` output: every row has every key of ``KEYS``
(null where it does not apply), documented in docs/OPERATIONS.md#modelyard-ps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from gateway.ps.fetch import PsError

T = TypeVar("T")

Row = dict[str, Any]
KEYS = (
    "kind",  # "model" or "replica"
    "model",  # the model's name
    "replica",  # the replica's index; null on a model row
    "aliases",  # the model's aliases; [] on a replica row
    "state",  # the model's state (the first of its replicas' that holds), or the replica's
    "residency",  # pinned, on_demand or external; null on a replica row
    "pid",  # the replica's engine process; null without one, and on a model row
    "memory_bytes",  # what it holds now against the budget (a replica: as last measured)
    "memory_source",  # measured or estimated (no engine has reported one yet); null with no figure
    "running",  # requests in flight at its engines or upstreams
    "queued",  # requests waiting in its line (gateway/admission): for a slot, or while it loads
    "completion_tokens_per_s",  # over the last minute; null on a replica row
    "idle_s",  # since its last request ended; null while it has requests, and on a replica row
    "ttl_left_s",  # before the idle TTL parks it; null unless on demand, awake and idle
    "uptime_s",  # its engine process's (a model: its longest-running replica's); null: none runs
    "restarts",  # restarts after crashes (a model: its replicas' together); null: external
)


def memory(listing: Any) -> dict[str, Any]:
    """The budget: ``cpu_bytes``, ``cpu_resident_bytes``, ``templates_bytes``, ``gpu_fraction``,
    ``gpu_resident_fraction``."""
    try:
        budget = listing["memory"]
        return {
            "cpu_bytes": _int(budget["cpu_bytes"]),
            "cpu_resident_bytes": _int(budget["cpu_resident_bytes"]),
            "templates_bytes": _int(budget["templates_bytes"]),
            "gpu_fraction": _number(budget["gpu_fraction"]),
            "gpu_resident_fraction": _number(budget["gpu_resident_fraction"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise PsError(f"unexpected answer from the gateway: memory: {_what(exc)}") from None


def rows(listing: Any) -> list[Row]:
    found: list[Row] = []
    try:
        models = listing["models"]
        if not isinstance(models, list):
            raise TypeError("not a list")
        for model in models:
            found += _model_rows(model)
    except (KeyError, TypeError, ValueError) as exc:
        raise PsError(f"unexpected answer from the gateway: models: {_what(exc)}") from None
    return found


def _model_rows(model: dict[str, Any]) -> list[Row]:
    name = _str(model["name"])
    if not model["local"]:
        row = _row("model", name, aliases=_aliases(model), state=_str(model["state"]))
        row.update(
            residency="external",
            running=_int(model["in_flight"]),
            queued=_int(model["queued_requests"]),
        )
        row["completion_tokens_per_s"] = _number(model["completion_tokens_per_s"])
        return [row]
    replicas = [_replica_row(name, r) for r in model["replicas"]]
    uptimes = [r["uptime_s"] for r in replicas if r["uptime_s"] is not None]
    queued = _int(model["queued_requests"])
    running = _int(model["in_flight"])
    row = _row("model", name, aliases=_aliases(model), state=_str(model["state"]))
    row.update(
        residency=_str(model["residency"]),
        memory_bytes=_int(model["resident_bytes"]),
        memory_source=_str(model["footprint"]["source"]),
        running=running,
        queued=queued,
        completion_tokens_per_s=_number(model["completion_tokens_per_s"]),
        idle_s=None if running or queued else _number(model["idle_s"]),
        ttl_left_s=_optional(_number, model["ttl_left_s"]),
        uptime_s=max(uptimes, default=None),
        restarts=sum(r["restarts"] for r in replicas),
    )
    return [row, *replicas]


def _replica_row(model: str, replica: dict[str, Any]) -> Row:
    row = _row("replica", model, replica=_int(replica["index"]), state=_str(replica["state"]))
    measured = _optional(_int, replica["measured_bytes"])
    row.update(
        pid=_optional(_int, replica["pid"]),
        memory_bytes=measured,
        memory_source=None if measured is None else "measured",
        running=_int(replica["in_flight"]),
        uptime_s=_optional(_number, replica["uptime_s"]),
        restarts=_int(replica["restarts"]),
    )
    return row


def _row(kind: str, model: str, **known: Any) -> Row:
    return {**dict.fromkeys(KEYS), "kind": kind, "model": model, "aliases": [], **known}


def _aliases(model: dict[str, Any]) -> list[str]:
    aliases = model["aliases"]
    if not isinstance(aliases, list):
        raise TypeError(f"aliases {aliases!r}: not a list")
    return [_str(a) for a in aliases]


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r}: not a string")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r}: not an integer")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r}: not a number")
    return float(value)


def _optional(read: Callable[[Any], T], value: Any) -> T | None:
    return None if value is None else read(value)


def _what(exc: Exception) -> str:
    return f"no {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
