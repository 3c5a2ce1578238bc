"""The engine template: one process that has imported everything an engine needs (torch,
transformers, llguidance, aiohttp, the engine's own modules) and forks engines from itself on
the gateway's request, so that an engine starts without its imports (seconds on a small machine)
and its engines share the interpreter's and torch's pages with it (copy on write).

``python -m engine.template`` (``__main__``): the OpenMP wait policy, then ``preload`` (the import
list, and the check that no thread runs), then ``server`` (the fork loop: forks, reaps, reports to
the gateway over the wire of common/template_wire.py); a forked child becomes the engine in
``child`` (its own session, dies with the template, the engine's command line in ``cmdline``).

Imports nothing heavy itself: the wait policy must be set before torch loads libgomp.
"""
