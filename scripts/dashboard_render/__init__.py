"""scripts/render_dashboards.py's parts: grafana.py (window, variables, queries, legends),
prometheus.py (range queries into each panel's data), units.py (Grafana's units), drawing.py
(matplotlib)."""
