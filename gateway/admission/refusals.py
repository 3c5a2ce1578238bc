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


def full(model: str, waiting: int, loading: bool, retry_after_s: int) -> RequestRefused:
    if loading:
        code, message = "hold_queue_full", f"Model '{model}' is loading and {waiting} requests "
    else:
        code, message = "queue_full", f"Model '{model}' is busy and {waiting} requests "
    return unavailable(code, message + "are already waiting for it.", retry_after_s)


def timed_out(model: str, max_wait_s: float, loading: bool, retry_after_s: int) -> RequestRefused:
    if loading:
        code, message = "model_loading_timeout", "did not become ready"
    else:
        code, message = "queue_timeout", "had no free slot"
    return unavailable(code, f"Model '{model}' {message} within {max_wait_s:g}s.", retry_after_s)


def unavailable(code: str, message: str, retry_after_s: int) -> RequestRefused:
    """A 503 of the line (or of the model it waits for), with its Retry-After."""
    return RequestRefused(503, message, code, headers={"Retry-After": str(retry_after_s)})
