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
from torch import Tensor

from dualseg.errors import CheckpointError, ConfigError, DualsegError
from dualseg.export.runners import REFINER_FORMAT, Runner, read_export_info, refiner_sidecar_path
from dualseg.refine.decision import prototype_scores
from dualseg.refine.embedding import embedding_cover, p1_filter
from dualseg.refine.formats import stored_description
from dualseg.refine.refiner import BoundaryRefiner
from dualseg.refine.shared import SharedFeatures


class ExportedRefiner(BoundaryRefiner):
    """Method B from an exported embedding model + sidecar, with ``BoundaryRefiner.refine``'s
    contract and P2-P5 code; the embedding is computed by ``runner``."""

    def __init__(self, runner: Runner, sidecar: Mapping[str, Any], *, source: str = "") -> None:
        described = stored_description(sidecar, source)
        protos = torch.from_numpy(np.asarray(sidecar["prototypes"], np.float32))
        present = torch.from_numpy(np.asarray(sidecar["present"], bool))
        names = described["class_names"]
        if len(protos) != len(names) or present.shape != (len(protos),):
            raise CheckpointError(
                f"{source}: {len(protos)} prototypes for {len(names)} classes; re-export it"
            )
        try:  # the options read against the classes: a blocked switch names one of them
            super().__init__(
                None, protos, present, class_names=names, config=described["config"],
                ignore_index=described["ignore_index"], palette=described["palette"],
            )  # fmt: skip
        except ConfigError as err:
            raise CheckpointError(f"{source}: {err}; re-export the refiner") from None
        self.runner, self.source = runner, source
        self.calibration = described["calibration"]
        self.label_contract = described["label_contract"]

    def shared_features(self, model: Any) -> Any:
        """A context that shares nothing: the exported model runs its own backbone."""
        return SharedFeatures(model, active=False)

    def _check_base_features(self, feats: Any, sigma: float) -> None:
        raise ConfigError("an exported refiner runs its own backbone: pass features=None")

    def _cover(self, size: tuple[int, int]) -> tuple[float, float]:
        return runner_span(self.runner, size, self.config.input_scale, self.config.output_stride)

    def _scores(
        self, images: Tensor, keep: Tensor, band: Tensor, sigma: float, features: Any,
        covered: tuple[float, float],
    ) -> Tensor:  # fmt: skip
        """The exported model, one image a run, P1's filter as ``BoundaryRefiner``'s."""
        feats = [self.runner(p1_filter(images[b : b + 1].float().cpu(), sigma).numpy())
                 for b in keep.nonzero().flatten().tolist()]  # fmt: skip
        return prototype_scores(torch.from_numpy(np.concatenate(feats, 0)), self.prototypes)


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
    info = read_export_info(model_path)  # "not found" when it is not beside the sidecar
    if info.get("kind") != "embedding":
        raise CheckpointError(f"{model_path} is not an exported embedding model")
    runner = Runner(model_path, info.get("input_size"), providers, threads)
    return ExportedRefiner(runner, sidecar, source=str(sidecar_path))
