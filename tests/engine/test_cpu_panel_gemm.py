"""The C panel GEMM (fp32 linears of decode-sized batches) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu.kernels import panel_gemm
from engine.model.cpu.linear import PrepackedLinear, StepGemms, prepack_linears, prepack_supported

pytestmark = [
    pytest.mark.skipif(
        panel_gemm.pack(torch.zeros(1, 1)) is None, reason="no C compiler, or no AVX-512 or AVX2"
    ),
    pytest.mark.skipif(
        not prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
    ),
]


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 9, 13, 64, 128])  # every remainder mod 6
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (63, 17), (130, 33), (960, 576)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_gemm_matches_f_linear(rows, out_features, in_features, bias, threads):
    """Ragged row groups (6 at a time), panels cut short by out_features, odd K, bias or not."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(rows, in_features, generator=generator)
    out = panel_gemm.linear(x, panel_gemm.pack(weight), out_features, b, threads)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("half", [1, 17, 32, 40, 96])  # gate/up halves cut short in a panel
@pytest.mark.parametrize("bias", [True, False])
def test_paired_panels_give_both_halves_or_the_activation(rows, half, bias):
    """A [gate; up] weight packed paired: the plain output equals F.linear, the gated one
    silu(gate) * up of it, both on ragged halves."""
    generator = torch.Generator().manual_seed(rows * 100 + half)
    weight = torch.randn(2 * half, 33, generator=generator)
    b = torch.randn(2 * half, generator=generator) if bias else None
    x = torch.randn(rows, 33, generator=generator)
    check_paired(x, panel_gemm.pack(weight, paired=True), weight, b)


def check_paired(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None
) -> None:
    """The paired panels' plain output is F.linear's, the gated one silu(gate) * up of it."""
    half = weight.shape[0] // 2
    reference = F.linear(x, weight, b)
    plain = panel_gemm.linear(x, packed, 2 * half, b, 2, paired=True)
    torch.testing.assert_close(plain, reference, rtol=1e-4, atol=1e-4)
    gated = panel_gemm.linear(x, packed, 2 * half, b, 2, paired=True, gated=True)
    expected = F.silu(reference[:, :half]) * reference[:, half:]
    torch.testing.assert_close(gated, expected, rtol=1e-4, atol=1e-4)


def test_paired_needs_an_even_weight_and_gated_a_paired_one():
    with pytest.raises(ValueError, match="even"):
        panel_gemm.pack(torch.zeros(5, 4), paired=True)
    with pytest.raises(ValueError, match="paired"):
        panel_gemm.linear(torch.zeros(1, 4), panel_gemm.pack(torch.zeros(4, 4)), 4, None, 1,
                          gated=True)  # fmt: skip


def test_pack_declines_what_it_does_not_run():
    assert panel_gemm.pack(torch.zeros(4, 4, dtype=torch.bfloat16)) is None
    assert panel_gemm.pack(torch.zeros(4, 4, dtype=torch.float64)) is None


@pytest.mark.parametrize("rows", [1, 33, panel_gemm.MAX_ROWS, panel_gemm.MAX_ROWS + 1])
def test_prepacked_linear_takes_panels_for_decode_sized_batches(rows, monkeypatch):
    """Up to MAX_ROWS rows the panel GEMM answers, above it oneDNN; both equal F.linear, and no
    plain copy is kept beside the panels."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    packed = PrepackedLinear(linear.weight, linear.bias, batch_size_hint=16)
    assert packed.panel_weight is not None and packed.plain_weight is None
    calls = []
    real = panel_gemm.linear
    monkeypatch.setattr(panel_gemm, "linear", lambda *a, **k: calls.append(a) or real(*a, **k))
    x = torch.randn(rows, 96)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))
    assert len(calls) == (1 if rows <= panel_gemm.MAX_ROWS else 0)


def test_step_gemms_reuse_one_output_per_width():
    """Each linear equals F.linear; a second linear of the same width writes the same buffer (the
    lean forward consumes each output before that), another width its own."""
    torch.manual_seed(0)
    up, down, up2 = (torch.nn.Linear(96, 160), torch.nn.Linear(160, 96), torch.nn.Linear(96, 160))
    packed = {m: PrepackedLinear(m.weight, m.bias, batch_size_hint=16) for m in (up, down, up2)}
    gemms = StepGemms(rows=5, threads=2)
    x = torch.randn(5, 96)
    with torch.no_grad():
        first = gemms(packed[up], x)
        torch.testing.assert_close(first, F.linear(x, up.weight, up.bias))
        second = gemms(packed[down], first)
        torch.testing.assert_close(second, F.linear(first, down.weight, down.bias))
        third = gemms(packed[up2], x)
        assert third.data_ptr() == first.data_ptr() != second.data_ptr()
        torch.testing.assert_close(third, F.linear(x, up2.weight, up2.bias))


def test_step_gemms_fall_back_to_the_module():
    """Too many rows, a non-contiguous input, another row count than the pass's or a linear
    without panels: the module's own call, a fresh tensor each time."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    packed = PrepackedLinear(linear.weight, linear.bias, batch_size_hint=16)
    rows = panel_gemm.MAX_ROWS + 1
    big = torch.randn(rows, 96)
    strided = torch.randn(96, 4).t()  # [4, 96], not contiguous
    with torch.no_grad():
        for gemms, module, x in (
            (StepGemms(rows=rows, threads=2), packed, big),
            (StepGemms(rows=4, threads=2), packed, strided),
            (StepGemms(rows=4, threads=2), packed, torch.randn(3, 96)),  # other row count
            (StepGemms(rows=4, threads=2), linear, strided.contiguous()),
        ):
            out = gemms(module, x)
            assert out.data_ptr() != gemms(module, x).data_ptr()
            torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias))


def test_step_gemms_apply_the_activation_in_the_gemm_of_a_fused_mlp():
    """A model's gate/up projections fuse into one paired GEMM; StepGemms.silu_mul answers
    silu(gate) * up from it without calling the fallback activation, and the fused members still
    answer their own halves; a linear without pairing goes through the activation."""
    torch.manual_seed(0)
    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(96, 80), torch.nn.Linear(96, 80)
    gate, up = mlp.gate_proj, mlp.up_proj
    assert prepack_linears(mlp, batch_size_hint=16) == 1
    fused = mlp.fused_gate_up.gemm
    assert fused.paired
    x = torch.randn(7, 96)
    expected = F.silu(F.linear(x, gate.weight, gate.bias)) * F.linear(x, up.weight, up.bias)
    activated = []

    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        activated.append(gate_up)
        return F.silu(gate_up[:, :80]) * gate_up[:, 80:]

    gemms = StepGemms(rows=7, threads=2)
    with torch.no_grad():
        torch.testing.assert_close(gemms.silu_mul(fused, x, activation), expected)
        assert not activated
        torch.testing.assert_close(mlp.gate_proj(x), F.linear(x, gate.weight, gate.bias))
        torch.testing.assert_close(mlp.up_proj(x), F.linear(x, up.weight, up.bias))
        plain = PrepackedLinear(torch.cat([gate.weight, up.weight]), None, batch_size_hint=16)
        assert not plain.paired
        gemms.silu_mul(plain, x, activation)
        assert len(activated) == 1
