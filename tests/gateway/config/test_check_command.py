"""``modelyard check models.yaml``: OK with a summary, or every problem and exit status 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gateway.config.documents import write

REPO = Path(__file__).resolve().parents[3]


def test_check_command(tmp_path):
    good = write(
        tmp_path, {"models": [{"name": "x", "upstreams": ["http://127.0.0.1:9"]}]}, "good.yaml"
    )
    bad = write(tmp_path, {"models": [{"name": "x", "upstreams": []}], "extra": 1}, "bad.yaml")
    run = [sys.executable, "-m", "gateway.cli", "check"]
    ok = subprocess.run([*run, str(good)], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and "OK" in ok.stdout
    failed = subprocess.run([*run, str(bad)], capture_output=True, text=True, cwd=REPO)
    assert failed.returncode == 1
    assert f"{bad}: extra: unknown key" in failed.stderr
    assert f"{bad}: models[0].upstreams: must list at least one URL" in failed.stderr
