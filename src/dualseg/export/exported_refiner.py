"""``ExportedRefiner``: method B from an exported embedding model plus its JSON sidecar; the
embedding runs in onnxruntime (or TorchScript), P2-P5 are ``BoundaryRefiner``'s own code."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualseg.errors import CheckpointError, ConfigError, DataError, DualsegError
from dualseg.export.runners import (
    REFINER_FORMAT,
    Runner,
    _as_rgb,
    read_export_info,
    refiner_sidecar_path,
)
from dualseg.imaging import normalize
from dualseg.refine.calibrate import calibration_note
from dualseg.refine.config import RefinerConfig
from dualseg.refine.decision import prototype_scale
from dualseg.refine.embedding import embedding_cover, p1_filter
from dualseg.refine.formats import stored_description
from dualseg.refine.inputs import check_classes, check_normalized_batch
from dualseg.refine.relabel import prototype_scores, relabel
from dualseg.refine.shared import SharedFeatures


class ExportedRefiner:
    """Method B from an exported embedding model + sidecar, with ``BoundaryRefiner.refine``'s
    contract and P2-P5 code; the embedding is computed by ``runner``."""

    def __init__(self, runner: Runner, sidecar: Mapping[str, Any], *, source: str = "") -> None:
        self.runner, self.source = runner, source
        described = stored_description(sidecar, source)
        self.class_names = tuple(described["class_names"])
        try:  # a RefinerConfig, so that dataclasses.replace overrides work as for BoundaryRefiner
            self.config = RefinerConfig.from_dict(sidecar.get("config"))
        except ConfigError as err:
            raise CheckpointError(f"{source}: {err}; re-export the refiner") from None
        self.ignore_index = described["ignore_index"]
        self.palette = described["palette"]
        self.calibration = described["calibration"]
        self.label_contract = described["label_contract"]
        self.prototypes = np.asarray(sidecar["prototypes"], np.float32)
        self.present = np.asarray(sidecar["present"], bool)
        if len(self.prototypes) != self.num_classes or self.present.shape != (
            len(self.prototypes),
        ):
            raise CheckpointError(
                f"{source}: {len(self.prototypes)} prototypes for "
                f"{self.num_classes} classes; re-export the refiner"
            )

    def calibration_note(self) -> str | None:
        """As :meth:`BoundaryRefiner.calibration_note`."""
        return calibration_note(self.calibration, self.config)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __repr__(self) -> str:
        return (
            f"ExportedRefiner({self.source}: {self.num_classes} classes, "
            f"top_n={self.config.top_n}, radius={self.config.radius})"
        )

    def check_classes(
        self, base_names: Sequence[str] | None, num_classes: int, *, what: str = "the base model"
    ) -> None:
        """Raise :class:`CheckpointError` when the base model's classes are not the refiner's."""
        check_classes(self.class_names, base_names, num_classes, what=what)

    def shared_features(self, model: Any) -> Any:
        """A context that shares nothing: the exported model runs its own backbone."""
        return SharedFeatures(model, active=False)

    def refine(
        self, images: Any, probs: Any, *, return_changed: bool = False, features: Any = None
    ) -> Any:
        """Refined labels, as ``BoundaryRefiner.refine``.

        Batch form: normalized ``[B,3,H,W]`` images and ``[B,C,H,W]`` probabilities (numpy or
        tensors; tensors out when ``probs`` is one). Single-image form: a uint8 ``HxWx3`` image
        (or path, PIL image) and ``[C,H,W]`` probabilities -> numpy ``HxW``.
        """
        if features is not None:
            raise ConfigError("an exported refiner runs its own backbone: pass features=None")
        p = _numpy(probs)
        if len(getattr(images, "shape", ())) == 4:
            check_normalized_batch(images)
            labels, changed = self._refine_batch(_numpy(images), p)
            if hasattr(probs, "detach"):  # tensors in, tensors out (on probs' device)
                labels = torch.from_numpy(labels).to(probs.device)
                changed = torch.from_numpy(changed).to(probs.device)
        else:
            x = normalize([_as_rgb(images)])
            labels, changed = self._refine_batch(x, p[None] if p.ndim == 3 else p)
            labels, changed = labels[0], changed[0]
        return (labels, changed) if return_changed else labels

    def _refine_batch(self, x: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if probs.ndim != 4 or x.shape[0] != probs.shape[0] or x.shape[-2:] != probs.shape[-2:]:
            raise DataError(
                f"class probabilities of shape {probs.shape} do not match images of shape "
                f"{x.shape}; resize the base model's output to the image size before refining"
            )
        self.check_classes(None, probs.shape[1])
        cfg = self.config
        protos = torch.from_numpy(self.prototypes)

        def scores(keep: Any, band: Any) -> Any:  # the exported model, one image a run
            feats = []
            for b in np.flatnonzero(keep.numpy()):
                one = torch.from_numpy(np.ascontiguousarray(x[b : b + 1], np.float32))
                if cfg.p1_blur_sigma > 0:  # P1's filtering, as BoundaryRefiner's
                    one = p1_filter(one, cfg.p1_blur_sigma)
                feats.append(self.runner(one.numpy()))
            return prototype_scores(torch.from_numpy(np.concatenate(feats, 0)), protos)

        present = torch.from_numpy(self.present)
        out, changed = relabel(
            torch.from_numpy(np.ascontiguousarray(probs, np.float32)),
            scores,
            present,
            cfg,
            scale=prototype_scale(protos, present),
            covered=runner_span(self.runner, x.shape[-2:], cfg.input_scale, cfg.output_stride),
        )
        return out.numpy(), changed.numpy()


def runner_span(
    runner: Any, size: tuple[int, int], input_scale: float, output_stride: int
) -> tuple[float, float]:
    """The size, in pixels of an image of ``size``, that ``runner``'s embedding map spans; a
    static export resizes every image to its ``static_hw`` first, so that size's span,
    scaled back."""
    static = getattr(runner, "static_hw", None)
    if static is None:
        return embedding_cover(tuple(size), input_scale, output_stride)
    ch, cw = embedding_cover(tuple(static), input_scale, output_stride)
    return ch * size[0] / static[0], cw * size[1] / static[1]


def _numpy(x: Any) -> np.ndarray:
    return x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _missing_sidecar(path: Path, sidecar: Path) -> CheckpointError:
    """What to say when ``path`` has no sidecar: what it is instead, if anything."""
    try:
        kind = read_export_info(path).get("kind") if sidecar != path else None
    except DualsegError:
        kind = None
    if kind == "segmenter":
        what = "is an exported segmentation model ('dualseg export'), not a refiner"
    elif path.suffix.lower() != ".onnx" and zipfile.is_zipfile(path):  # torch.save's zip
        what = "is a PyTorch file, not an exported refiner: open it with BoundaryRefiner.load"
    else:
        return CheckpointError(
            f"refiner sidecar not found: {sidecar} (export writes it beside "
            "the model: dualseg export --refiner R --out refiner.onnx)"
        )
    return CheckpointError(f"{path} {what}; pass what 'dualseg refine fit' wrote, or its export")


def load_exported_refiner(
    path: str | os.PathLike[str],
    *,
    providers: Sequence[str] | None = None,
    threads: int | None = None,
) -> ExportedRefiner:
    """Load an exported refiner: ``path`` is its sidecar JSON or its embedding model (the
    sidecar is then ``<stem>.json`` beside it)."""
    path = Path(path)
    sidecar_path = path if path.suffix.lower() == ".json" else refiner_sidecar_path(path)
    if not sidecar_path.is_file():
        raise _missing_sidecar(path, sidecar_path)
    try:
        sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{sidecar_path} is not readable JSON ({err}); re-export") from err
    if not isinstance(sidecar, dict) or sidecar.get("format") != REFINER_FORMAT:
        raise CheckpointError(
            f"{sidecar_path} is no exported dualseg refiner; re-export it "
            "with 'dualseg export --refiner'"
        )
    model_path = sidecar_path.parent / str(sidecar["embedding"])
    if not model_path.is_file():
        raise CheckpointError(
            f"{sidecar_path}: its model {model_path.name} is not beside it; "
            "keep the two files of the export together"
        )
    info = read_export_info(model_path)
    if info.get("kind") != "embedding":
        raise CheckpointError(f"{model_path} is not an exported embedding model")
    runner = Runner(model_path, info.get("input_size"), providers, threads)
    return ExportedRefiner(runner, sidecar, source=str(sidecar_path))
