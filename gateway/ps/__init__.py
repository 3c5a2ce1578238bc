"""``modelyard ps``: what a running gateway serves, from its admin API (``GET /admin/models``),
one line per model and per replica of a local model. ``fetch.py`` asks the gateway (and turns
every way that fails into one line), ``rows.py`` makes the rows (the ``--json`` output),
``table.py`` lays them out for a terminal, ``command.py`` is the command and its ``--watch``."""
