"""Load a causal LM and its tokenizer from a local HF folder or a GGUF file, offline.

A GGUF's weights are read from the file itself at every start (engine.model.cpu.gguf_weights:
the blocks the narrow kernels read stay as the file holds them, the rest is dequantised). Its
config and tokenizer, built from the file's metadata (a 262,144-token vocabulary for Gemma) as
transformers builds them, are written once into a cache keyed by the file's sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub lookups; local_files_only enforces it too

import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from common.cache_dir import cache_root
from engine import startup
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.file_hash import file_sha256
from engine.model import gguf_tokenizer, skeleton
from engine.model.cache_dir import write_atomic_text
from engine.model.cpu.gguf_file import GgufFile
from engine.model.cpu.gguf_weights import GgufWeights
from engine.model.cpu.linear import native_bf16
from engine.model.cpu.narrow_weights import check_quantization, narrow_mode
from engine.model.gguf_reads import fast_gguf_reads
from engine.model.kept_tokenizers import (
    FROM_CONVERSION,
    FROM_FILE,
    keep_built,
    kept_tokenizer,
    shareable_tokenizer,
)
from engine.model.model_source import split_source

if TYPE_CHECKING:  # transformers' modeling imports torch._dynamo: only where a model runs it
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready to run, plus what the engine needs to know about it."""

    model: nn.Module  # transformers' model, or its skeleton (engine.model.skeleton)
    tokenizer: object  # a transformers tokenizer (fast)
    hf_config: PretrainedConfig
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: set[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    vocab_size: int
    source: str  # the folder of the config and tokenizer (the cache copy for GGUF files)
    # a GGUF's weights, whose blocks narrow_weights takes on the CPU (None once taken, off the
    # CPU or not a GGUF)
    gguf: GgufWeights | None = None
    # a GGUF's model on the CPU's narrow weights: its snapshot (None: off that path)
    snapshot: skeleton.SnapshotSlot | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available", param="device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(
            f"unknown dtype {name!r}: use auto, {', '.join(_DTYPES)}", param="dtype"
        )
    return _DTYPES[name]


def _stat_key(path: Path) -> str:
    """Cheap identity of a file (path, size, mtime) to skip re-hashing it on every start."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _read_index(index: Path) -> str | None:
    try:
        return json.loads(index.read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        return None


def known_gguf_dir(gguf_path: Path) -> Path | None:
    """The cached config and tokenizer of ``gguf_path`` if this file (its path, size and mtime)
    was converted before; None otherwise. Hashes nothing."""
    root = cache_root()
    sha = _read_index(root / "gguf-index" / f"{_stat_key(gguf_path)}.json")
    if sha is not None and (root / "gguf-metadata" / sha / "config.json").is_file():
        return root / "gguf-metadata" / sha
    return None


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cached config and tokenizer of ``gguf_path``, converting (once) when missing. A
    conversion keeps the tokenizer it built for this process (kept_tokenizers.keep_built)."""
    known = known_gguf_dir(gguf_path)
    if known is not None:
        return known
    root = cache_root()
    identity = _stat_key(gguf_path)
    started = time.monotonic()
    (root / "gguf-metadata").mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root / "gguf-metadata", prefix=".tmp-"))
    try:
        # hashlib lets go of the GIL: the file hashes on another core while the metadata converts
        # (so bytes converted before under another path convert again, in the hash's time)
        with ThreadPoolExecutor(max_workers=1) as pool:
            hashing = pool.submit(file_sha256, gguf_path)
            backend = _convert_gguf(gguf_path, staging / "converted")
            sha = hashing.result()
        if _stat_key(gguf_path) != identity:  # changed under us: don't keep a mislabeled copy
            raise ModelLoadError(f"GGUF file {str(gguf_path)!r} changed while being converted")
        target = root / "gguf-metadata" / sha
        if not (target / "config.json").is_file():
            _publish(staging / "converted", target)
            log.info("converted %s into %s in %.1fs", gguf_path, target, time.monotonic() - started)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if backend is not None:  # the same tokenizer.json as target's, whoever wrote that
        keep_built(target, backend)
    write_atomic_text(
        root / "gguf-index" / f"{identity}.json",
        json.dumps({"sha256": sha, "path": str(gguf_path.resolve())}),
    )
    return target


def _publish(converted: Path, target: Path) -> None:
    try:
        os.replace(converted, target)  # atomic: readers see no copy or a complete one
    except OSError:
        if not (target / "config.json").is_file():  # another process may have won the race
            raise


def _convert_gguf(gguf_path: Path, target: Path) -> Tokenizer | None:
    """Write the config and tokenizer of ``gguf_path`` into the new folder ``target``; returns
    the Rust tokenizer its tokenizer.json serialises where it built that itself (None where
    transformers converted it)."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            "loading a GGUF file needs the `gguf` package: pip install 'gguf>=0.17'", param="model"
        )
    folder, name = gguf_path.parent, gguf_path.name
    try:
        file = GgufFile(gguf_path, read_strings=True)
        with fast_gguf_reads(gguf_path, file):
            hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
            _check_causal_lm(hf_config)
            tokenizer = _gguf_tokenizer(gguf_path, file, hf_config)
    except ModelLoadError:
        raise
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load GGUF file {str(gguf_path)!r}: {exc}") from exc
    if hasattr(hf_config, "quantization_config"):  # the weights come from the file, as they are
        del hf_config.quantization_config
    target.mkdir(parents=True)
    hf_config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return tokenizer.tokenizer if isinstance(tokenizer, gguf_tokenizer.GgufTokenizer) else None


def _gguf_tokenizer(
    gguf_path: Path, file: GgufFile, hf_config: PretrainedConfig
) -> gguf_tokenizer.GgufTokenizer | PreTrainedTokenizerFast:
    """The tokenizer of a GGUF as transformers builds it: by engine.model.gguf_tokenizer where
    it covers the file (seconds faster), else by transformers itself."""
    try:
        return gguf_tokenizer.convert(file, hf_config)
    except gguf_tokenizer.Unsupported as exc:
        log.info("converting the tokenizer of %s with transformers: %s", gguf_path, exc)
    return AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )


def _gguf_model(
    gguf_path: Path,
    hf_config: PretrainedConfig,
    keep_blocks: bool,
    slot: skeleton.SnapshotSlot | None,
) -> tuple[nn.Module, GgufWeights]:
    """The model of ``gguf_path`` filled from the file (fp32), and the GgufWeights that reads it:
    the skeleton ``slot`` holds when it holds one, else transformers' model, built on the meta
    device. With ``keep_blocks``, the weights the narrow kernels read stay on the meta device for
    narrow_weights to take from it."""
    with startup.phase("model skeleton"):
        if slot is not None and slot.found is not None:
            model = skeleton.restore(slot.found, hf_config)
        else:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    try:
        with startup.phase("weights"):
            weights = GgufWeights(gguf_path, model)
            weights.load(model, keep_blocks)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"cannot load the weights of {str(gguf_path)!r}: {exc}") from exc
    return model, weights


def _snapshot_slot(source: Path, config: EngineConfig, dtype: torch.dtype) -> skeleton.SnapshotSlot:
    """Where the snapshot of a GGUF's model lives: keyed by the file (the converted folder is
    named by its sha256) and what the lean forward's check depends on."""
    options = {
        "dtype": str(dtype),
        "kv_cache_dtype": config.kv_cache_dtype,
        "quantization": config.quantization,
    }
    path = cache_root() / "snapshots" / f"{skeleton.snapshot_key(source.name, options)}.json"
    return skeleton.SnapshotSlot(path, found=skeleton.read(path))


def _check_causal_lm(hf_config: PretrainedConfig) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or hf_config.is_encoder_decoder:
        archs = getattr(hf_config, "architectures", None) or [model_type]
        raise ModelLoadError(
            f"unsupported architecture {', '.join(map(str, archs))}: not a decoder-only causal LM "
            "that transformers can load",
            param="model",
        )


def _eos_ids(tokenizer: object, model: PreTrainedModel) -> set[int]:
    ids: set[int] = set()
    candidates = [
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ]
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _text_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


def cpu_weight_dtype(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype to load the weights in: ``dtype``, except bf16 on a CPU without native bf16
    GEMMs (neither AVX512-BF16 nor AMX), where torch's bf16 GEMMs run several times slower than
    fp32 (docs/PERFORMANCE.md#bf16): fp32 then, with a warning, and with ``--kv-cache-dtype auto``
    the KV cache still stores bf16 (set in ``config``), which the decode kernel reads natively."""
    if device.type != "cpu" or dtype != torch.bfloat16 or native_bf16():
        return dtype
    if config.kv_cache_dtype == "auto":
        config.kv_cache_dtype = "bfloat16"
    log.warning(
        "--dtype bfloat16: this CPU has neither AVX512-BF16 nor AMX, and bf16 GEMMs without them "
        "run several times slower than float32: loading the weights as float32 instead (KV "
        "cache: %s). Pass --dtype float32 to start without this warning.",
        config.kv_cache_dtype,
    )
    return torch.float32


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the model named by ``config`` onto its device, in eval mode."""
    device = resolve_device(config.device)
    dtype = cpu_weight_dtype(config, device, resolve_dtype(config.dtype, device))
    check_quantization(config, device, dtype)
    folder, gguf_name = split_source(config.model, config.gguf_file)
    gguf_path = folder / gguf_name if gguf_name else None
    try:
        with startup.phase("gguf metadata"):
            source = converted_gguf_dir(gguf_path) if gguf_path else folder
    except OSError as exc:
        raise ModelLoadError(
            f"cannot cache the converted GGUF under {str(cache_root())!r} ({exc}); "
            "set MODELYARD_CACHE_DIR to a writable folder"
        ) from exc
    if not (source / "config.json").is_file():
        raise ModelLoadError(
            f"{str(source)!r} is not a model folder (no config.json) and no GGUF file was given",
            param="model",
        )
    try:
        hf_config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {str(source)!r}: {exc}") from exc
    _check_causal_lm(hf_config)
    gguf_weights = None
    try:
        with startup.phase("tokenizer"):
            tokenizer = _tokenizer(source, gguf_path is not None)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {str(source)!r}: {exc}") from exc
    slot = None
    try:
        if gguf_path is not None:
            keep_blocks = device.type == "cpu" and narrow_mode(config, dtype) == "gguf"
            slot = _snapshot_slot(source, config, dtype) if keep_blocks else None
            model, gguf_weights = _gguf_model(gguf_path, hf_config, keep_blocks, slot)
            if device.type != "cpu":  # the narrow formats are the CPU's: all dense
                gguf_weights.materialize(model)
                gguf_weights = None
            if dtype != torch.float32:
                model.to(dtype)
        else:
            from transformers import AutoModelForCausalLM

            with startup.phase("weights"):
                model = AutoModelForCausalLM.from_pretrained(
                    source, local_files_only=True, dtype=dtype, config=hf_config
                )
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the model in {str(source)!r}: {exc}") from exc
    if device.type != "cpu":  # on the CPU already, weights the narrow path takes still on meta
        model.to(device)
    model.eval().requires_grad_(False)
    if slot is not None and slot.found is not None:
        eos_token_ids = set(slot.found.eos_token_ids)
    else:
        eos_token_ids = _eos_ids(tokenizer, model)
        if slot is not None:
            slot.pending = _describe(model, eos_token_ids)
    text = _text_config(model.config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=model.config,
        device=device,
        dtype=dtype,
        eos_token_ids=eos_token_ids,
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        vocab_size=text.vocab_size,
        source=str(source),
        gguf=gguf_weights,
        snapshot=slot,
    )


def _tokenizer(source: Path, converted: bool) -> Any:
    """The model's tokenizer: a converted GGUF's as this process keeps it (built already where
    an engine template forked this engine), else the folder's through transformers."""
    if not converted:
        return shareable_tokenizer(AutoTokenizer.from_pretrained(source, local_files_only=True))
    tokenizer, built_from = kept_tokenizer(source)
    if built_from == FROM_FILE:
        log.info("tokenizer: the one the engine template built, shared with it")
    elif built_from == FROM_CONVERSION:
        log.info("tokenizer: the one the conversion of the GGUF built")
    return tokenizer


def _describe(model: nn.Module, eos_token_ids: set[int]) -> skeleton.Snapshot | None:
    """``model``'s snapshot, or None (logged) where its tree is not one a skeleton rebuilds."""
    try:
        return skeleton.describe(model, eos_token_ids)
    except skeleton.NotDescribable as exc:
        log.info(
            "no snapshot of %s: %s; every start builds transformers' model",
            type(model).__name__,
            exc,
        )
        return None
