"""models.yaml validation: every problem named with file, key path and reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway import app as gateway_app
from gateway.config import ConfigError, load_config, parse_config
from tests.gateway.conftest import fleet
from tests.gateway.test_resilience import wait_for

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, doc, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def problems(tmp_path: Path, doc) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, doc))
    return info.value.problems


def test_full_design_example_parses(tmp_path, monkeypatch):
    monkeypatch.setenv("TEAM_A_KEY", "sk-a")
    monkeypatch.setenv("MODELYARD_ADMIN_KEY", "sk-admin")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_bytes(b"GGUF")
    doc = {
        "gateway": {
            "listen": "127.0.0.1:8000",
            "timeouts": {"connect_s": 2, "first_byte_s": 60, "idle_s": 30, "total_s": 600},
            "health": {"interval_s": 2, "timeout_s": 1, "unhealthy_after": 2, "healthy_after": 1},
            "ejection": {"consecutive_failures": 3, "base_s": 5, "max_s": 300, "max_percent": 50},
            "retries": {"attempts": 2, "backoff_ms": 50},
            "max_body_bytes": 4194304,
            "auth": {
                "admin_key_env": "MODELYARD_ADMIN_KEY",
                "keys": [
                    {
                        "name": "team-a",
                        "key_env": "TEAM_A_KEY",
                        "models": ["smollm2"],
                        "rpm": 600,
                        "tpm": 200000,
                    }
                ],
            },
        },
        "defaults": {"device": "auto", "max_model_len": 4096, "max_num_seqs": 16},
        "models": [
            {
                "name": "smollm2",
                "aliases": ["default"],
                "source": "models/tiny.gguf",
                "replicas": 2,
                "gpu_memory_fraction": 0.3,
                "kv_cache_memory": "512MiB",
                "limits": {"rpm": 1200, "tpm": 500000, "max_concurrency": 64},
            },
            {
                "name": "big-remote",
                "upstreams": ["http://gpu-node-1:8000", "http://gpu-node-2:8000/v1/"],
                "upstream_model": "Qwen/Qwen2.5-72B-Instruct",
                "health_path": "/health",
                "timeouts": {"first_byte_s": 120},
            },
        ],
    }
    config = load_config(write(tmp_path, doc))
    local, remote = config.models
    assert local.local and local.replicas == 2 and local.kv_cache_memory == 512 * 2**20
    assert local.source == str(tmp_path / "models" / "tiny.gguf")
    assert local.max_num_seqs == 16 and local.gpu_memory_fraction == 0.3
    assert remote.upstreams == ("http://gpu-node-1:8000", "http://gpu-node-2:8000")
    assert remote.wire_name == "Qwen/Qwen2.5-72B-Instruct"
    assert remote.timeouts.first_byte_s == 120 and remote.timeouts.connect_s == 2
    assert config.gateway.auth.keys[0].secret == "sk-a"
    assert "sk-a" not in repr(config)  # secrets stay out of reprs and logs


def test_every_problem_reported_with_path(tmp_path, monkeypatch):
    monkeypatch.delenv("MISSING_KEY_ENV", raising=False)
    doc = {
        "gateway": {
            "listen": "0.0.0.0:80",
            "timeouts": {"connect_s": -1},
            "retires": {},
            "auth": {"keys": [{"name": "k", "key_env": "MISSING_KEY_ENV", "models": ["ghost"]}]},
        },
        "models": [
            {"name": "a", "upstreams": ["ftp://x"], "replicas": 2},
            {"name": "b", "aliases": ["a"], "source": "nope.gguf", "upstreams": ["http://h:1"]},
            {"name": "c"},
            {"name": "d", "upstreams": ["http://h:1"], "limits": {"rpm": "many"}},
        ],
    }
    found = "\n".join(problems(tmp_path, doc))
    file = str(tmp_path / "models.yaml")
    for expected in [
        f"{file}: gateway.timeouts.connect_s: must be > 0",
        f"{file}: gateway.retires: unknown key",
        f"{file}: gateway.auth.keys[0].key_env: environment variable MISSING_KEY_ENV is not set",
        f"{file}: models[0].upstreams[0]: 'ftp://x' is not an http(s) URL",
        f"{file}: models[0].replicas: only applies to local models",
        f"{file}: models[1].source: a model has either `source`",
        f"{file}: models[1]: name or alias 'a' is already used by models[0]",
        f"{file}: models[2]: needs `source`",
        f"{file}: models[3].limits.rpm: must be an integer",
        f"{file}: gateway.auth.keys[0].models: unknown model 'ghost'",
    ]:
        assert expected in found, f"missing {expected!r} in:\n{found}"


def test_open_mode_must_bind_loopback(tmp_path):
    doc = {
        "gateway": {"listen": "0.0.0.0:8000"},
        "models": [{"name": "a", "upstreams": ["http://h:1"]}],
    }
    assert any("open mode" in p and "gateway.listen" in p for p in problems(tmp_path, doc))


def test_gpu_fraction_sum_and_sizes(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    doc = {
        "models": [
            {"name": "a", "source": "m.gguf", "replicas": 2, "gpu_memory_fraction": 0.4},
            {
                "name": "b",
                "source": "m.gguf",
                "gpu_memory_fraction": 0.2,
                "kv_cache_memory": "lots",
            },
        ]
    }
    found = "\n".join(problems(tmp_path, doc))
    assert "sums to 1.00" in found
    assert "models[1].kv_cache_memory: invalid size 'lots'" in found


def test_yaml_syntax_error_has_line(tmp_path):
    found = problems(tmp_path, "models:\n  - name: a\n   bad: [\n")
    assert len(found) == 1 and "line " in found[0] and "invalid YAML" in found[0]


def test_parse_config_defaults():
    config = parse_config({"models": [{"name": "x", "upstreams": ["http://127.0.0.1:9"]}]})
    assert config.gateway.host == "127.0.0.1" and config.gateway.port == 8000
    assert config.gateway.auth.open_mode
    assert config.models[0].health_path == "/ready"


def test_check_command(tmp_path):
    good = write(
        tmp_path, {"models": [{"name": "x", "upstreams": ["http://127.0.0.1:9"]}]}, "good.yaml"
    )
    bad = write(tmp_path, {"models": [{"name": "x", "upstreams": []}], "extra": 1}, "bad.yaml")
    run = [sys.executable, "-m", "gateway.cli", "check"]
    ok = subprocess.run([*run, str(good)], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and "OK" in ok.stdout
    failed = subprocess.run([*run, str(bad)], capture_output=True, text=True, cwd=REPO)
    assert failed.returncode == 1
    assert f"{bad}: extra: unknown key" in failed.stderr
    assert f"{bad}: models[0].upstreams: must list at least one URL" in failed.stderr


async def test_watcher_waits_until_the_file_is_written(start_gateway, fresh_upstreams, monkeypatch):
    """An editor's write in two pieces, with the watcher polling in between: one reload, of the
    whole file, and no rejection of the half."""
    polls = 0
    stamp = gateway_app._stamp

    def counted_stamp(path):
        nonlocal polls
        polls += 1
        return stamp(path)

    async def next_poll() -> None:
        seen = polls
        await wait_for(lambda: polls > seen, timeout=2.0)

    monkeypatch.setattr(gateway_app, "_stamp", counted_stamp)
    monkeypatch.setattr(gateway_app, "CONFIG_POLL_S", 0.05)
    upstream = fresh_upstreams[0].url
    gw = await start_gateway(fleet([upstream], watch_config=True))
    reloads = gw.gateway.metrics.config_reloads
    doc = fleet([upstream], watch_config=True)
    doc["models"][0]["aliases"] = ["default", "renamed"]
    text = yaml.safe_dump(doc)
    cut = text.index("upstreams:") + 4  # the first half is not a valid models.yaml
    await next_poll()
    with gw.path.open("w") as file:
        file.write(text[:cut])
        file.flush()
        await next_poll()  # the watcher has seen the half-written file
        file.write(text[cut:])
    await wait_for(lambda: gw.gateway.router.resolve("renamed") is not None, timeout=3.0)
    for _ in range(3):
        await next_poll()
    assert reloads.labels("applied")._value.get() == 1
    assert reloads.labels("rejected")._value.get() == 0
