"""engine.model.cpu.gguf_file reads a GGUF's header as gguf's own GGUFReader does: the same
scalar and string metadata, arrays (of strings only when asked), the same tensor directory and
data."""

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
    metadata = {n: f for n, f in reference.fields.items() if not n.startswith("GGUF.")}
    assert ours.types == {name: [int(t) for t in field.types] for name, field in metadata.items()}
    expected = {n: f.contents() for n, f in metadata.items() if f.types[0] != GGUFValueType.ARRAY}
    assert ours.fields == expected
    with_strings = GgufFile(path, read_strings=True)
    for name, field in metadata.items():
        if field.types[0] == GGUFValueType.ARRAY:
            values = field.contents()
            assert ours.arrays[name].count == with_strings.arrays[name].count == len(values)
            if field.types[1] == GGUFValueType.STRING:
                assert ours.arrays[name].values is None, name  # skipped by their lengths
            else:
                assert ours.arrays[name].values.tolist() == values, name  # type: ignore[union-attr]
            assert list(with_strings.arrays[name].values) == values, name  # type: ignore[arg-type]
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
