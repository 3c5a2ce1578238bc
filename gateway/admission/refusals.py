"""What a request refused by its model's line is told: OpenAI's error shape, a code saying why,
and a ``Retry-After``. A model without a ready replica (loading, waking, restarting) keeps the
codes its clients knew from before the line had slots: ``hold_queue_full`` and
``model_loading_timeout``."""

from __future__ import annotations

from common.errors import RequestRefused

SHED = "request_shed"


def shed(model: str, retry_after_s: int) -> RequestRefused:
    """A sheddable request refused (or dropped from the line) under overload: 429."""
    return RequestRefused(
        429,
        f"Model '{model}' is overloaded and this key's requests are the first to be shed; "
        f"retry in {retry_after_s}s.",
        SHED,
        headers={"Retry-After": str(retry_after_s)},
    )


def full(model: str, waiting: int, loading: str | None, retry_after_s: int) -> RequestRefused:
    """``loading``: where the model's load stands while it has no ready replica, else None."""
    if loading is not None:
        code, message = "hold_queue_full", f"Model '{model}' is loading and {waiting} requests "
        message += f"are already waiting for it; {loading}."
    else:
        code, message = "queue_full", f"Model '{model}' is busy and {waiting} requests "
        message += "are already waiting for it."
    return unavailable(code, message, retry_after_s)


def timed_out(
    model: str, max_wait_s: float, loading: str | None, retry_after_s: int
) -> RequestRefused:
    """``loading`` as for `full`."""
    if loading is not None:
        code = "model_loading_timeout"
        message = f"did not become ready within {max_wait_s:g}s; {loading}."
    else:
        code, message = "queue_timeout", f"had no free slot within {max_wait_s:g}s."
    return unavailable(code, f"Model '{model}' {message}", retry_after_s)


def unavailable(code: str, message: str, retry_after_s: int) -> RequestRefused:
    """A 503 of the line (or of the model it waits for), with its Retry-After."""
    return RequestRefused(503, message, code, headers={"Retry-After": str(retry_after_s)})
