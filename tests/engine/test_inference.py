"""infer_logits: whole vs sliding window (logits averaged in overlaps), TTA (probabilities
averaged), edge cases of the tiling, invalid options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dualseg.engine.inference import infer_logits, slide_tiles
from dualseg.errors import ConfigError

C = 5


def _pointwise() -> nn.Module:
    """A 1x1-conv model: translation-equivariant, so tiles cannot change its output."""
    torch.manual_seed(0)
    return nn.Conv2d(3, C, 1).eval()


def _contextual() -> nn.Module:
    """A model whose output depends on the image border (zero padding, 5x5 receptive field)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, C, 3, padding=1))


class TileMean(nn.Module):
    """Constant logits per tile: the mean of the tile's channel 0; records each input shape."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        m = x[:, :1].mean((2, 3), keepdim=True)
        return m.expand(-1, C, x.shape[2] // 4, x.shape[3] // 4)  # low-res, as real networks


@torch.no_grad()
def test_slide_equals_whole_for_a_translation_equivariant_model() -> None:
    model = _pointwise()
    x = torch.randn(2, 3, 48, 48)  # 3x the window
    whole = infer_logits(model, x)
    slide = infer_logits(model, x, mode="slide", window=(16, 16), stride=(10, 10))
    assert slide.shape == whole.shape == (2, C, 48, 48)
    torch.testing.assert_close(slide, whole, rtol=1e-5, atol=1e-5)
    # the default stride (2/3 of the window) and a non-square window agree too
    torch.testing.assert_close(
        infer_logits(model, x, mode="slide", window=(16, 24)), whole, rtol=1e-5, atol=1e-5
    )


@torch.no_grad()
def test_slide_differs_from_whole_when_the_model_sees_context() -> None:
    x = torch.randn(1, 3, 48, 48)
    model = _contextual()
    whole = infer_logits(model, x)
    slide = infer_logits(model, x, mode="slide", window=(16, 16), stride=(8, 8))
    assert not torch.allclose(slide, whole, atol=1e-3)  # tiles really ran on crops
    # ... but where only the first tile covers a pixel, >= 2 px (the receptive radius) from
    # its inner borders, that tile saw what the whole image shows there
    torch.testing.assert_close(slide[..., :6, :6], whole[..., :6, :6])


def test_tiles_cover_the_image_when_the_stride_does_not_divide_it() -> None:
    ys, xs, tile = slide_tiles((50, 37), (16, 16), (10, 10))
    assert tile == (16, 16)
    assert ys == [0, 10, 20, 30, 34] and xs == [0, 10, 20, 21]  # last tile ends at the border
    covered = torch.zeros(50, 37)
    for y in ys:
        for x in xs:
            covered[y : y + 16, x : x + 16] += 1
    assert covered.min() >= 1


@torch.no_grad()
def test_overlapping_tiles_are_averaged() -> None:
    model = TileMean()
    x = torch.randn(1, 3, 26, 20)
    out = infer_logits(model, x, mode="slide", window=(16, 16), stride=(10, 10))
    ys, xs, (th, tw) = slide_tiles((26, 20), (16, 16), (10, 10))
    assert sum(s[0] for s in model.shapes) == len(ys) * len(xs) == 4  # tiles, batched
    assert all(s[-2:] == (16, 16) for s in model.shapes)  # every tile has the window's size
    total, count = torch.zeros(26, 20), torch.zeros(26, 20)
    for y in ys:
        for x0 in xs:
            total[y : y + th, x0 : x0 + tw] += x[0, 0, y : y + th, x0 : x0 + tw].mean()
            count[y : y + th, x0 : x0 + tw] += 1
    torch.testing.assert_close(out[0, 0], total / count)


@torch.no_grad()
def test_image_smaller_than_the_window_is_one_tile() -> None:
    model = _contextual()
    x = torch.randn(2, 3, 20, 30)
    whole = infer_logits(model, x)
    torch.testing.assert_close(infer_logits(model, x, mode="slide", window=(64, 64)), whole)
    # smaller in one dimension only: tiles span the full height
    counting = TileMean()
    infer_logits(counting, x, mode="slide", window=(64, 16), stride=(64, 8), tile_batch=1)
    assert {s[-2:] for s in counting.shapes} == {(20, 16)}
    assert len(counting.shapes) == 2 * 3  # 2 images x columns 0, 8, 14


@torch.no_grad()
def test_tile_batch_does_not_change_the_result() -> None:
    model = _contextual()
    x = torch.randn(3, 3, 40, 40)
    a = infer_logits(model, x, mode="slide", window=(16, 16), stride=(12, 12), tile_batch=1)
    b = infer_logits(model, x, mode="slide", window=(16, 16), stride=(12, 12), tile_batch=7)
    torch.testing.assert_close(a, b)


@torch.no_grad()
def test_without_tta_the_model_logits_are_returned_untouched() -> None:
    model = _contextual()
    x = torch.randn(1, 3, 24, 24)
    assert torch.equal(infer_logits(model, x), model(x))


@torch.no_grad()
def test_tta_averages_probabilities_of_flipped_and_rescaled_images() -> None:
    model = _contextual()
    x = torch.randn(1, 3, 32, 40)
    out = infer_logits(model, x, tta_scales=(0.5, 1.0), tta_flip=True)
    assert out.shape == (1, C, 32, 40)
    small = F.interpolate(x, size=(16, 20), mode="bilinear", align_corners=False)

    def up(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(32, 40), mode="bilinear", align_corners=False)

    variants = [
        up(model(small)),
        up(model(small.flip(-1)).flip(-1)),
        model(x),
        model(x.flip(-1)).flip(-1),
    ]
    mean_probs = torch.stack([v.softmax(1) for v in variants]).mean(0)
    torch.testing.assert_close(out.softmax(1), mean_probs)
    # probabilities, not logits, are averaged (mmseg's convention)
    mean_logits = torch.stack(variants).mean(0)
    assert not torch.allclose(out.softmax(1), mean_logits.softmax(1), atol=1e-4)


@torch.no_grad()
def test_flip_tta_is_a_no_op_for_a_pointwise_model_and_composes_with_slide() -> None:
    model = _pointwise()
    x = torch.randn(1, 3, 48, 48)
    plain = infer_logits(model, x).softmax(1)
    both = infer_logits(model, x, mode="slide", window=(16, 16), tta_flip=True)
    torch.testing.assert_close(both.softmax(1), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "tiles"}, "whole | slide"),
        ({"mode": "slide", "window": (16, 16), "stride": (20, 8)}, "larger than --window"),
        ({"mode": "slide", "window": (0, 16)}, "--window"),
        ({"tta_scales": (1.0, 0.0)}, "--tta-scales"),
        ({"tile_batch": 0}, "--tile-batch"),
    ],
)
def test_invalid_options_are_one_line_config_errors(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        infer_logits(_pointwise(), torch.zeros(1, 3, 8, 8), **options)


def test_options_that_would_go_unused_or_be_cut_are_refused() -> None:
    """The Python API ran window=(32, 32) in whole mode as if it were not there, cut 8.7 to 8
    and took batch_size 0."""
    import numpy as np

    from dualseg.engine.inference import InferenceOptions, infer_logits
    from dualseg.errors import ConfigError
    from dualseg.predictor import size_batches

    with pytest.raises(ConfigError, match="add mode='slide'"):
        InferenceOptions(window=(32, 32))
    with pytest.raises(ConfigError, match="add mode='slide'"):
        InferenceOptions(stride=(16, 16))
    InferenceOptions(mode="slide", window=(32, 32), stride=(16, 16))
    model = torch.nn.Conv2d(3, 2, 1)
    x = torch.zeros(1, 3, 8, 8)
    with pytest.raises(ConfigError, match=r"window \(--window\) needs two positive integers"):
        infer_logits(model, x, mode="slide", window=(8.7, 8.7))
    # numpy integers are integers; a bare factor, a fractional tile batch: one line each
    whole = infer_logits(model, x, mode="slide", window=(8, 8))
    sliced = infer_logits(model, x, mode="slide", window=np.array([8, 8]), tile_batch=np.int64(2))
    torch.testing.assert_close(sliced, whole)
    with pytest.raises(ConfigError, match=r"sequence of factors.*got 1\.25; one factor"):
        infer_logits(model, x, tta_scales=1.25)
    # any sequence of factors: a tensor or array of them averages as the tuple does
    scaled = infer_logits(model, x, tta_scales=(1.0, 0.5))
    for scales in (torch.tensor([1.0, 0.5]), np.array([1.0, 0.5]), [1, 0.5]):
        torch.testing.assert_close(infer_logits(model, x, tta_scales=scales), scaled)
    with pytest.raises(ConfigError, match=r"tile_batch \(--tile-batch\) must be an int >= 1"):
        infer_logits(model, x, mode="slide", window=(8, 8), tile_batch=2.7)
    arrays = [np.zeros((4, 4, 3), np.uint8)]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="batch_size must be an int >= 1"):
            list(size_batches(arrays, bad))
    assert list(size_batches(arrays, 2)) == [[0]]
