"""models.yaml as a whole: a full example, every problem reported with file and key path,
unreadable files and YAML errors, the top level's own rules."""

from __future__ import annotations

from gateway.config import ConfigError, load_config, parse_config
from tests.gateway.config.documents import EXTERNAL, document, problems, problems_of, write


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


def test_yaml_syntax_error_has_line(tmp_path):
    found = problems(tmp_path, "models:\n  - name: a\n   bad: [\n")
    assert len(found) == 1 and "line " in found[0] and "invalid YAML" in found[0]


def test_parse_config_defaults():
    config = parse_config({"models": [{"name": "x", "upstreams": ["http://127.0.0.1:9"]}]})
    assert config.gateway.host == "127.0.0.1" and config.gateway.port == 8000
    assert config.gateway.auth.open_mode
    assert config.models[0].health_path == "/ready"


def test_an_unreadable_file_is_one_problem(tmp_path):
    missing = tmp_path / "absent.yaml"
    try:
        load_config(missing)
    except ConfigError as exc:
        assert exc.problems == [f"{missing}: cannot read: No such file or directory"]
    else:
        raise AssertionError("no ConfigError")


def test_models_must_be_a_non_empty_list():
    expected = "models.yaml: models: must be a non-empty list of models"
    assert problems_of({}) == [expected]
    assert problems_of(document([])) == [expected]
    assert problems_of({"models": EXTERNAL}) == [expected]


def test_the_document_must_be_a_mapping():
    assert problems_of([EXTERNAL]) == [
        "models.yaml: (top level): must be a mapping, got list",
        "models.yaml: models: must be a non-empty list of models",
    ]


def test_unknown_top_level_keys_are_errors():
    assert problems_of(document(modles=[])) == ["models.yaml: modles: unknown key"]


def test_a_valid_document_parses_with_its_file_name():
    assert parse_config(document(), "fleet.yaml").path == "fleet.yaml"
