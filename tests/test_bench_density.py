"""scripts/bench_density.py without llama-server and without a gateway full of engines: argument
parsing, each copy's settings and the generated models.yaml (validated by the gateway's own
loader), the two counting loops against fakes (a gateway that parks its least recently used copy
past a budget of three; processes of given RSS), the memory totals and summary, the request round
and /status reads against an in-process engine serving two names, and main() with both sides
faked."""

from __future__ import annotations

import asyncio
import json
import os
import types
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.config.loading import load_config
from scripts import bench_density
from scripts.density_bench import fill, modelyard, summary
from scripts.density_bench.round import request_round, routed
from scripts.density_bench.settings import Settings
from scripts.peers.cells import Target
from scripts.peers.model_file import open_models
from scripts.serving.workload import build_workload
from tests.fake_core import FakeCore
from tests.server_utils import InProcessServer

pytestmark = pytest.mark.timeout(60)
GiB = 2**30


# ---- parsing and settings ----------------------------------------------------------------------


def test_cli_defaults_and_bad_values(tmp_path):
    args = bench_density.parse_cli([])
    assert args.budget == 8 * GiB and args.servers == ["modelyard", "llama"]
    assert (args.context, args.clients, args.requests, args.max_tokens) == (4096, 2, 32, 16)
    assert args.model == bench_density.MODEL and args.memory_estimate is None
    args = bench_density.parse_cli(
        ["--budget", "512MiB", "--servers", "llama", "--max-copies", "3"]
    )
    assert (args.budget, args.servers, args.max_copies) == (512 * 2**20, ["llama"], 3)
    bad = [["--budget", "lots"], ["--servers", "vllm"], ["--clients", "0"], ["--max-copies", "0"],
           ["--model", str(tmp_path / "none.gguf")]]  # fmt: skip
    for argv in bad:
        with pytest.raises(SystemExit):
            bench_density.parse_cli(argv)


@pytest.fixture
def settings(smollm2_gguf: Path, tmp_path: Path, monkeypatch) -> Settings:
    """SmolLM2 as a user types it: a path relative to the repository."""
    root = smollm2_gguf.parent.parent
    monkeypatch.chdir(root)
    (model,) = open_models([smollm2_gguf.relative_to(root)])
    return Settings(model, 8 * GiB, 4, 4096, 2, 8, 4, 60.0, 60.0, 60.0, tmp_path)


def test_each_copy_holds_the_context_in_its_kv_budget(settings):
    # SmolLM2: 30 layers x 3 KV heads x 64 x fp32, K and V: 46,080 bytes a token
    assert settings.kv_cache_bytes() == 4096 * 46080
    odd = Settings(**{**vars(settings), "context": 4000})
    assert odd.kv_cache_bytes() == 4000 * 46080  # 250 whole blocks of 16
    engine = settings.engine()
    assert (engine["max_model_len"], engine["max_num_seqs"]) == (4096, 2)
    names = settings.copy_names()
    assert names == [f"smollm2-135m-instruct.q4_1-{i}" for i in range(4)]


def test_models_yaml_is_one_the_gateway_accepts(settings, tmp_path):
    names = settings.copy_names()
    document = modelyard._document(settings, names, 1536 * 2**20)
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(document))
    config = load_config(path)
    assert [m.name for m in config.models] == names
    assert config.gateway.memory.cpu_bytes == 8 * GiB and config.gateway.memory.park
    for m in config.models:
        assert Path(m.source or "").is_absolute()  # whatever the directory of the config
        assert m.residency == "on_demand" and m.memory_estimate == 1536 * 2**20
        assert m.kv_cache_memory == settings.kv_cache_bytes() and m.max_model_len == 4096


# ---- counting ----------------------------------------------------------------------------------


class FakeGateway:
    """Holds ``fits`` copies awake: a load past that parks the least recently loaded first."""

    def __init__(self, fits: int, fail: str | None = None) -> None:
        self.fits, self.fail = fits, fail
        self.state: dict[str, str] = {}
        self.order: list[str] = []

    async def load(self, name: str) -> fill.Load:
        if name == self.fail:
            self.state[name] = "failed"
            return fill.Load(False, 0.1, "HTTP 503")
        if len(fill.awake(self.state)) >= self.fits:
            oldest = next(n for n in self.order if self.state[n] == "ready")
            self.state[oldest] = "parked"
        self.state[name] = "ready"
        self.order.append(name)
        return fill.Load(True, 0.1)

    async def states(self) -> dict[str, str]:
        return dict(self.state)


def test_fill_gateway_counts_until_the_first_eviction():
    gw = FakeGateway(fits=3)
    names = [f"m-{i}" for i in range(8)]
    out = asyncio.run(fill.fill_gateway(gw.load, gw.states, names, 60))
    assert out["awake_max"] == 3 and out["stopped_because"] == "evicted"
    assert [s["model"] for s in out["steps"]] == ["m-0", "m-1", "m-2", "m-3"]
    assert out["steps"][-1]["evicted"] == ["m-0"] and out["steps"][-1]["awake"] == 3
    assert "m-4" not in gw.state  # never tried


def test_fill_gateway_stops_at_a_failure_the_names_or_the_time():
    gw = FakeGateway(fits=5, fail="m-2")
    out = asyncio.run(fill.fill_gateway(gw.load, gw.states, ["m-0", "m-1", "m-2", "m-3"], 60))
    assert (out["awake_max"], out["stopped_because"]) == (2, "load_failed")
    assert out["steps"][-1]["error"] == "HTTP 503"
    out = asyncio.run(fill.fill_gateway(FakeGateway(5).load, gw.states, ["a", "b"], 60))
    assert out["stopped_because"] == "max_copies" and len(out["steps"]) == 2
    out = asyncio.run(fill.fill_gateway(gw.load, gw.states, ["a", "b"], 0))
    assert (out["stopped_because"], out["steps"]) == ("max_seconds", [])


def test_evicted_means_awake_before_and_not_after():
    before = {"a": "ready", "b": "ready", "c": "parked"}
    after = {"a": "parking", "b": "ready", "c": "parked", "d": "ready"}
    assert fill.evicted(before, after) == ["a"] and fill.awake(after) == ["b", "d"]


class FakeCopy:
    def __init__(self, rss: int) -> None:
        self.rss_bytes, self.stopped = rss, False

    def stop(self) -> None:
        self.stopped = True


def _starter(sizes: list[int], made: list[FakeCopy], fail_at: int | None = None):
    async def start(index: int) -> FakeCopy:
        if index == fail_at:
            raise RuntimeError("llama-server exited with code -11 (SIGSEGV)")
        made.append(FakeCopy(sizes[index]))
        return made[-1]

    return start


def test_fill_processes_stops_before_the_next_would_pass_the_budget():
    made: list[FakeCopy] = []
    copies, info = asyncio.run(fill.fill_processes(_starter([300] * 9, made), 1000, 9, 60))
    assert len(copies) == 3 and len(made) == 3  # a fourth (1,200) is not even started
    assert info == {"count": 3, "stopped_because": "budget", "rss_sum_bytes": 900}


def test_fill_processes_drops_a_copy_larger_than_predicted():
    made: list[FakeCopy] = []
    copies, info = asyncio.run(fill.fill_processes(_starter([300, 300, 500], made), 1000, 9, 60))
    assert len(copies) == 2 and made[2].stopped and not made[1].stopped
    assert info["stopped_because"] == "budget" and info["rss_sum_bytes"] == 600


def test_fill_processes_bounds_and_failures():
    made: list[FakeCopy] = []
    copies, info = asyncio.run(fill.fill_processes(_starter([1] * 9, made), 1000, 4, 60))
    assert (len(copies), info["stopped_because"]) == (4, "max_copies")
    copies, info = asyncio.run(fill.fill_processes(_starter([1] * 9, [], 1), 1000, 4, 60))
    assert len(copies) == 1 and "SIGSEGV" in info["stopped_because"]
    copies, info = asyncio.run(fill.fill_processes(_starter([1] * 9, []), 1000, 4, 0))
    assert (copies, info["stopped_because"]) == ([], "max_seconds")


# ---- memory and summary ------------------------------------------------------------------------


def test_memory_totals_by_state():
    copies = {
        "a": {"state": "ready", "rss_bytes": 1000, "pss_bytes": 800},
        "b": {"state": "ready", "rss_bytes": 1000, "pss_bytes": None},  # /status did not answer
        "c": {"state": "parked", "rss_bytes": 400, "pss_bytes": 250},
    }
    assert modelyard.memory_totals(copies) == {
        "ready": {"copies": 2, "rss_bytes": 2000, "pss_bytes": 800},
        "parked": {"copies": 1, "rss_bytes": 400, "pss_bytes": 250},
    }


def _round(p50: float, p99: float) -> dict:
    return {"e2e_s": {"p50": p50, "p99": p99}, "ttft_s": {"p50": 0.1}, "completed": 32,
            "errors": 0, "unfinished_at_deadline": 0}  # fmt: skip


def test_summary_and_ratios():
    my = {
        "fill": {"awake_max": 4, "stopped_because": "evicted"},
        "round": _round(0.5, 1.0),
        "memory_awake": {"totals": {"ready": {"copies": 4, "rss_bytes": 8, "pss_bytes": 6}}},
        "memory_after_park": {"totals": {"parked": {"copies": 2, "rss_bytes": 2, "pss_bytes": 1}}},
    }
    ll = {"fill": {"count": 16, "stopped_because": "max_copies"}, "round": _round(0.25, 2.0),
          "totals": {"copies": 16, "rss_bytes": 16, "pss_bytes": 12}}  # fmt: skip
    out = summary.summarize(my, ll)
    assert out["modelyard"]["awake"] == 4 and out["modelyard"]["parked_pss_bytes"] == 1
    assert out["llama"]["awake"] == 16 and out["llama"]["awake_pss_bytes"] == 12
    ratios = {"awake": 0.25, "latency_p50_s": 2.0, "latency_p99_s": 0.5, "awake_pss_bytes": 0.5}
    assert out["modelyard_over_llama"] == ratios
    only = summary.summarize({"error": "probe: boom"}, None)
    assert only["modelyard"]["error"] == "probe: boom" and "modelyard_over_llama" not in only


# ---- against an engine serving two names ------------------------------------------------------


@pytest.fixture
async def two_copies(tokenizer):
    """One in-process engine (FakeCore) serving two names: two 'copies' for the round and
    /status."""
    server = await InProcessServer(lambda: FakeCore(tokenizer), ["m-0", "m-1"]).start()
    yield server
    await server.stop()


async def test_round_goes_to_every_copy_in_turn(two_copies):
    specs = routed(build_workload(5, 0, (4, 8), (4, 4)), 2)
    assert [s.copy for s in specs] == [0, 1, 0, 1, 0]
    pid = os.getpid()
    targets = [Target(two_copies.url, "m-0", pid), Target(two_copies.url, "m-1", pid)]
    out = await request_round(targets, clients=2, count=6, max_tokens=4, max_seconds=60)
    assert out["completed"] == 6 and out["errors"] == 0 and out["copies"] == 2
    assert out["completed_per_copy"] == {"m-0": 3, "m-1": 3}
    assert out["e2e_s"]["p50"] > 0 and out["e2e_s"]["p99"] >= out["e2e_s"]["p50"]
    assert await request_round([], 2, 6, 4, 60) == {"skipped": "no copy awake"}


async def test_engine_memory_reads_each_running_copys_status(two_copies):
    models = {
        "m-0": {"state": "ready", "replicas": [{"url": two_copies.url, "pid": os.getpid()}]},
        "m-1": {"state": "stopped", "replicas": [{"url": None, "pid": None}]},
    }
    async with aiohttp.ClientSession() as session:
        gw = types.SimpleNamespace(session=session)
        out = await modelyard.engine_memory(gw, models)  # type: ignore[arg-type]
    assert list(out) == ["m-0"] and out["m-0"]["sleeping"] is False
    assert out["m-0"]["pss_bytes"] > 0 and out["m-0"]["rss_bytes"] >= out["m-0"]["pss_bytes"]


# ---- main --------------------------------------------------------------------------------------


def test_main_writes_both_sides_and_the_summary(tmp_path, monkeypatch, smollm2_gguf):
    seen: dict = {}

    async def fake_modelyard(s, estimate):
        seen["modelyard"] = (s.budget_bytes, s.context, estimate)
        return {"fill": {"awake_max": 2, "stopped_because": "evicted"}, "round": _round(1.0, 2.0)}

    async def fake_llama(s, binary, threads, extra):
        seen["llama"] = (binary, threads, extra)
        return {"fill": {"count": 4, "stopped_because": "budget"}, "round": _round(0.5, 1.0),
                "totals": {"copies": 4, "rss_bytes": 4, "pss_bytes": 4}}  # fmt: skip

    fake_build = types.SimpleNamespace(server=tmp_path / "llama-server")
    monkeypatch.setattr(bench_density.modelyard, "run", fake_modelyard)
    monkeypatch.setattr(bench_density.llama, "run", fake_llama)
    monkeypatch.setattr(bench_density.llama_cpp, "build", lambda isa: fake_build)
    monkeypatch.setattr(bench_density.llama_server, "version", lambda binary: "fake")
    out = tmp_path / "density.json"
    argv = ["--model", str(smollm2_gguf), "--budget", "2GiB", "--context", "1024",
            "--memory-estimate", "1GiB", "--llama-flags=--no-repack", "--threads", "1",
            "--log-dir", str(tmp_path / "logs"), "--out", str(out)]  # fmt: skip
    assert bench_density.main(argv) == 0
    report = json.loads(out.read_text())
    assert seen["modelyard"] == (2 * GiB, 1024, GiB)
    assert seen["llama"] == (fake_build.server, 1, ["--no-repack"])
    assert report["model"]["served_name"] == "smollm2-135m-instruct.q4_1"
    assert report["model"]["kv_bytes_per_token"] == 46080
    assert report["summary"]["modelyard_over_llama"]["awake"] == 0.5
    assert report["llama_cpp"]["server_version"] == "fake"
