"""scripts/bench_peers.py without llama.cpp: the bandwidth-bound arithmetic on the real GGUF's
tensor table, what the GGUF header says (served name, file type, KV bytes a token), config and
concurrency parsing, the llama.cpp ISA flag mapping, the medians and ratios, and whole reports
(checked against a JSON schema) over one and two GGUFs with a tiny engine standing in for every
server."""

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
from scripts.peers import configs, gguf_header, llama_cpp, llama_server, model_file, weights
from scripts.peers.bandwidth import read_bandwidth
from scripts.peers.cells import Target
from scripts.peers.report import ratios, server_ratios, servers_summary, summarize
from scripts.serving.engine_server import EngineServer
from tests.conftest import GEMMA_GGUF

pytestmark = pytest.mark.timeout(180)

# SmolLM2-135M: 134,515,008 parameters with tied embeddings (the model card's 135M).
SMOLLM2_PARAMS = 134_515_008
SMOLLM2_NAME, GEMMA_NAME = "smollm2-135m-instruct.q4_1", "gemma-3-270m-q4_k_m"
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
    # + 16), but a Q8_0 tensor as the file holds it (int8h: 2 + 32); auto keeps each tensor's own
    # block type
    embd_bytes = embd.n_elements * Q8_0_BLOCK / 32
    assert weights.bytes_per_token(tensors, "int8") == layers * 36 / 32 + embd_bytes + norms * 4
    # int4 keeps the vocabulary (the tied embedding / lm_head) in int8: the file's Q8_0
    expected_int4 = layers * 24 / 32 + embd_bytes + norms * 4
    assert weights.bytes_per_token(tensors, "int4") == expected_int4
    expected_auto = layers * 24 / 32 + embd_bytes + norms * 4
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
    assert args.model == [bench_peers.MODEL]


def test_cli_takes_several_models(smollm2_gguf, tmp_path):
    args = bench_peers.parse_cli(["--model", str(smollm2_gguf), "--model", str(smollm2_gguf)])
    assert args.model == [smollm2_gguf, smollm2_gguf]
    with pytest.raises(SystemExit):
        bench_peers.parse_cli(["--model", str(tmp_path / "nope.gguf")])


def test_default_configs_suit_any_file():
    """modelyard and llama run on any GGUF; llama-q4_1 only on a Q4_1 one (its name says so)."""
    assert configs.DEFAULT_CONFIGS == ("modelyard", "llama")
    assert configs.CONFIGS["modelyard"].quantization == "auto"
    for name in ("modelyard", "llama", "llama-f16", "modelyard-int4"):
        assert configs.file_type_mismatch(configs.CONFIGS[name], "Q4_K_M") is None
    q4_1 = configs.CONFIGS["llama-q4_1"]
    assert configs.file_type_mismatch(q4_1, "Q4_1") is None
    assert "Q4_K_M" in str(configs.file_type_mismatch(q4_1, "Q4_K_M"))
    assert configs.same_file_llama(["modelyard", "llama-f16", "llama-q4_1"]) == "llama-q4_1"
    assert configs.same_file_llama(["llama", "llama-q4_1"]) == "llama"
    assert configs.same_file_llama(["llama-f16"]) is None


def test_engine_default_on_a_gguf_is_auto(smollm2_gguf):
    """``modelyard`` passes --quantization auto: what the engine does for a GGUF by default."""
    from engine.serving.cli import parse_args

    config, _ = parse_args(["--model", str(smollm2_gguf)])
    assert config.quantization == configs.CONFIGS["modelyard"].quantization


# ---- the GGUF header ---------------------------------------------------------------------------


def test_served_names_come_from_the_file_name():
    assert model_file.served_name(Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")) == SMOLLM2_NAME
    assert model_file.served_name(Path("/x/My Model (v2).GGUF")) == "my-model-v2"
    names = model_file.unique_names([Path("a/m.gguf"), Path("b/m.gguf"), Path("c/n.gguf")])
    assert names == ["m", "m-2", "n"]


@pytest.mark.parametrize(
    ("path", "file_type", "kv_bytes"),
    [
        (bench_peers.MODEL, "Q4_1", 2 * 30 * 3 * 64 * 4),  # 30 layers, 3 KV heads of 64, fp32
        (GEMMA_GGUF, "Q4_K_M", 2 * 18 * 1 * 256 * 4),  # 18 layers, 1 KV head of 256 (key_length)
    ],
)
def test_file_type_and_kv_bytes_from_the_header(path, file_type, kv_bytes):
    if not path.exists():
        pytest.skip(f"{path} not fetched (make models)")
    (model,) = model_file.open_models([path])
    assert (model.file_type, model.bytes) == (file_type, path.stat().st_size)
    assert model_file.kv_bytes_per_token(path) == kv_bytes
    assert model_file.kv_bytes_per_token(path, element_bytes=2) == kv_bytes // 2
    with pytest.raises(FileNotFoundError):
        model_file.open_models([path.with_name("missing.gguf")])


def test_header_reader_refuses_what_is_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_header.read_header(bad)


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
    assert r == {"modelyard-fp32": {"c1": {
        "vs_llama_same_file": 1.0, "vs_llama_best": 0.8, "llama_best": "llama-f16",
        "ttft_p50_vs_llama_same_file": 4.0, "itl_p50_vs_llama_same_file": 4.0}}}  # fmt: skip


def test_servers_start_and_memory_over_rounds_and_their_ratios():
    rounds = [
        {"runs": {"modelyard": {"c1": _run(10, 0.1), "c16": _run(40, 0.1)}, "llama": {}},
         "startup": {"modelyard": {"ready_s": 9.0, "rss_after_load_mb": 900.0},
                     "llama": {"ready_s": 1.0, "rss_after_load_mb": 300.0}}},
        {"runs": {"modelyard": {"c1": _run(20, 0.1)}, "llama": {"c1": _run(20, 0.1)}},
         "startup": {"modelyard": {"ready_s": 11.0, "rss_after_load_mb": 1100.0},
                     "llama": {"ready_s": 3.0, "rss_after_load_mb": 500.0}}},
    ]  # fmt: skip
    rounds[0]["runs"]["modelyard"]["c1"]["vm_hwm_mb"] = 2000.0
    servers = servers_summary(rounds)
    assert servers["modelyard"] == {"ready_s": 10.0, "ready_s_rounds": [9.0, 11.0],
                                    "rss_after_load_mb": 1000.0, "rss_peak_mb": 40,
                                    "vm_hwm_mb": 2000.0}  # fmt: skip
    assert servers["llama"]["ready_s"] == 2.0 and servers["llama"]["rss_peak_mb"] == 20
    expected = {"versus": "llama", "ready_s": 5.0, "rss_after_load_mb": 2.5, "rss_peak_mb": 2.0}
    assert server_ratios(servers) == {"modelyard": expected}
    assert server_ratios({"modelyard": servers["modelyard"]}) == {}  # no llama-server ran


class _Shared:
    """The module's one tiny engine, standing in for every server: stop() leaves it running."""

    def stop(self) -> None:
        return None


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path, tmp_path_factory):
    """Started as bench_peers starts an engine (its 0.1 s readiness poll), under both names."""
    flags = ["--max-num-seqs", "4", "--kv-cache-memory", "16MiB", "--num-threads", "1"]
    names = ["--served-model-name", SMOLLM2_NAME, GEMMA_NAME]
    log = tmp_path_factory.mktemp("tiny-engine") / "engine.log"
    engine = EngineServer(["--model", str(tiny_llama_dir), *names, *flags], log)
    engine.wait_ready(timeout=180)
    yield engine
    assert engine.stop() == 0


# What a reader of bench-results/peers.json may rely on.
_CELL = {
    "type": "object",
    "required": ["output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                 "rss_peak_mb", "completed", "failed", "unfinished_at_deadline", "rounds"],
    "properties": {"output_tok_s": {"type": "number", "exclusiveMinimum": 0},
                   "rss_peak_mb": {"type": "number", "exclusiveMinimum": 0},
                   "completed": {"type": "integer", "minimum": 1}, "failed": {"const": 0}},
}  # fmt: skip
_SERVER = {
    "type": "object",
    "required": ["ready_s", "ready_s_rounds", "rss_after_load_mb", "rss_peak_mb", "vm_hwm_mb"],
    "properties": {"ready_s": {"type": "number", "minimum": 0},  # 0: the shared fake server
                   "rss_after_load_mb": {"type": "number", "exclusiveMinimum": 0}},
}  # fmt: skip
MODEL_SCHEMA = {
    "type": "object",
    "required": ["served_name", "file", "files", "rounds", "cells", "servers", "ratios",
                 "server_ratios", "bandwidth_bound", "commands", "skipped", "server_errors"],
    "properties": {
        "file": {"type": "object", "required": ["path", "bytes", "file_type"]},
        "cells": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": _CELL}},
        "servers": {"type": "object", "additionalProperties": _SERVER},
        "ratios": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": {
                "type": "object", "required": ["vs_llama_same_file", "vs_llama_best", "llama_best",
                                               "ttft_p50_vs_llama_same_file",
                                               "itl_p50_vs_llama_same_file"]}}},
        "server_ratios": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["versus", "ready_s", "rss_after_load_mb",
                                           "rss_peak_mb"]}},
        "bandwidth_bound": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["bytes_per_token", "bound_tok_s",
                                           "measured_over_bound", "decode_over_bound"]}},
    },
}  # fmt: skip
REPORT_SCHEMA = {
    "type": "object",
    "required": ["schema", "config", "host", "versions", "memory_bandwidth", "models",
                 "llama_cpp"],
    "properties": {
        "host": {"type": "object", "required": ["cpu_model", "cpu_flags", "isa_forced",
                                                "load_average_at_start", "load_average_at_end"]},
        "memory_bandwidth": {"type": "object", "required": ["read_gb_s", "best_gb_s"]},
        "models": {"type": "object", "minProperties": 1, "additionalProperties": MODEL_SCHEMA},
    },
}  # fmt: skip


@pytest.fixture
def fake_servers(tiny_engine, tmp_path, monkeypatch):
    """The tiny engine as every server of every model; no llama.cpp build, a small bandwidth
    buffer."""

    def start_server(config, args, ctx):
        ctx["commands"][config.name] = ["fake", config.name]
        return _Shared(), Target(tiny_engine.url, ctx["model"].name, tiny_engine.proc.pid)

    fake_build = llama_cpp.Build(tmp_path / "llama.cpp", "native")
    monkeypatch.setattr(bench_peers, "start_server", start_server)
    monkeypatch.setattr(bench_peers.llama_cpp, "build", lambda isa: fake_build)
    monkeypatch.setattr(bench_peers.llama_server, "version", lambda binary: "fake")
    small_buffer = functools.partial(read_bandwidth, nbytes=32 << 20, repeats=1)
    monkeypatch.setattr(bench_peers, "read_bandwidth", small_buffer)


def test_report_with_a_tiny_engine_as_every_server(
    fake_servers, smollm2_gguf, tmp_path, monkeypatch
):
    monkeypatch.setattr(bench_peers, "engine_quantizations", lambda: ["auto", "none", "int4"])
    out = tmp_path / "peers.json"
    argv = ["--configs", "modelyard-int4,modelyard-int8,llama-q4_1", "--concurrency", "1,2",
            "--rounds", "2", "--num-requests", "2", "--output-len", "4", "--input-words", "4:8",
            "--warmup", "0", "--max-seconds", "60", "--model", str(smollm2_gguf),
            "--out", str(out)]  # fmt: skip
    assert bench_peers.main(argv) == 0
    full = json.loads(out.read_text())
    jsonschema.validate(full, REPORT_SCHEMA)
    assert list(full["models"]) == [SMOLLM2_NAME]
    report = full["models"][SMOLLM2_NAME]
    assert report["server_errors"] == {}
    assert [r["order"] for r in report["rounds"]][1] == list(reversed(report["rounds"][0]["order"]))
    ran = set(report["cells"])
    assert ran == {"modelyard-int4", "llama-q4_1"}
    assert "int8" in report["skipped"]["modelyard-int8"]  # the (patched) engine lacks it
    for name in ran:
        assert set(report["cells"][name]) == {"c1", "c2"}
        assert report["cells"][name]["c2"]["rounds"] == 2
        assert report["cells"][name]["c1"]["completed"] == 4  # 2 requests x 2 rounds
        assert len(report["servers"][name]["ready_s_rounds"]) == 2
    assert set(report["ratios"]["modelyard-int4"]) == {"c1", "c2"}
    assert report["server_ratios"]["modelyard-int4"]["versus"] == "llama-q4_1"
    bound = report["bandwidth_bound"]["llama-q4_1"]
    assert bound["bytes_per_token"] == weights.bytes_per_token(
        weights.read_tensors(smollm2_gguf), "gguf"
    )
    assert bound["bound_tok_s"] == pytest.approx(
        full["memory_bandwidth"]["best_gb_s"] * 1e9 / bound["bytes_per_token"], rel=1e-3
    )


def test_report_keyed_by_model_over_two_ggufs(fake_servers, smollm2_gguf, tmp_path):
    """The default configs on each file in turn, each served under its own name; llama-q4_1 is
    skipped on the Q4_K_M file, and each file's bandwidth bound counts its own tensors."""
    if not GEMMA_GGUF.exists():
        pytest.skip(f"{GEMMA_GGUF} not fetched (make models)")
    out = tmp_path / "peers.json"
    argv = ["--configs", "modelyard,llama,llama-q4_1", "--concurrency", "1,2", "--rounds", "1",
            "--num-requests", "2", "--output-len", "4", "--input-words", "4:8", "--warmup", "0",
            "--max-seconds", "60", "--model", str(GEMMA_GGUF), "--model", str(smollm2_gguf),
            "--out", str(out)]  # fmt: skip
    assert bench_peers.main(argv) == 0
    full = json.loads(out.read_text())
    jsonschema.validate(full, REPORT_SCHEMA)
    assert list(full["models"]) == [GEMMA_NAME, SMOLLM2_NAME]
    gemma, smollm2 = full["models"][GEMMA_NAME], full["models"][SMOLLM2_NAME]
    assert gemma["file"]["file_type"] == "Q4_K_M" and smollm2["file"]["file_type"] == "Q4_1"
    assert set(gemma["cells"]) == {"modelyard", "llama"}
    assert "Q4_K_M" in gemma["skipped"]["llama-q4_1"]
    assert set(smollm2["cells"]) == {"modelyard", "llama", "llama-q4_1"}
    for report in (gemma, smollm2):
        assert report["server_ratios"]["modelyard"]["versus"] == "llama"
        assert report["ratios"]["modelyard"]["c1"]["vs_llama_same_file"] is not None
        assert report["cells"]["llama"]["c2"]["completed"] == 2
    gemma_bytes = gemma["bandwidth_bound"]["llama"]["bytes_per_token"]
    assert gemma_bytes == weights.bytes_per_token(weights.read_tensors(GEMMA_GGUF), "gguf")
    assert gemma_bytes != smollm2["bandwidth_bound"]["llama"]["bytes_per_token"]
