"""The gateway's engine command (common/engine_args.py, via gateway/engines/pool.py) parsed by the
engine's own parser: every flag the gateway sets exists there and means what it meant."""

from __future__ import annotations

from dataclasses import replace

from engine.model.cpu.openmp_env import configure
from engine.serving.cli import build_parser
from gateway.config import ModelConfig
from gateway.engines.process import engine_command

MODEL = ModelConfig(
    name="smollm2",
    source="models/x.gguf",
    max_model_len=1024,
    max_num_seqs=8,
    device="cpu",
    kv_cache_memory=256 * 2**20,
    gpu_memory_fraction=0.25,
    engine_args=("--num-threads", "1", "--dtype", "bfloat16"),
    spin_wait=True,
)


def _parsed(model: ModelConfig, port: int = 8123):
    command = engine_command(model, port, launcher=("python", "-m", "engine"))
    assert command[:3] == ["python", "-m", "engine"]
    return build_parser().parse_args(command[3:]), command[3:]


def test_every_flag_the_gateway_sets_parses_to_its_value():
    args, argv = _parsed(MODEL)
    assert args.model == MODEL.source
    assert args.served_model_name == [MODEL.name]
    assert (args.host, args.port) == ("127.0.0.1", 8123)
    assert (args.max_model_len, args.max_num_seqs) == (1024, 8)
    assert args.device == "cpu"
    assert args.kv_cache_memory == 256 * 2**20
    assert args.gpu_memory_fraction == 0.25
    assert args.spin_wait is True
    assert (args.num_threads, args.dtype) == (1, "bfloat16")  # engine_args pass through
    environ: dict[str, str] = {}
    configure(argv, environ)  # the flag the engine reads before torch loads
    assert environ["GOMP_SPINCOUNT"]


def test_optional_flags_are_left_to_the_engines_defaults():
    plain = replace(MODEL, kv_cache_memory=None, gpu_memory_fraction=None, spin_wait=False)
    args, argv = _parsed(replace(plain, engine_args=()))
    defaults = build_parser().parse_args(["--model", "x"])
    assert args.kv_cache_memory == defaults.kv_cache_memory
    assert args.gpu_memory_fraction == defaults.gpu_memory_fraction
    assert args.spin_wait is False and "--spin-wait" not in argv
