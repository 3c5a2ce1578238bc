"""Residency: which local models are awake, parked or stopped, within a memory budget.

``footprint.py`` says what one engine takes (measured by the engine, estimated before that),
``plan.py`` decides what must make room for a model to load (pure, tested rule by rule), and
``manager.py`` puts it together: loads on demand, parks after the idle TTL, evicts by least recent
use. Requests wait for a model that loads, wakes or restarts in its line (gateway/admission).
"""

from gateway.residency.manager import ResidencyManager

__all__ = ["ResidencyManager"]
