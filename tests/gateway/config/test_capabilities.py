"""``capabilities`` of a model: an external upstream may lack tools or structured outputs; local
engines support every feature, and the key is theirs to leave out."""

from __future__ import annotations

from pathlib import Path

from gateway.config import Capabilities
from tests.gateway.config.documents import EXTERNAL, document, parsed, problems_of


def _one_problem(model: dict, base_dir: Path | None = None) -> str:
    found = problems_of(document([model]), base_dir)
    assert len(found) == 1, found
    return found[0]


def test_every_feature_is_supported_by_default(tmp_path):
    assert parsed(document([EXTERNAL])).models[0].capabilities == Capabilities(True, True)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    local = parsed(document([{"name": "l", "source": "m.gguf"}]), tmp_path).models[0]
    assert local.capabilities == Capabilities(tools=True, structured_outputs=True)


def test_an_external_model_may_lack_features():
    model = {**EXTERNAL, "capabilities": {"tools": False, "structured_outputs": False}}
    assert parsed(document([model])).models[0].capabilities == Capabilities(False, False)
    only_tools = {**EXTERNAL, "capabilities": {"tools": False}}
    assert parsed(document([only_tools])).models[0].capabilities == Capabilities(False, True)


def test_a_local_model_may_not_set_capabilities(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    model = {"name": "l", "source": "m.gguf", "capabilities": {"tools": False}}
    assert _one_problem(model, tmp_path) == (
        "models.yaml: models[0].capabilities: only applies to external models (with "
        "`upstreams`): local engines support every feature"
    )


def test_an_unknown_feature_is_an_error():
    model = {**EXTERNAL, "capabilities": {"tool": False}}
    assert _one_problem(model) == "models.yaml: models[0].capabilities.tool: unknown key"


def test_a_feature_is_true_or_false():
    model = {**EXTERNAL, "capabilities": {"tools": "no"}}
    assert _one_problem(model) == (
        "models.yaml: models[0].capabilities.tools: must be true or false, got 'no'"
    )


def test_capabilities_is_a_mapping():
    model = {**EXTERNAL, "capabilities": ["tools"]}
    assert _one_problem(model) == "models.yaml: models[0].capabilities: must be a mapping, got list"
