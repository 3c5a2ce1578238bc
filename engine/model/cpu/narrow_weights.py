"""``--quantization`` on the CPU: which weights go narrow, and the load-time check that the narrow
model still predicts what the fp32 one does (engine.model.cpu.quantize does the replacing)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine import startup
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.model.cpu import narrow_cache
from engine.model.cpu.gguf_weights import GgufWeights
from engine.model.cpu.kernels import quant_gemm
from engine.model.cpu.quantize import QuantizedModel, quantize_model
from engine.model.host_memory import trim_heap
from engine.model.model_source import split_source

log = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "int8", "int4")
PROBE_TOKENS = 64

# How far the quantised model's predictions may move from the fp32 model's on the probe before the
# format is refused (measured on SmolLM2-135M: docs/PERFORMANCE.md#narrow-weights).
PROBE_MIN_TOP1 = 0.8


@dataclass
class ProbeResult:
    top1_agreement: float  # share of probe positions whose argmax is unchanged
    max_error: float  # largest |logit difference| over the largest |logit|

    @property
    def ok(self) -> bool:
        return self.top1_agreement >= PROBE_MIN_TOP1


def probe_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, vocab] of the plain transformers forward over the probe ``ids`` [T]."""
    with torch.inference_mode():
        return model(input_ids=ids[None], use_cache=False).logits[0].float()


def compare_probe(reference: torch.Tensor, logits: torch.Tensor) -> ProbeResult:
    agreement = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    error = ((reference - logits).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    return ProbeResult(agreement, error)


def gguf_source(config: EngineConfig) -> Path | None:
    """The GGUF file the model was loaded from, if it was."""
    folder, gguf_name = split_source(config.model, config.gguf_file)
    return folder / gguf_name if gguf_name else None


def check_quantization(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse an explicit int8 / int4 where it cannot run (before the model loads)."""
    if config.quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"unknown quantization {config.quantization!r}: use {', '.join(QUANTIZATIONS)}",
            param="quantization",
        )
    if config.quantization not in ("int8", "int4"):
        return
    if device.type != "cpu":
        raise ModelLoadError(
            f"--quantization {config.quantization} runs on CPU only; on {device.type} the "
            "supported formats are none and auto (the weights in --dtype float16 / bfloat16)",
            param="quantization",
        )
    if dtype != torch.float32:
        raise ModelLoadError(
            f"--quantization {config.quantization} computes in float32: use --dtype float32 "
            f"(or auto) instead of {str(dtype).removeprefix('torch.')}",
            param="quantization",
        )


def narrow_mode(config: EngineConfig, dtype: torch.dtype) -> str | None:
    """quantize_model's mode for this engine, or None for dense weights."""
    if config.quantization in ("int8", "int4"):
        return config.quantization
    if config.quantization == "auto" and dtype == torch.float32 and gguf_source(config):
        return "gguf"
    return None


def narrow_weights(
    model: nn.Module,
    dtype: torch.dtype,
    config: EngineConfig,
    source: Path | None = None,
    gguf: GgufWeights | None = None,
) -> QuantizedModel | None:
    """Put ``model``'s weights on the formats ``config.quantization`` asks for; None when it
    keeps dense weights. ``gguf``: the file's weights, whose blocks go in as they are (in
    ``gguf`` mode the model is then the file's, and nothing is left to check); int8 / int4 are
    checked on a probe against the dense model. ``source``: the folder the model was loaded
    from, whose narrow weights are cached (engine.model.cpu.narrow_cache)."""
    try:
        return _narrow_weights(model, dtype, config, source, gguf)
    finally:
        if gguf is not None:
            gguf.materialize(model)  # what stayed dense, or everything where nothing went narrow
        trim_heap()  # the dense weights just freed, back to the OS


def _narrow_weights(
    model: nn.Module,
    dtype: torch.dtype,
    config: EngineConfig,
    source: Path | None,
    gguf: GgufWeights | None,
) -> QuantizedModel | None:
    mode = narrow_mode(config, dtype)
    if mode is None:
        return None
    with startup.phase("kernels"):
        lib = quant_gemm.library()
    if lib is None:
        if mode == "gguf":
            log.warning("narrow-weight kernels unavailable: the GGUF's blocks load as float32")
            return None
        raise ModelLoadError(
            f"--quantization {mode} needs the engine's C kernels, which could not be built "
            "(see the warning above); use --quantization none",
            param="quantization",
        )
    started = time.monotonic()
    native = gguf.native if gguf is not None else None
    cache = narrow_cache.cache_path(source, mode) if source else None
    if mode == "gguf":
        report = quantize_model(model, mode, native, lib, cache)
        _log_report(lib, report, None, started)
        return report if report.native else None
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (PROBE_TOKENS,), generator=torch.Generator().manual_seed(0))
    reference = probe_logits(model, ids)
    report = quantize_model(model, mode, native, lib, cache)
    if not report.native and not report.quantized:
        return None
    probe = compare_probe(reference, probe_logits(model, ids))
    if not probe.ok:
        raise ModelLoadError(
            f"--quantization {config.quantization}: the narrow model's top token agrees with the "
            f"dense model's on {probe.top1_agreement:.0%} of the probe (at least "
            f"{PROBE_MIN_TOP1:.0%} needed); use --quantization none",
            param="quantization",
        )
    _log_report(lib, report, probe, started)
    return report


def _log_report(
    lib: object, report: QuantizedModel, probe: ProbeResult | None, started: float
) -> None:
    sizes = ", ".join(
        f"{fmt} {size / 2**20:.0f} MiB" for fmt, size in report.bytes_by_format.items()
    )
    checked = (
        "the file's own blocks"
        if probe is None
        else (
            f"probe top-1 agreement {100 * probe.top1_agreement:.0f}%, max |logit diff| "
            f"{probe.max_error:.1e} of the largest"
        )
    )
    log.info(
        "narrow weights (%s kernels): %d from the file's blocks, %d quantised%s; %s; %s; %.1fs",
        quant_gemm.isa(lib),
        report.native,
        report.quantized,
        " (both read from the cache)" if report.cached else " at load",
        sizes,
        checked,
        time.monotonic() - started,
    )
