"""The embedding read at a pixel is the embedding of that pixel, whatever the image size: the
refiner's own pass pads its (resized) input to a multiple of the stride, as the base models do,
and samples the map over the size it spans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dualseg.refine.embedding import EmbeddingNet, embed_features, embedding_cover


def coordinate_probe(stride: int) -> EmbeddingNet:
    """A 'network' whose stride-``stride`` feature cell holds the mean row and column of the
    input pixels it pools: on an input holding each pixel's own coordinates, a correctly
    placed read at pixel (y, x) gives back (y, x)."""
    return EmbeddingNet(nn.AvgPool2d(stride, stride, ceil_mode=True), nn.Identity(), 2).eval()


@pytest.mark.parametrize("size", [(360, 480), (200, 120), (64, 64)])
@pytest.mark.parametrize("input_scale", [1.0, 0.5])
def test_own_pass_reads_each_pixel_where_it_is(size: tuple[int, int], input_scale: float) -> None:
    stride = 16
    H, W = size
    ys, xs = torch.meshgrid(torch.arange(float(H)), torch.arange(float(W)), indexing="ij")
    image = torch.stack([ys, xs])[None]  # [1,2,H,W]: every pixel its own coordinates
    feats = embed_features(coordinate_probe(stride), image, input_scale, stride)
    covered = embedding_cover((H, W), input_scale, stride)
    # pixels between the centres of the first and of the last unpadded cells: a linear ramp
    # there, so bilinear reads are exact (the padding's zeros only reach beyond)
    cell = stride / input_scale  # one feature cell, in image pixels
    full_h, full_w = (int(n * input_scale) // stride for n in (H, W))
    mask = torch.zeros(1, H, W, dtype=torch.bool)
    mask[
        0, int(cell / 2) : int((full_h - 0.5) * cell), int(cell / 2) : int((full_w - 0.5) * cell)
    ] = 1
    assert mask.sum() >= 0.25 * H * W  # most of the image
    read = EmbeddingNet.sample(feats, mask, covered)  # [M,2]
    where = mask.nonzero()[:, 1:].float()
    torch.testing.assert_close(read, where, atol=0.3, rtol=0)


@pytest.mark.parametrize("input_scale", [1.0, 0.5])
def test_a_static_export_is_read_where_each_pixel_is(input_scale: float) -> None:
    """A static ONNX export resizes every image to its own size first (the runner does); the
    exported refiner then samples the span of that size, scaled back to the image."""
    from dualseg.export.export import ExportWrapper
    from dualseg.export.exported_refiner import runner_span
    from dualseg.export.runners import _resize_chw_batch

    stride, static = 16, (256, 320)
    wrapper = ExportWrapper(
        coordinate_probe(stride), pad_multiple=stride, output="features",
        input_scale=input_scale,
    )  # fmt: skip

    class StaticRunner:  # what OnnxRunner does for a static export, with the probe inside
        static_hw = static

        def __call__(self, x):
            with torch.no_grad():
                return wrapper(torch.from_numpy(_resize_chw_batch(x, static))).numpy()

    H, W = 360, 480
    ys, xs = torch.meshgrid(torch.arange(float(H)), torch.arange(float(W)), indexing="ij")
    image = torch.stack([ys, xs])[None]
    feats = torch.from_numpy(StaticRunner()(image.numpy()))
    covered = runner_span(StaticRunner(), (H, W), input_scale, stride)
    mask = torch.zeros(1, H, W, dtype=torch.bool)
    mask[0, 40:300, 40:420] = True  # inside the first and last full cells' centres
    read = EmbeddingNet.sample(feats, mask, covered)  # the resized image keeps the coordinates
    torch.testing.assert_close(read, mask.nonzero()[:, 1:].float(), atol=0.5, rtol=0)
