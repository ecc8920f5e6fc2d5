"""ReNetLayer (claim 2, S31): folded sweeps equal a per-row / per-column loop; both directions
are used; GRU initialization U(-1/√H, 1/√H)."""

from __future__ import annotations

import math

import pytest
import torch

from dualseg.models import ReNetLayer


def slow_reference(layer: ReNetLayer, x: torch.Tensor) -> torch.Tensor:
    """One GRU call per row, then one per column: the definition, written as loops."""
    b, _, h, w = x.shape
    rows = torch.zeros(b, h, w, 2 * layer.hidden)
    for n in range(b):
        for r in range(h):
            seq = x[n, :, r, :].T.unsqueeze(1)  # [W, 1, C]
            rows[n, r] = layer.rows(seq)[0][:, 0]
    out = torch.zeros(b, 2 * layer.hidden, h, w)
    for n in range(b):
        for c in range(w):
            seq = rows[n, :, c, :].unsqueeze(1)  # [H, 1, 2h]
            out[n, :, :, c] = layer.cols(seq)[0][:, 0].T
    return out


@torch.no_grad()
def test_matches_slow_per_row_per_column_loop() -> None:
    layer = ReNetLayer(5, hidden=150).eval()
    x = torch.randn(2, 5, 4, 6)
    out = layer(x)
    assert out.shape == (2, 300, 4, 6)
    assert torch.allclose(out, slow_reference(layer, x), atol=1e-5)


@torch.no_grad()
def test_flipping_the_input_swaps_the_row_sweep_directions() -> None:
    layer = ReNetLayer(3, hidden=8)
    # Same weights for both directions: then the backward half on x must equal the forward half
    # on the mirrored input, mirrored back. This holds only if the reverse GRU really runs
    # right-to-left.
    for name, p in layer.rows.named_parameters():
        if name.endswith("_reverse"):
            p.copy_(getattr(layer.rows, name.removesuffix("_reverse")))
    x = torch.randn(2, 3, 4, 7)
    rows = layer.sweep_rows(x)  # [B, H, W, 16]
    mirrored = layer.sweep_rows(x.flip(-1)).flip(2)
    assert torch.allclose(mirrored[..., :8], rows[..., 8:], atol=1e-6)
    assert torch.allclose(mirrored[..., 8:], rows[..., :8], atol=1e-6)
    assert not torch.allclose(rows[..., :8], rows[..., 8:], atol=1e-3)


@torch.no_grad()
def test_each_direction_sees_only_its_side() -> None:
    layer = ReNetLayer(3, hidden=8)
    x = torch.randn(1, 3, 4, 6)
    y = x.clone()
    y[..., -1] += 1.0  # change only the last column
    a, b = layer.sweep_rows(x), layer.sweep_rows(y)
    assert torch.equal(a[:, :, 0, :8], b[:, :, 0, :8])  # left→right at column 0: unaffected
    assert not torch.allclose(a[:, :, 0, 8:], b[:, :, 0, 8:])  # right→left: reached column 0
    z = x.clone()
    z[..., -1, :] += 1.0  # change only the last row: reaches row 0 through the column sweep
    assert not torch.allclose(layer(x)[:, :, 0], layer(z)[:, :, 0])


def test_gru_initialization_range() -> None:
    layer = ReNetLayer(323)  # spec: 150 units
    bound = 1 / math.sqrt(150)
    params = list(layer.parameters())
    assert len(params) == 16  # 2 GRUs × 2 directions × (w_ih, w_hh, b_ih, b_hh)
    for p in params:
        assert p.abs().max().item() <= bound
        assert p.abs().max().item() > 0.9 * bound  # uniform over the whole range, not narrower


def test_patch_reading_keeps_resolution() -> None:
    layer = ReNetLayer(4, hidden=6, patch=2)
    assert layer(torch.randn(1, 4, 5, 7)).shape == (1, 12, 5, 7)


def test_init_readings_standard_uniform_and_bound() -> None:
    standard = ReNetLayer(3, hidden=4, init="standard")
    for p in standard.parameters():
        assert p.min().item() >= 0.0 and p.max().item() <= 1.0 and p.max().item() > 0.5
    bounded = ReNetLayer(3, hidden=4, init_bound=0.05)
    for p in bounded.parameters():
        assert p.abs().max().item() <= 0.05
    with pytest.raises(ValueError, match="init"):
        ReNetLayer(3, hidden=4, init="gaussian")
    with pytest.raises(ValueError, match="init_bound"):
        ReNetLayer(3, hidden=4, init="standard", init_bound=0.1)
