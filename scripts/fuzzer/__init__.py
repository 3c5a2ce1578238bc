"""The seeded HTTP fuzz of both servers: scripts/fuzz.py runs it long, tests/test_fuzz.py short.

Writing cases: ``cases.make_case`` mixes the families over what ``profile`` says a server serves:
``fields`` (field mutations), ``broken_json``, ``http_bodies`` (encodings and framing) and
``http_heads`` (headers, request lines, methods, paths), built from ``request`` (Case and
well-formed headers), ``bodies`` (valid bodies) and ``values`` (edge values, raw JSON text).

Running them: ``runner.Runner`` sends cases to a ``servers.Server`` over ``exchange`` (raw
sockets), judges the answers by ``verdicts`` (what counts as a finding), reads the server's
errors through ``logs`` and gathers everything in ``report``; ``servers`` also starts the process
servers (the engine's command line, the gateway's fleet).

The structured fuzz: ``structured_cases.make_structured_case`` draws constraints from
``schema_gens`` and ``text_gens`` (sizes from ``draw``, bodies and issue 29's pathological shapes
from ``constraints``); ``structured_runner`` sends them beside a ``victim`` of plain requests,
checks each 200's output with ``output_check`` and gathers ``structured_report``.
"""
