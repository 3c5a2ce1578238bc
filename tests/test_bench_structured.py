"""scripts/bench_structured.py: its validity checks, and one tiny end-to-end run against the
tiny model (an engine process, both kinds of request, the report's shape)."""

from __future__ import annotations

import json

import pytest

from scripts import bench_structured
from scripts.structured_bench.workload import INSTANCE, SCHEMA, is_valid, is_valid_leniently

pytestmark = pytest.mark.timeout(120)


def test_validity_checks() -> None:
    assert is_valid(INSTANCE)
    fenced = f"Here you go:\n```json\n{INSTANCE}\n```"
    assert not is_valid(fenced) and is_valid_leniently(fenced)
    wrong = json.loads(INSTANCE) | {"age": 500}  # above the schema's maximum
    assert not is_valid(json.dumps(wrong)) and not is_valid_leniently(json.dumps(wrong))
    assert not is_valid(INSTANCE[:-1])
    assert SCHEMA["additionalProperties"] is False  # strict: the share means something


def test_tiny_run(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    args = ["--model", str(tiny_llama_dir), "--requests", "3", "--concurrency", "2"]
    args += ["--max-tokens", "12", "--engine-args", "--num-threads 1 --kv-cache-memory 16MiB"]
    assert bench_structured.main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    compile_ms = report["compile"]
    assert 0 < compile_ms["cached_ms"]["p50"] < compile_ms["cold_ms"]["p50"]
    serving = report["serving"]
    assert serving["engine_exit_code"] == 0
    cells = serving["cells"]
    for kind in ("json_schema", "free_same_lengths", "free"):
        cell = cells[f"c2/{kind}"]
        assert cell["requests"] == 3 and cell["errors"] == 0, cell
        assert cell["output_tokens"] > 0
    # the baseline generates what its constrained twins did, token for token in number
    assert (
        cells["c2/free_same_lengths"]["output_tokens"] == cells["c2/json_schema"]["output_tokens"]
    )
    assert serving["constrained_over_free"]["c2"]["output_tokens_per_s"] > 0
