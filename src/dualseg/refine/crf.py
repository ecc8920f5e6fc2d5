"""Dense CRF (Krähenbühl & Koltun 2011) on a base model's probabilities: the baseline that method B
is compared with."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dualseg.engine.evaluation import evaluate
from dualseg.errors import ConfigError, DualsegError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.models.base import class_labels
from dualseg.refine.calibrate import net_fixed
from dualseg.refine.decision import are_probabilities

__all__ = ["CRF_GRID", "CRFSettings", "choose_crf", "dense_crf", "import_pydensecrf"]


def import_pydensecrf() -> ModuleType:
    """``pydensecrf.densecrf``, or one :class:`DualsegError` line saying how to install it."""
    try:
        import pydensecrf.densecrf as dcrf
    except ImportError:
        raise DualsegError(
            "dense CRF needs pydensecrf2, which is not installed: pip install 'dualseg[crf]'"
        ) from None
    return dcrf


@dataclass(frozen=True)
class CRFSettings:
    """Kernel settings of the dense CRF (the defaults: DeepLab's, common for street scenes)."""

    iterations: int = 5
    sxy_gaussian: float = 3
    compat_gaussian: float = 3
    sxy_bilateral: float = 80
    srgb_bilateral: float = 13
    compat_bilateral: float = 10

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ConfigError(f"CRF setting {name} must be > 0, got {value}")

    def describe(self) -> str:
        """One line for a table: the bilateral kernel, which is what the grid varies."""
        return (
            f"bilateral sxy {self.sxy_bilateral:g}, srgb {self.srgb_bilateral:g}, "
            f"compat {self.compat_bilateral:g}; {self.iterations} iterations"
        )

    @torch.no_grad()
    def refine(
        self, images: Tensor, probs: Tensor, return_changed: bool = True
    ) -> tuple[Tensor, Tensor]:
        """As a method-B refiner for :func:`~dualseg.engine.evaluation.evaluate` (``probs``:
        probabilities or logits)."""
        rgb = images.detach().float().cpu() * torch.tensor(IMAGENET_STD)[:, None, None]
        rgb = rgb + torch.tensor(IMAGENET_MEAN)[:, None, None]
        rgb = (rgb * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        probs = probs if are_probabilities(probs) else probs.softmax(1)
        p = probs.detach().float().cpu().numpy()
        labels = [torch.from_numpy(dense_crf(im, pr, self).argmax(0)) for im, pr in zip(rgb, p)]
        labels = torch.stack(labels).to(probs.device)
        return labels, labels != class_labels(probs)


def dense_crf(
    image_uint8_hwc: np.ndarray, probs_chw: np.ndarray, settings: CRFSettings = CRFSettings()
) -> np.ndarray:
    """The CRF's refined probabilities, float32 ``[C,H,W]`` (``argmax(0)``: labels), of an RGB
    ``[H,W,3]`` uint8 image and the base model's softmax ``[C,H,W]`` (unary ``-log p``)."""
    dcrf, s = import_pydensecrf(), settings
    c, h, w = probs_chw.shape
    unary = -np.log(np.clip(probs_chw, 1e-8, 1.0)).reshape(c, -1)
    crf = dcrf.DenseCRF2D(w, h, c)
    crf.setUnaryEnergy(np.ascontiguousarray(unary, dtype=np.float32))
    crf.addPairwiseGaussian(sxy=s.sxy_gaussian, compat=s.compat_gaussian)
    image = np.ascontiguousarray(image_uint8_hwc)
    crf.addPairwiseBilateral(
        sxy=s.sxy_bilateral, srgb=s.srgb_bilateral, rgbim=image, compat=s.compat_bilateral
    )
    q = np.asarray(crf.inference(int(s.iterations)), dtype=np.float32)
    return q.reshape(c, h, w)


# What choose_crf picks among: the default, and a narrower / weaker / wider bilateral kernel
CRF_GRID: tuple[CRFSettings, ...] = (
    CRFSettings(),
    CRFSettings(sxy_bilateral=50, srgb_bilateral=5, compat_bilateral=5),
    CRFSettings(sxy_bilateral=80, srgb_bilateral=13, compat_bilateral=4),
    CRFSettings(sxy_bilateral=120, srgb_bilateral=20, compat_bilateral=10),
)


def choose_crf(
    model: nn.Module, loader: Iterable[tuple[Tensor, Tensor]], *, num_classes: int,
    device: torch.device, grid: Sequence[CRFSettings] = CRF_GRID, metric: str = "miou",
) -> tuple[CRFSettings, list[dict[str, Any]]]:  # fmt: skip
    """The setting of ``grid`` whose CRF scores best in ``metric`` (one of method B's
    ``METRICS``) on ``loader``'s (dev) images, and every setting's scores."""
    rows = []
    for settings in grid:
        m = evaluate(model, loader, num_classes=num_classes, device=device, refiner=settings)
        rows.append({
            "settings": asdict(settings),
            **{k: m["refined"][k] for k in ("miou", "boundary_f1", "trimap_miou")},
            **{"base_" + k: m[k] for k in ("miou", "boundary_f1")},
            **{k: m["refine"][k] for k in ("fixed", "broke")},
            "net_fixed": net_fixed(m["refine"]["fixed"], m["refine"]["broke"]),
        })  # fmt: skip
    best = max(range(len(grid)), key=lambda i: rows[i][metric])  # the first of equals
    return grid[best], rows
