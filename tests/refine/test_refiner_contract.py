"""The label contract travels with the refiner: refine fit stores its base's (or its data's),
the .pt and the folder keep it, and refine apply / eval refuse a refiner whose contract is not
the model's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.engine.test_label_contract import BINARY, MAPPED, _binary_root, _train

from dualseg.cli import main as cli_main
from dualseg.data import DatasetMeta
from dualseg.data.contract import LabelContract
from dualseg.engine.checkpoint import contract_of, load_checkpoint
from dualseg.refine import BoundaryRefiner


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A model trained with meta.json's label_map {0: 0, 255: 1}, and a refiner fitted on the
    same images without meta.json (read with the model's contract)."""
    base = tmp_path_factory.mktemp("refiner_contract")
    root = _binary_root(base / "isbi", n=6)
    (root / "meta.json").write_text(json.dumps(MAPPED))
    last = _train(root, base / "run")
    bare = base / "bare"
    shutil.copytree(root, bare)
    (bare / "meta.json").unlink()
    out = base / "refiner.pt"
    argv = ["refine", "fit", "--data", str(bare), "--base", str(last), "--out", str(out),
            "--init-backbone", "none", "--backbone", "mobilenet_v2", "--embed-dim", "8",
            "--steps", "1", "--batch-size", "2", "--crop-size", "32", "32",
            "--num-triplets", "64", "--radius", "2", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    assert cli_main(argv) == 0
    return root, last, out


def test_fit_stores_the_base_contract_and_it_round_trips(fitted, tmp_path: Path) -> None:
    _, last, out = fitted
    model = contract_of(load_checkpoint(last)).to_dict()
    refiner = BoundaryRefiner.load(out)
    assert refiner.label_contract == model
    refiner.save_pretrained(tmp_path / "folder")
    assert BoundaryRefiner.load(tmp_path / "folder").label_contract == model
    refiner.label_contract = None  # a refiner without one loads as before
    refiner.save(tmp_path / "none.pt")
    assert BoundaryRefiner.load(tmp_path / "none.pt").label_contract is None


def test_a_refiner_of_another_contract_is_refused(fitted, tmp_path: Path, capsys) -> None:
    root, last, out = fitted
    refiner = BoundaryRefiner.load(out)
    refiner.label_contract = LabelContract(DatasetMeta.from_dict(BINARY)).to_dict()
    other = refiner.save(tmp_path / "other.pt")
    capsys.readouterr()
    image = root / "images" / "5.png"
    apply = ["refine", "apply", "-r", str(other), "-b", str(last), "-o", str(tmp_path / "a")]
    assert cli_main([*apply, "--device", "cpu", str(image)]) == 1
    err = capsys.readouterr().err
    assert "label values: model [" in err and "| refiner [" in err
    assert "fit the refiner on this model's data" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a" / "labels").exists()
    evaluate = ["eval", "-c", str(last), "--data", str(root), "--quiet", "--device", "cpu"]
    assert cli_main([*evaluate, "--out", str(tmp_path / "e"), "--refiner", str(other)]) == 1
    assert "fit the refiner on this model's data" in capsys.readouterr().err
    assert not (tmp_path / "e" / "metrics.json").exists()
    # the refiner fit stored passes both
    assert cli_main([*evaluate, "--out", str(tmp_path / "e2"), "--refiner", str(out)]) == 0
