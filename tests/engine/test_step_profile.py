"""The step profile: spans nest and add up to the step on a tiny model; off, nothing is timed."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.model import step_context, step_profile
from engine.model.cpu.kernels import panel_gemm
from engine.model.cpu.kernels.build import available
from engine.model.step_profile import (
    ATTENTION,
    BATCH,
    FORWARD,
    POSTPROCESS,
    QKV_IN_ATTENTION,
    SAMPLE,
    SCHEDULE,
    SPANS,
    StepProfile,
)

TOP_LEVEL = [SCHEDULE, BATCH, FORWARD, SAMPLE, POSTPROCESS]


def make_core(model_dir: Path) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir), num_threads=1, max_model_len=128, max_num_batched_tokens=64
        )
    )


def add_requests(core: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate([list(range(3, 40)), [5, 6, 7], list(range(60, 90))]):
        core.add_request(f"r{i}", prompt, params)


def test_spans_nest_and_sum_to_the_step(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    profile = core.profile
    assert profile is core.runner.profile and not profile.enabled
    profile.enabled = True
    add_requests(core)
    decode_only = []
    execute = core.runner.execute

    def spy(batch):
        decode_only.append(all(n == 1 for n in batch.query_lens))
        return execute(batch)

    core.runner.execute = spy
    steps, outside_s = 0, 0.0
    while core.has_unfinished():
        started = time.perf_counter()
        core.step()
        outside_s += time.perf_counter() - started
        steps += 1
    assert profile.steps == steps
    assert profile.children(None) == TOP_LEVEL
    assert profile.children(FORWARD) == [ATTENTION]
    assert profile.children(ATTENTION) == [QKV_IN_ATTENTION]
    assert all(profile.seconds(path) >= 0 for path in SPANS)
    assert profile.seconds(FORWARD) > 0 and profile.seconds(ATTENTION) > 0
    # a child's time lies inside its parent's
    assert profile.self_seconds(FORWARD) > 0
    assert profile.self_seconds(ATTENTION) >= 0
    # the top-level spans tile each step: their sum is the steps' wall time, bar the calls' edges
    assert profile.step_seconds() == pytest.approx(sum(map(profile.seconds, TOP_LEVEL)))
    assert 0.8 * outside_s <= profile.step_seconds() <= outside_s
    layers = len(core.runner.kv_caches)
    assert profile.calls(ATTENTION) == layers * steps  # one call per layer per step
    # the fused decode calls of decode-only steps run the qkv GEMM where the panel GEMM is built
    qkv_inside = available() and panel_gemm.pack(torch.zeros(1, 1)) is not None
    assert any(decode_only) and not all(decode_only)
    assert profile.calls(QKV_IN_ATTENTION) == (layers * sum(decode_only) if qkv_inside else 0)
    per_step = profile.per_step_ms()
    assert per_step["step"] == pytest.approx(profile.step_seconds() / steps * 1e3)
    report = profile.report()
    assert f"{steps} steps" in report
    assert "      qkv_gemm" in report and "    attention" in report and "  schedule" in report
    profile.reset()
    assert profile.steps == 0 and profile.step_seconds() == 0 and profile.calls(ATTENTION) == 0


def test_off_records_nothing_and_reads_no_clock(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tiny_llama_dir)

    def no_clock() -> float:
        raise AssertionError("a clock was read with profiling off")

    for module in (step_profile, step_context):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=no_clock))
    add_requests(core)
    while core.has_unfinished():
        core.step()
    assert core.profile.steps == 0
    assert all(core.profile.seconds(p) == 0 and core.profile.calls(p) == 0 for p in SPANS)


def test_self_time_and_per_step_figures() -> None:
    profile = StepProfile()
    laps = profile.laps()  # off: a stopwatch that books nothing
    laps.lap(SCHEDULE)
    laps.end_step()
    assert profile.steps == 0 and profile.seconds(SCHEDULE) == 0
    profile.add(FORWARD, 0.010)
    profile.add(ATTENTION, 0.002)
    profile.add(ATTENTION, 0.003)
    profile.add(QKV_IN_ATTENTION, 0.001)
    profile.steps = 2
    assert profile.self_seconds(FORWARD) == pytest.approx(0.005)
    assert profile.self_seconds(ATTENTION) == pytest.approx(0.004)
    assert profile.calls(ATTENTION) == 2
    assert profile.step_seconds() == pytest.approx(0.010)
    assert profile.per_step_ms()[ATTENTION] == pytest.approx(2.5)
