"""Admission: each model's one line in front of its engines, after auth and rate limits.

A model admits as many requests as it has slots (``max_in_flight`` per available backend, at most
``limits.max_concurrency``); the others wait in its line, and so do the requests for a model whose
replica is loading, waking or restarting (it has no slots then): one line, one order. Strict
priority bands (the API key's ``priority``), and within a band fair queuing by tokens (the Virtual
Token Counter: ``vtc.py``) or first come, first served (``admission.policy``). Under overload the
keys marked ``sheddable`` are refused first, with a Retry-After from the measured drain rate.

``scheduler.py`` decides (pure: bands, counters, shedding), ``vtc.py`` keeps the counters,
``drain.py`` measures the drain rate, ``line.py`` is the asyncio side of one model's line and a
request's ``Seat`` in it, ``refusals.py`` what a refused request is told, ``control.py`` every
model's line and the tenant each key is.
"""

from gateway.admission.control import AdmissionControl
from gateway.admission.line import Seat

__all__ = ["AdmissionControl", "Seat"]
