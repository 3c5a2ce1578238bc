"""Command line of ``python -m engine``: flags -> EngineConfig + server options."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
from pathlib import Path
from typing import NoReturn

from common.engine_args import SPIN_WAIT_FLAG
from common.http_server import ClientLimits
from common.sizes import parse_size
from engine.config import EngineConfig
from engine.serving.options import ServerOptions

PROG = "python -m engine"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_CLIENTS = ClientLimits()


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad value as one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message}\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise ValueError
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError
    return value


def _size(text: str) -> int:
    value = parse_size(text)
    if value <= 0:
        raise ValueError
    return value


# argparse names the type function in its "invalid <name> value" message.
_positive_int.__name__ = "positive integer"
_port.__name__ = "port (0-65535)"
_fraction.__name__ = "fraction in (0, 1]"
_seconds.__name__ = "positive number of seconds"
_size.__name__ = "size (e.g. 512MiB)"


def _formatter(prog: str) -> argparse.HelpFormatter:
    # wide enough that every flag and its help fit on one line
    return argparse.HelpFormatter(prog, max_help_position=40, width=120)


def build_parser() -> argparse.ArgumentParser:
    d = _DEFAULTS
    p = _Parser(
        prog=PROG,
        description="Serve one model over an OpenAI-compatible HTTP API.",
        formatter_class=_formatter,
    )
    # (flag, argparse options, help); defaults come from EngineConfig where it has one
    flags: list[tuple[str, dict, str]] = [
        ("--model", {"required": True, "metavar": "PATH"}, "HF model folder or GGUF file"),
        ("--gguf-file", {"metavar": "NAME"}, "GGUF file inside --model when it is a folder"),
        ("--served-model-name", {"nargs": "+", "metavar": "NAME"},
         "names clients put in 'model' (default: --model)"),
        ("--host", {"default": "127.0.0.1"}, "address to bind (default %(default)s)"),
        ("--port", {"type": _port, "default": 8000, "metavar": "N"},
         "port to bind (default %(default)s)"),
        ("--max-model-len", {"type": _positive_int, "default": d["max_model_len"],
                             "metavar": "N"},
         "max prompt + output tokens per sequence (default %(default)s)"),
        ("--max-num-seqs", {"type": _positive_int, "default": d["max_num_seqs"], "metavar": "N"},
         "max sequences in one batch (default %(default)s)"),
        ("--max-num-batched-tokens", {"type": _positive_int,
                                      "default": d["max_num_batched_tokens"], "metavar": "N"},
         "token budget of one engine step (default %(default)s)"),
        ("--block-size", {"type": _positive_int, "default": d["block_size"], "metavar": "N"},
         "tokens per KV-cache block, a power of two (default %(default)s)"),
        ("--kv-cache-memory", {"type": _size, "default": d["kv_cache_memory"],
                               "metavar": "SIZE"},
         "CPU KV-cache budget, e.g. 512MiB (default %(default)s bytes)"),
        ("--gpu-memory-fraction", {"type": _fraction, "default": d["gpu_memory_fraction"],
                                   "metavar": "F"},
         "CUDA: share of the GPU this process may use (default %(default)s)"),
        ("--dtype", {"choices": ["auto", "float32", "float16", "bfloat16"],
                     "default": d["dtype"], "metavar": "DTYPE"},
         "auto, float32, float16 or bfloat16 (default %(default)s)"),
        ("--quantization", {"choices": ["auto", "none", "int8", "int4"],
                            "default": d["quantization"], "metavar": "FORMAT"},
         "linear and embedding weights on CPU: auto (a GGUF file's own Q8_0/Q4_0/Q4_1 blocks, "
         "the rest as --dtype), none (all as --dtype), int8 or int4 (every linear; quantised at "
         "load where the file holds another type) (default %(default)s)"),
        ("--kv-cache-dtype", {"choices": ["auto", "float32", "float16", "bfloat16"],
                              "default": d["kv_cache_dtype"], "metavar": "DTYPE"},
         "KV cache storage: auto (the model's dtype) or a narrower one (default %(default)s)"),
        ("--device", {"choices": ["auto", "cpu", "cuda"], "default": d["device"],
                      "metavar": "DEVICE"}, "auto, cpu or cuda (default %(default)s)"),
        ("--seed", {"type": int, "default": d["seed"], "metavar": "N"},
         "engine random seed (default %(default)s)"),
        ("--num-threads", {"type": _positive_int, "metavar": "N"},
         "CPU torch threads (default: the cores available)"),
        (SPIN_WAIT_FLAG, {"action": "store_true"},
         "idle CPU threads spin ~0.1 ms before sleeping: faster when this engine has the cores to "
         "itself, slower when other processes share them (read by python -m engine at start)"),
        ("--max-queue", {"type": _positive_int, "default": d["max_queue"], "metavar": "N"},
         "waiting sequences (n each request) beyond which new ones get 503 (default %(default)s)"),
        ("--max-n", {"type": _positive_int, "default": d["max_n"], "metavar": "N"},
         "most choices (n) one request may ask for, at most --max-queue; more gets 400 "
         "(default %(default)s)"),
        ("--structured-compile-timeout", {"type": _seconds,
                                          "default": d["structured_compile_timeout_s"],
                                          "metavar": "S"},
         "structured outputs: a constraint that does not compile within this (in its worker "
         "process) gets 400 grammar_too_complex (default %(default)s)"),
        ("--structured-cache-memory", {"type": _size, "default": d["structured_cache_memory"],
                                       "metavar": "SIZE"},
         "structured outputs: grammar memory, cached and in use; a larger grammar gets 400 "
         "(default %(default)s bytes)"),
        ("--structured-compile-workers", {"type": _positive_int,
                                          "default": d["structured_compile_workers"],
                                          "metavar": "N"},
         "structured outputs: compile worker processes, started on demand (default %(default)s)"),
        ("--enable-prefix-caching", {"action": "store_true", "dest": "prefix_caching",
                                     "default": d["enable_prefix_caching"]},
         "reuse KV blocks of shared prompt prefixes (default on)"),
        ("--no-enable-prefix-caching", {"action": "store_false", "dest": "prefix_caching"},
         "turn prefix caching off"),
        ("--max-body-bytes", {"type": _size, "default": 4 * 2**20, "metavar": "SIZE"},
         "larger request bodies get 413 (default %(default)s)"),
        ("--max-header-bytes", {"type": _size, "default": 8190, "metavar": "SIZE"},
         "longer request lines or header fields get 431 (default %(default)s)"),
        ("--header-timeout", {"type": _seconds, "default": _CLIENTS.header_timeout_s,
                              "metavar": "S"},
         "complete a request head within this of its first byte, else 408 (default %(default)s)"),
        ("--body-timeout", {"type": _seconds, "default": _CLIENTS.body_timeout_s, "metavar": "S"},
         "a request body must arrive within this, else 408 (default %(default)s)"),
        ("--idle-timeout", {"type": _seconds, "default": _CLIENTS.idle_timeout_s, "metavar": "S"},
         "close connections silent this long, new or kept alive (default %(default)s)"),
        ("--max-connections", {"type": _positive_int, "default": _CLIENTS.max_connections,
                               "metavar": "N"},
         "open connections; idle ones make room, then 503 (default %(default)s)"),
        ("--max-connections-per-address", {"type": _positive_int,
                                           "default": _CLIENTS.max_connections_per_address,
                                           "metavar": "N"},
         "open connections from one client address, then 429 (default %(default)s)"),
        ("--shutdown-timeout", {"type": float, "default": 30.0, "metavar": "S"},
         "seconds in-flight requests get to finish after SIGTERM (default %(default)s)"),
        ("--log-level", {"choices": ["debug", "info", "warning", "error"], "default": "info",
                         "metavar": "LEVEL"},
         "debug, info, warning or error (default %(default)s)"),
    ]  # fmt: skip
    for flag, options, text in flags:
        p.add_argument(flag, help=text, **options)
    return p


def model_flags(argv: list[str]) -> tuple[str, str | None] | None:
    """An engine command line's --model and --gguf-file, or None where it does not parse: what an
    engine template reads of the engine it is about to fork (which reports any error itself)."""
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
            args, _ = build_parser().parse_known_args(argv)
    except SystemExit:
        return None
    return args.model, args.gguf_file


def parse_args(argv: list[str] | None = None) -> tuple[EngineConfig, ServerOptions]:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = Path(args.model)
    if not model.exists():
        parser.error(f"--model {args.model}: no such file or directory")
    if args.gguf_file and not (model / args.gguf_file).is_file():
        parser.error(f"--gguf-file {args.gguf_file}: not found in {args.model}")
    try:
        config = EngineConfig(
            model=args.model,
            gguf_file=args.gguf_file,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_fraction=args.gpu_memory_fraction,
            enable_prefix_caching=args.prefix_caching,
            seed=args.seed,
            num_threads=args.num_threads,
            max_queue=args.max_queue,
            max_n=args.max_n,
            structured_compile_timeout_s=args.structured_compile_timeout,
            structured_cache_memory=args.structured_cache_memory,
            structured_compile_workers=args.structured_compile_workers,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be >= 0")
    options = ServerOptions(
        args.served_model_name or [args.model],
        args.host,
        args.port,
        args.max_body_bytes,
        args.shutdown_timeout,
        args.log_level,
        args.max_header_bytes,
        ClientLimits(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            idle_timeout_s=args.idle_timeout,
            max_connections=args.max_connections,
            max_connections_per_address=args.max_connections_per_address,
        ),
    )
    return config, options


def main(argv: list[str] | None = None) -> int:
    config, options = parse_args(argv if argv is not None else sys.argv[1:])
    from engine.serving.server import serve  # heavy imports only once the flags are valid

    return serve(config, options)
