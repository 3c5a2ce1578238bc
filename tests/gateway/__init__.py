"""Gateway tests: real upstream processes on 127.0.0.1 (see conftest.py and
scripts/mock_upstream.py)."""
