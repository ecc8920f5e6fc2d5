"""Refiner folders (refiner.json + refiner.safetensors): a round trip, a damaged entry named,
and a refiner never paired in one folder with a model of other classes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from checkpoint_helpers import small_refiner
from dualseg.engine.predict import load_model
from dualseg.errors import CheckpointError, ConfigError
from dualseg.refine import BoundaryRefiner


def test_overwriting_a_model_beside_its_refiner_warns_and_keeps_the_refiner(ckpt, tmp_path) -> None:
    seg = load_model(ckpt)
    out = seg.save_pretrained(tmp_path / "m")
    small_refiner(seg.meta.class_names).save_pretrained(out)
    with pytest.warns(UserWarning, match=r"keeps refiner\.json \+ refiner\.safetensors.*refit"):
        seg.save_pretrained(out, overwrite=True)
    assert (out / "refiner.json").exists()  # the user's to delete, never silently lost
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    small_refiner(seg.meta.class_names).save_pretrained(
        fresh
    )  # a refiner saved first, then its model: nothing replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seg.save_pretrained(fresh)


def test_refiner_folder_round_trip(tmp_path) -> None:
    refiner = small_refiner()
    out = refiner.save_pretrained(tmp_path / "r")
    assert sorted(p.name for p in out.iterdir()) == ["refiner.json", "refiner.safetensors"]
    loaded = BoundaryRefiner.load(out)
    assert loaded.class_names == ("a", "b", "c") and loaded.config == refiner.config
    assert loaded.calibration is None  # fit without --calibrate-split
    assert torch.equal(loaded.prototypes, refiner.prototypes)
    assert torch.equal(loaded.present, refiner.present)
    images = torch.randn(1, 3, 16, 16)
    probs = torch.randn(1, 3, 16, 16).softmax(1)
    assert torch.equal(loaded.refine(images, probs), refiner.refine(images, probs))
    with pytest.raises(ConfigError, match=r"already holds refiner\.json"):
        refiner.save_pretrained(out)
    (out / "refiner.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file"):
        BoundaryRefiner.load(out)
    (out / "refiner.json").unlink()
    with pytest.raises(CheckpointError, match=r"refiner\.json: refiner description not found"):
        BoundaryRefiner.load(out)


@pytest.mark.parametrize(
    ("entry", "value", "said"),
    [
        ("config", None, "config must be a dict of refiner options"),
        ("config", {"top_n": "5"}, "option top_n must be int, got '5'"),
        ("config", {"gate_margin": "0.1"}, "option gate_margin must be float | None"),
        ("config", {"foo": 1}, "option(s) foo that this dualseg does not know"),
        ("config", {"top_n": 0}, "top_n must be >= 1, got 0"),
        ("config", {"embed_dim": 8}, "the embedding weights do not fit the model"),
        ("config", {"blocked_switches": [[0, 5]]}, "blocked switch 0:5 names a class outside"),
        ("class_names", [0, 1, 2], "class_names must be strings"),
        ("class_names", ["a", "b"], "prototypes has shape (3, 4), expected (2, 4)"),
        ("ignore_index", None, "ignore_index must be an integer in 0..255"),
        ("palette", "red", "palette must be null or one [r, g, b]"),
        ("calibration", "garbage", "calibration must be null or the record"),
        (
            "calibration",
            {"split": "dev", "images": 1, "image_digests": "abc"},
            "calibration must be null or the record",
        ),
    ],
)
def test_a_damaged_refiner_json_names_the_file_and_the_entry(tmp_path, entry, value, said) -> None:
    out = small_refiner().save_pretrained(tmp_path / "r")
    stored = json.loads((out / "refiner.json").read_text())
    if entry == "config" and isinstance(value, dict):  # one option edited
        value = {**stored["config"], **value}
    (out / "refiner.json").write_text(json.dumps({**stored, entry: value}))
    with pytest.raises(CheckpointError) as err:
        BoundaryRefiner.load(out)
    assert said in str(err.value) and str(out / "refiner.json") in str(err.value)


def test_a_refiner_saved_beside_a_model_of_other_classes_is_refused(seg, tmp_path) -> None:
    import shutil

    both = seg.save_pretrained(tmp_path / "both")
    with pytest.raises(CheckpointError, match="describes a model of other classes"):
        small_refiner().save_pretrained(both)  # classes a, b, c beside the model's eight
    assert not (both / "refiner.json").exists()
    small_refiner().save_pretrained(tmp_path / "r")  # copied in by hand: refused when it loads
    for name in ("refiner.json", "refiner.safetensors"):
        shutil.copy(tmp_path / "r" / name, both / name)
    with pytest.raises(CheckpointError, match=r"0: 'sky' vs 'a'.*fit a refiner for that model"):
        BoundaryRefiner.load(both)


def test_a_model_saved_beside_a_refiner_of_other_classes_is_refused(ckpt, tmp_path) -> None:
    """The reverse order: the model was written without a word, and the folder then failed
    to load as a pair."""
    out = small_refiner().save_pretrained(tmp_path / "pair")  # classes a, b, c
    with pytest.raises(CheckpointError, match=r"refiner\.json is a refiner of other classes"):
        load_model(ckpt).save_pretrained(out)  # the model's eight
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
