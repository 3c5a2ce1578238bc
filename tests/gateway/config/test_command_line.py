"""Models from ``modelyard serve``'s command line (gateway/cli_models.py): the fleet equals the one
the same models.yaml gives, ``--print-config`` writes a file that gives it again, flags pair with
the ``--model`` before them (ambiguous input refused), the file's rules apply and their problems
name the flag, and the defaults stay on loopback."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gateway.cli import build_parser, main
from gateway.cli_models import command_line_fleet
from gateway.config import ConfigError, FleetConfig, load_config
from tests.gateway.config.documents import write


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder (the working directory) with two GGUF files and a model folder."""
    (tmp_path / "models").mkdir()
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"):
        (tmp_path / "models" / name).write_bytes(b"GGUF")
    (tmp_path / "models" / "tiny-llama").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def fleet(*argv: str) -> FleetConfig:
    parser, serve = build_parser()
    found = command_line_fleet(parser.parse_args(["serve", *argv]), serve)
    assert found is not None
    return found[0]


def same(config: FleetConfig) -> FleetConfig:
    """Where it came from aside."""
    return replace(config, path="")


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``modelyard serve ARGV`` refused by its parser: exit status 2, the reason last."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_command_line_fleet_is_the_same_models_yaml_fleet(files: Path):
    smol, gemma = "models/SmolLM2-135M-Instruct.Q4_1.gguf", "models/gemma-3-270m-q4_k_m.gguf"
    from_flags = fleet(
        "--model", smol, "--served-model-name", "smollm2", "--alias", "default", "--alias", "s",
        "--kv-cache-memory", "512MiB", "--replicas", "2", "--max-model-len", "2048",
        "--engine-args=--num-threads 1",
        "--model", gemma, "--residency", "on_demand", "--idle-ttl-s", "600", "--priority", "3",
        "--device", "cpu", "--max-num-seqs", "8", "--memory-estimate", "1GiB",
        "--gpu-memory-fraction", "0.3", "--port", "8123",
    )  # fmt: skip
    models_yaml = write(
        files / "models",
        """\
gateway:
  listen: 127.0.0.1:8123
  auth: {admin_key_env: MODELYARD_ADMIN_KEY}
models:
  - name: smollm2
    aliases: [default, s]
    source: SmolLM2-135M-Instruct.Q4_1.gguf   # relative to the file's folder
    replicas: 2
    kv_cache_memory: 512MiB
    max_model_len: 2048
    engine_args: [--num-threads, "1"]
  - name: gemma-3-270m-q4_k_m
    source: gemma-3-270m-q4_k_m.gguf
    residency: on_demand
    idle_ttl_s: 600
    priority: 3
    device: cpu
    max_num_seqs: 8
    memory_estimate: 1GiB
    gpu_memory_fraction: 0.3
""",
    )
    assert same(from_flags) == same(load_config(models_yaml))
    smollm2, gemma3 = from_flags.models
    assert (smollm2.replicas, smollm2.kv_cache_memory, smollm2.max_model_len) == (2, 2**29, 2048)
    assert (gemma3.residency, gemma3.priority, gemma3.max_num_seqs) == ("on_demand", 3, 8)


def test_print_config_writes_a_models_yaml_that_gives_the_same_fleet(files: Path, capsys):
    argv = ["models/SmolLM2-135M-Instruct.Q4_1.gguf", "--kv-cache-memory", "256MiB", "--alias",
            "default", "--residency", "on_demand", "--host", "::1"]  # fmt: skip
    assert main(["serve", *argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "listen: '[::1]:8000'" in text and f"source: {files}/models/" in text
    elsewhere = files / "elsewhere"  # absolute sources: the file works from any folder
    elsewhere.mkdir()
    printed = load_config(write(elsewhere, text))
    assert same(printed) == same(fleet(*argv))
    (model,) = printed.models
    assert (model.name, model.aliases, model.residency) == (
        "SmolLM2-135M-Instruct.Q4_1", ("default",), "on_demand",
    )  # fmt: skip


def test_one_model_is_served_under_its_file_stem_or_folder_name(files: Path):
    (gguf,) = fleet("models/SmolLM2-135M-Instruct.Q4_1.gguf").models
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1"
    assert gguf.source == str(files / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.spin_wait  # the fleet's only engine, as from a file
    (folder,) = fleet("models/tiny-llama/").models
    assert folder.name == "tiny-llama"
    (named,) = fleet("--served-model-name", "smol", "models/SmolLM2-135M-Instruct.Q4_1.gguf").models
    assert named.name == "smol"  # a per-model flag before PATH is PATH's


def test_flags_pair_with_the_model_before_them(files: Path):
    smol, gemma = "models/SmolLM2-135M-Instruct.Q4_1.gguf", "models/gemma-3-270m-q4_k_m.gguf"
    two_then_three = ("--model", smol, "--replicas", "2", "--model", gemma, "--replicas", "3")
    first, second = fleet(*two_then_three).models
    assert (first.replicas, second.replicas) == (2, 3)
    first, second = fleet("--model", smol, "--model", gemma, "--max-model-len", "1024").models
    assert (first.max_model_len, second.max_model_len) == (4096, 1024)


def test_ambiguous_command_lines_are_refused(files: Path, capsys):
    smol = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert refused(capsys, "--replicas", "2", "--model", smol) == (
        "modelyard serve: error: --replicas before any --model: each per-model flag applies to "
        "the --model before it"
    )
    assert refused(capsys, "--model", smol, "--replicas", "2", "--replicas", "3") == (
        f"modelyard serve: error: --replicas given twice for --model {smol}: each per-model flag "
        "applies once, to the --model before it"
    )
    assert refused(capsys, smol, "--model", smol) == (
        "modelyard serve: error: PATH serves one model; for several, give each with --model PATH"
    )
    assert refused(capsys, "-c", "models.yaml", "--model", smol) == (
        "modelyard serve: error: -c and PATH/--model: a fleet comes from a models.yaml or from the "
        "command line (--print-config writes one to start a file from)"
    )
    assert refused(capsys, "-c", "models.yaml", "--print-config") == (
        "modelyard serve: error: --print-config prints the models.yaml that PATH or --model give"
    )


def test_the_files_rules_apply_and_name_the_flag(files: Path):
    smol = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ConfigError) as info:
        fleet("--model", smol, "--kv-cache-memory", "lots", "--residency", "sometimes",
              "--model", "nope.gguf", "--model", smol)  # fmt: skip
    assert info.value.problems == [
        f"command line: --model {smol} --kv-cache-memory: invalid size 'lots': expected e.g. "
        "512MiB, 2GiB or a byte count",
        f"command line: --model {smol} --residency: must be one of pinned, on_demand, got "
        "'sometimes'",
        f"command line: --model nope.gguf: {files}/nope.gguf does not exist",
        f"command line: --model {smol}: name or alias 'SmolLM2-135M-Instruct.Q4_1' is already "
        f"used by --model {smol}",
    ]


def test_it_listens_on_loopback_unless_told_and_never_openly_elsewhere(files: Path):
    smol = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    gateway = fleet(smol).gateway
    assert (gateway.host, gateway.port, gateway.auth.open_mode) == ("127.0.0.1", 8000, True)
    assert gateway.auth.admin_key_env == "MODELYARD_ADMIN_KEY"
    with pytest.raises(ConfigError) as info:
        fleet(smol, "--host", "0.0.0.0")
    assert info.value.problems == [
        "command line: --host: no API keys are configured (open mode), so the gateway may only "
        "bind a loopback address, not '0.0.0.0'; add auth.keys or listen on 127.0.0.1"
    ]
