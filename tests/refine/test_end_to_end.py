"""Method B end to end on a small real CamVid subset: fit, apply, metrics with and without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from checkpoint_helpers import write_peer_checkpoint
from dualseg.commands.predict import main as predict_main
from dualseg.commands.refine import main as refine_main
from dualseg.data import build_dataset, read_image
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.evaluation import evaluate
from dualseg.refine import BoundaryRefiner

SIZE = (80, 60)  # W, H: CamVid's 480x360 scaled by 1/6, to keep the test tiny


def _subset(camvid: Path, out: Path, split: str, n: int) -> None:
    """The first ``n`` pairs of ``split``, resized into ``out`` (outside the repository)."""
    lines = (camvid / f"{split}.txt").read_text().split("\n")[:n]
    for line in lines:
        img, lab = line.split()
        for rel, resample in ((img, Image.BILINEAR), (lab, Image.NEAREST)):
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.open(camvid / rel).resize(SIZE, resample).save(out / rel)
    (out / f"{split}.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.camvid
@pytest.mark.slow
def test_fit_apply_and_metrics_on_camvid_subset(camvid_root: Path, tmp_path: Path) -> None:
    data = tmp_path / "camvid"
    _subset(camvid_root, data, "train", 4)
    _subset(camvid_root, data, "val", 2)
    names = build_dataset(data, split="val", preset="camvid").meta.class_names
    base = write_peer_checkpoint(tmp_path / "base.pt", names)
    model, _ = build_model_from_checkpoint(load_checkpoint(base))

    refiner_path = tmp_path / "refiner.pt"
    fit = ["fit", "--data", str(data), "--preset", "camvid", "--base", str(base)]
    fit += ["--out", str(refiner_path), "--init-backbone", "base", "--backbone", "mobilenet_v2"]
    fit += ["--embed-dim", "16", "--steps", "3", "--batch-size", "2", "--crop-size", "48", "48"]
    fit += ["--num-triplets", "256", "--radius", "2", "--device", "cpu", "--no-progress"]
    assert refine_main(fit) == 0
    assert refine_main([*fit, "--steps", "4", "--resume"]) == 0  # one more step from the state
    train_state = torch.load(refiner_path.with_suffix(".train.pt"), weights_only=True)
    assert train_state["step"] == 4 and len(train_state["history"]) == 4

    out = tmp_path / "out"
    val_images = sorted((data / "val").glob("*.png"))
    apply = ["apply", "--refiner", str(refiner_path), "--base", str(base), "--out", str(out)]
    assert refine_main([*apply, "--device", "cpu", *map(str, val_images)]) == 0
    for image in val_images:
        label = np.asarray(Image.open(out / "labels" / image.name))
        changed = np.asarray(Image.open(out / "changed" / image.name))
        assert label.shape == changed.shape == read_image(image).shape[:2]
        assert label.max() < len(names)

    # the same base as saved probability maps ('dualseg predict --probs' output folder)
    pred = tmp_path / "pred"
    assert (
        predict_main(
            [
                "--checkpoint",
                str(base),
                "--out",
                str(pred),
                "--probs",
                "--device",
                "cpu",
                *map(str, val_images),
            ]
        )
        == 0
    )
    assert (
        refine_main(
            [
                *apply[:3],
                "--base",
                str(pred),
                "--out",
                str(tmp_path / "out2"),
                "--device",
                "cpu",
                *map(str, val_images),
            ]
        )
        == 0
    )
    for image in val_images:
        a = np.asarray(Image.open(out / "labels" / image.name))
        b = np.asarray(Image.open(tmp_path / "out2" / "labels" / image.name))
        assert (a == b).mean() > 0.99  # float16 probabilities may flip a near-tie

    refiner = BoundaryRefiner.load(refiner_path)
    assert refiner.class_names == names and refiner.config.embed_dim == 16
    val = build_dataset(data, split="val", preset="camvid")
    loader = torch.utils.data.DataLoader(val, batch_size=2)
    metrics = evaluate(model, loader, num_classes=len(names), refiner=refiner)
    for key in ("miou", "boundary_f1", "trimap_miou"):
        assert 0.0 <= metrics[key] <= 1.0 and 0.0 <= metrics["refined"][key] <= 1.0
    counts = metrics["refine"]
    assert counts["fixed"] + counts["broke"] <= counts["changed"] <= counts["pixels"]
