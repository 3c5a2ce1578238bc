"""engine.model.cpu.gguf_file reads a GGUF's header as gguf's own GGUFReader does: the same
scalar and string metadata, the same tensor directory and data, with arrays skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from engine.model.cpu.gguf_file import GgufFile
from tests.conftest import GEMMA_GGUF, SMOLLM2_GGUF


@pytest.mark.parametrize("path", [SMOLLM2_GGUF, GEMMA_GGUF], ids=["smollm2", "gemma3"])
def test_header_matches_ggufs_reader(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.name} not fetched")
    ours, reference = GgufFile(path), GGUFReader(path)
    expected = {
        name: field.contents()
        for name, field in reference.fields.items()
        if field.types and field.types[0] != GGUFValueType.ARRAY and not name.startswith("GGUF.")
    }
    assert ours.fields == expected
    assert any(f.types[:1] == [GGUFValueType.ARRAY] for f in reference.fields.values())  # skipped
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for tensor in reference.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.tensor_type == tensor.tensor_type
        assert mine.shape == tuple(int(d) for d in tensor.shape)
        assert np.array_equal(
            mine.data.reshape(-1).view(np.uint8), tensor.data.reshape(-1).view(np.uint8)
        )


def test_a_file_cut_inside_its_vocabulary_is_refused(tmp_path: Path) -> None:
    if not SMOLLM2_GGUF.exists():
        pytest.skip(f"{SMOLLM2_GGUF.name} not fetched")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(SMOLLM2_GGUF.read_bytes()[:200_000])  # the 49,152 tokens run past this
    with pytest.raises(ValueError, match="ends inside its header"):
        GgufFile(cut)
