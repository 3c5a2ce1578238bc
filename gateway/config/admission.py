"""Admission settings (gateway/admission): the gateway-wide order of models' lines
(``gateway.admission``), each model's slots, order and line bounds (``admission``, ``queue``), and
each API key's band, weight and sheddability. Defaults come from schema.py."""

from __future__ import annotations

from typing import Any

from gateway.config.reader import Reader
from gateway.config.schema import (
    ADMISSION_POLICIES,
    AdmissionSettings,
    ApiKey,
    ModelAdmission,
    QueueSettings,
)

PRIORITY_RANGE = (-1000, 1000)
MAX_WEIGHT = 1000.0


def read_gateway_admission(r: Reader) -> AdmissionSettings:
    d = AdmissionSettings()
    settings = AdmissionSettings(
        policy=r.string("policy", d.policy, choices=ADMISSION_POLICIES) or d.policy
    )
    r.finish()
    return settings


def read_model_admission(r: Reader, gateway: AdmissionSettings) -> ModelAdmission:
    """A model's ``admission`` over the gateway's."""
    admission = ModelAdmission(
        max_in_flight=r.integer("max_in_flight", None),
        policy=r.string("policy", gateway.policy, choices=ADMISSION_POLICIES) or gateway.policy,
    )
    r.finish()
    return admission


def read_queue(r: Reader) -> QueueSettings:
    d = QueueSettings()
    queue = QueueSettings(
        max_requests=r.integer("max_requests", d.max_requests, minimum=0),
        max_wait_s=r.duration("max_wait_s", d.max_wait_s),
        failed_retry_s=r.duration("failed_retry_s", d.failed_retry_s),
    )
    r.finish()
    return queue


def read_key_admission(k: Reader) -> dict[str, Any]:
    """An API key's admission fields (keyword arguments of ApiKey)."""
    d = ApiKey(name="", key_env="", secret="", models=None)
    low, high = PRIORITY_RANGE
    return {
        "priority": k.integer("priority", d.priority, minimum=low, maximum=high),
        "weight": k.number("weight", d.weight, minimum=0, maximum=MAX_WEIGHT, exclusive_min=True),
        "sheddable": k.boolean("sheddable", d.sheddable),
    }
