"""Gateway tests: real upstream processes on 127.0.0.1 (see conftest.py, mock_upstream.py)."""
