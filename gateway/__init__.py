"""Modelyard gateway: routing, health, limits and the engine pool."""
