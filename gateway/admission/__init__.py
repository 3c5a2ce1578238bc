"""Admission: each model's one line in front of its engines, after auth and rate limits.

``scheduler.py`` decides (pure: bands, counters, shedding), ``vtc.py`` keeps the counters,
``drain.py`` measures the drain rate.
"""
