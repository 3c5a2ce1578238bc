"""scripts/bench_peers.py without llama.cpp: the bandwidth-bound arithmetic on the real GGUF's
tensor table, config and concurrency parsing, the llama.cpp ISA flag mapping, the medians and
ratios, and a whole report (checked against a JSON schema) with a tiny engine standing in for
every server."""

from __future__ import annotations

import argparse
import functools
import io
import json
import tarfile
from pathlib import Path

import jsonschema
import pytest

from scripts import bench_peers
from scripts.peers import configs, llama_cpp, llama_server, weights
from scripts.peers.bandwidth import read_bandwidth
from scripts.peers.cells import Target
from scripts.peers.report import ratios, summarize
from tests.server_utils import EngineProcess

pytestmark = pytest.mark.timeout(180)

# SmolLM2-135M: 134,515,008 parameters with tied embeddings (the model card's 135M).
SMOLLM2_PARAMS = 134_515_008
Q4_1_BLOCK, Q8_0_BLOCK = 20, 34  # bytes per 32 weights: fp16 d (and m for Q4_1) + the quants


# ---- bandwidth bound ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tensors(smollm2_gguf: Path) -> list[weights.Tensor]:
    return weights.read_tensors(smollm2_gguf)


def test_real_gguf_bytes_per_token_per_format(tensors):
    assert sum(t.n_elements for t in tensors) == SMOLLM2_PARAMS
    assert not any(t.name == "output.weight" for t in tensors)  # tied: lm_head = token_embd
    embd = next(t for t in tensors if t.name == "token_embd.weight")
    assert embd.ggml_type == "Q8_0"
    norms = sum(t.n_elements for t in tensors if len(t.shape) == 1)
    matrices = SMOLLM2_PARAMS - norms
    layers = matrices - embd.n_elements  # all Q4_1
    # the file: every matrix Q4_1 but the (tied) embedding, Q8_0; norms F32
    expected = layers * Q4_1_BLOCK / 32 + embd.n_elements * Q8_0_BLOCK / 32 + norms * 4
    assert weights.bytes_per_token(tensors, "gguf") == expected
    assert weights.bytes_per_token(tensors, "fp32") == SMOLLM2_PARAMS * 4
    assert weights.bytes_per_token(tensors, "f16") == matrices * 2 + norms * 4
    # Modelyard's records: fp32 scale (int8: 4 + 32 bytes a block), scale + offset (int4: 4 + 4
    # + 16); auto keeps each tensor's own block type
    assert weights.bytes_per_token(tensors, "int8") == matrices * 36 / 32 + norms * 4
    # int4 keeps the vocabulary (the tied embedding / lm_head) in int8
    expected_int4 = layers * 24 / 32 + embd.n_elements * 36 / 32 + norms * 4
    assert weights.bytes_per_token(tensors, "int4") == expected_int4
    expected_auto = layers * 24 / 32 + embd.n_elements * 36 / 32 + norms * 4
    assert weights.bytes_per_token(tensors, "auto") == expected_auto


def test_own_lm_head_leaves_the_embedding_lookup_out():
    t = [
        weights.Tensor("token_embd.weight", "F32", (64, 100), 25600),
        weights.Tensor("output.weight", "F32", (64, 100), 25600),
        weights.Tensor("blk.0.attn_norm.weight", "F32", (64,), 256),
    ]
    assert weights.bytes_per_token(t, "fp32") == 25856
    assert weights.bytes_per_token(t, "f16") == 12800 + 256
    assert weights.bytes_per_token(t, "int8") == 100 * 2 * 36 + 256
    with pytest.raises(ValueError, match="unknown weight format"):
        weights.bytes_per_token(t, "q2")


def test_bound_is_bandwidth_over_bytes(tensors):
    nbytes = weights.bytes_per_token(tensors, "gguf")
    assert weights.bound_tok_s(10.0, nbytes) == pytest.approx(10e9 / nbytes)
    assert weights.bound_tok_s(10.0, 10**8) == pytest.approx(100.0)


# ---- parsing ---------------------------------------------------------------------------------


def test_configs_parse_in_order_without_repeats():
    parsed = configs.parse_configs("llama-f16, modelyard-fp32,llama-f16")
    assert [c.name for c in parsed] == ["llama-f16", "modelyard-fp32"]
    for bad in ("modelyard-fp64", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError):
            configs.parse_configs(bad)


def test_concurrencies_parse_sorted():
    assert configs.parse_concurrencies("16,1,4,4") == [1, 4, 16]
    for bad in ("0,4", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            configs.parse_concurrencies(bad)


def test_engine_flags_skip_what_the_engine_lacks():
    int4, fp32 = configs.CONFIGS["modelyard-int4"], configs.CONFIGS["modelyard-fp32"]
    assert configs.engine_flags(fp32, None) == ([], None)  # no flag yet: fp32 is the bare engine
    flags, why = configs.engine_flags(int4, None)
    assert flags is None and "no --quantization" in str(why)
    assert configs.engine_flags(int4, ["none", "int4"]) == (["--quantization", "int4"], None)
    flags, why = configs.engine_flags(configs.CONFIGS["modelyard-int8"], ["none", "int4"])
    assert flags is None and "int8" in str(why)


def test_engine_quantizations_reads_the_engines_parser():
    choices = configs.engine_quantizations()
    assert choices is not None and {"none", "int8", "int4"} <= set(choices)


def test_cli_rejects_bad_values(capsys):
    for argv in (["--rounds", "0"], ["--configs", "nope"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            bench_peers.parse_cli(argv)
    args = bench_peers.parse_cli([])
    assert args.concurrency == [1, 4, 16, 32, 64] and args.rounds == 2
    assert [c.name for c in args.configs] == list(configs.DEFAULT_CONFIGS)


# ---- llama.cpp build flags -------------------------------------------------------------------


def test_isa_follows_modelyard_cpu_isa():
    assert llama_cpp.isa_from_env({}) == "native"
    assert llama_cpp.isa_from_env({"MODELYARD_CPU_ISA": "auto"}) == "native"
    assert llama_cpp.isa_from_env({"MODELYARD_CPU_ISA": " AVX2 "}) == "avx2"
    with pytest.raises(ValueError, match="MODELYARD_CPU_ISA"):
        llama_cpp.isa_from_env({"MODELYARD_CPU_ISA": "sse2"})


def test_avx2_build_turns_every_wider_extension_off():
    flags = llama_cpp.cmake_flags("avx2")
    on = {f[2:-3] for f in flags if f.endswith("=ON")}
    off = {f[2:-4] for f in flags if f.endswith("=OFF")}
    assert {"GGML_AVX2", "GGML_FMA", "GGML_F16C"} <= on
    assert {"GGML_NATIVE", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AMX_INT8"} <= off
    assert {"LLAMA_CURL", "LLAMA_OPENSSL", "LLAMA_BUILD_UI", "LLAMA_USE_PREBUILT_UI"} <= off
    assert "-DGGML_NATIVE=ON" in llama_cpp.cmake_flags("native")
    assert not on & off


def test_build_options_exist_in_the_vendored_cmake():
    """Every -D option is one the pinned llama.cpp declares (a renamed one would be ignored)."""
    sdist = llama_cpp.CACHE / "downloads" / llama_cpp.SDIST
    if not sdist.exists():
        pytest.skip(f"{sdist} not fetched (python -m scripts.peers.llama_cpp fetches it)")
    root = f"{llama_cpp.PACKAGE}-{llama_cpp.VERSION}/vendor/llama.cpp/"
    text = ""
    with tarfile.open(sdist) as tar:
        for name in ("CMakeLists.txt", "ggml/CMakeLists.txt"):
            text += io.TextIOWrapper(tar.extractfile(root + name)).read()  # type: ignore[arg-type]
    deprecated = {"LLAMA_CURL"}  # still accepted (llama_option_depr), kept for older trees
    for isa in llama_cpp.ISA_FLAGS:
        for flag in llama_cpp.cmake_flags(isa):
            name = flag[2:].split("=")[0]
            if name.startswith(("GGML_", "LLAMA_")) and name not in deprecated:
                assert f"option({name} " in text, name


def test_llama_server_waits_like_the_engine(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert llama_server.openmp_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert llama_server.openmp_env(["--spin-wait"])["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the operator's choice wins
    assert llama_server.openmp_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_llama_server_command_sizes_one_shared_kv_cache():
    ctx = llama_server.context_size(64, 528, 128)
    assert ctx == 64 * 656
    cmd = llama_server.server_command(Path("llama-server"), Path("m.gguf"), "x", 1, 2, 64, ctx)

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--parallel") == "64" and flag("--ctx-size") == str(ctx)
    assert flag("--threads") == flag("--threads-batch") == "2"
    assert {"--kv-unified", "--cont-batching", "--no-webui"} <= set(cmd)


def test_llama_server_takes_extra_flags_and_names_a_crash_signal(tmp_path):
    """--llama-flags reach the command line; a server killed by a signal at start-up (llama.cpp's
    Q4_1 repacking segfaults on some AMX CPUs) says which."""
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nkill -SEGV $$\n")
    binary.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin"}
    server = llama_server.LlamaServer.start(
        binary, Path("m.gguf"), "x", 1, 1, 256, tmp_path / "log", env, ["--no-repack"]
    )
    try:
        assert server.command[-1] == "--no-repack"
        with pytest.raises(RuntimeError, match=r"exited with code -11 \(SIGSEGV\)"):
            server.wait_ready(timeout=10)
    finally:
        server.stop()


# ---- the report ------------------------------------------------------------------------------


def _run(tok_s: float, itl: float) -> dict:
    q = {"p50": itl, "p99": 2 * itl}
    return {"output_tokens_per_s": tok_s, "ttft_s": q, "itl_s": q, "rss_peak_mb": tok_s,
            "completed": 2, "failed": 0, "unfinished_at_deadline": 1}  # fmt: skip


def test_medians_over_rounds_and_ratios():
    rounds = [
        {"runs": {"modelyard-fp32": {"c1": _run(10, 0.1)}, "llama-q4_1": {"c1": _run(20, 0.05)},
                  "llama-f16": {"c1": _run(40, 0.1)}}},
        {"runs": {"modelyard-fp32": {"c1": _run(30, 0.3)}, "llama-q4_1": {"c1": _run(20, 0.05)},
                  "llama-f16": {"c1": _run(10, 0.1)}}},
        {"runs": {"modelyard-fp32": {"c1": _run(20, 0.2)}}},
    ]  # fmt: skip
    cells = summarize(rounds)
    mine = cells["modelyard-fp32"]["c1"]
    assert mine["output_tok_s"] == 20 and mine["itl_p50_s"] == 0.2 and mine["itl_p99_s"] == 0.4
    assert mine["rounds"] == 3 and mine["completed"] == 6 and mine["rss_peak_mb"] == 30
    assert mine["unfinished_at_deadline"] == 3
    assert cells["llama-f16"]["c1"]["output_tok_s"] == 25
    r = ratios(cells)
    assert r == {"modelyard-fp32": {"c1": {"vs_llama_q4_1": 1.0, "vs_llama_best": 0.8,
                                           "llama_best": "llama-f16"}}}  # fmt: skip


class _Shared:
    """The module's one tiny engine, standing in for every server: stop() leaves it running."""

    def stop(self) -> None:
        return None


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path):
    flags = ("--max-num-seqs", "4", "--kv-cache-memory", "16MiB", "--num-threads", "1")
    proc = EngineProcess(tiny_llama_dir, *flags, names=(bench_peers.SERVED_NAME,)).wait_ready()
    yield proc
    assert proc.stop() == 0


# What a reader of bench-results/peers.json may rely on.
_CELL = {
    "type": "object",
    "required": ["output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                 "rss_peak_mb", "completed", "failed", "unfinished_at_deadline", "rounds"],
    "properties": {"output_tok_s": {"type": "number", "exclusiveMinimum": 0},
                   "rss_peak_mb": {"type": "number", "exclusiveMinimum": 0},
                   "completed": {"type": "integer", "minimum": 1}, "failed": {"const": 0}},
}  # fmt: skip
REPORT_SCHEMA = {
    "type": "object",
    "required": ["schema", "config", "host", "versions", "memory_bandwidth", "models", "rounds",
                 "cells", "ratios", "bandwidth_bound", "commands", "skipped", "llama_cpp",
                 "server_errors"],
    "properties": {
        "host": {"type": "object", "required": ["cpu_model", "cpu_flags", "isa_forced",
                                                "load_average_at_start", "load_average_at_end"]},
        "memory_bandwidth": {"type": "object", "required": ["read_gb_s", "best_gb_s"]},
        "cells": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": _CELL}},
        "ratios": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": {
                "type": "object", "required": ["vs_llama_q4_1", "vs_llama_best", "llama_best"]}}},
        "bandwidth_bound": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["bytes_per_token", "bound_tok_s",
                                           "measured_over_bound", "decode_over_bound"]}},
    },
}  # fmt: skip


def test_report_with_a_tiny_engine_as_every_server(
    tiny_engine, smollm2_gguf, tmp_path, monkeypatch
):
    def start_server(config, args, ctx):
        ctx["commands"][config.name] = ["fake", config.name]
        return _Shared(), Target(tiny_engine.url, bench_peers.SERVED_NAME, tiny_engine.proc.pid)

    fake_build = llama_cpp.Build(tmp_path / "llama.cpp", "native")
    monkeypatch.setattr(bench_peers, "start_server", start_server)
    monkeypatch.setattr(bench_peers.llama_cpp, "build", lambda isa: fake_build)
    monkeypatch.setattr(bench_peers.llama_server, "version", lambda binary: "fake")
    monkeypatch.setattr(bench_peers, "engine_quantizations", lambda: ["auto", "none", "int4"])
    small_buffer = functools.partial(read_bandwidth, nbytes=32 << 20, repeats=1)
    monkeypatch.setattr(bench_peers, "read_bandwidth", small_buffer)
    out = tmp_path / "peers.json"
    argv = ["--configs", "modelyard-int4,modelyard-int8,llama-q4_1", "--concurrency", "1,2",
            "--rounds", "2", "--num-requests", "2", "--output-len", "4", "--input-words", "4:8",
            "--warmup", "0", "--max-seconds", "60", "--model", str(smollm2_gguf),
            "--out", str(out)]  # fmt: skip
    assert bench_peers.main(argv) == 0
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["server_errors"] == {}
    assert [r["order"] for r in report["rounds"]][1] == list(reversed(report["rounds"][0]["order"]))
    ran = set(report["cells"])
    assert ran == {"modelyard-int4", "llama-q4_1"}
    assert "int8" in report["skipped"]["modelyard-int8"]  # the (patched) engine lacks it
    for name in ran:
        assert set(report["cells"][name]) == {"c1", "c2"}
        assert report["cells"][name]["c2"]["rounds"] == 2
        assert report["cells"][name]["c1"]["completed"] == 4  # 2 requests x 2 rounds
    assert set(report["ratios"]["modelyard-int4"]) == {"c1", "c2"}
    bound = report["bandwidth_bound"]["llama-q4_1"]
    assert bound["bytes_per_token"] == weights.bytes_per_token(
        weights.read_tensors(smollm2_gguf), "gguf"
    )
    assert bound["bound_tok_s"] == pytest.approx(
        report["memory_bandwidth"]["best_gb_s"] * 1e9 / bound["bytes_per_token"], rel=1e-3
    )
