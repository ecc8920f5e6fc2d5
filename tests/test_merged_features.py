"""Issue 11's reliability work and issue 13's sharing work, used together."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dualseg
from dualseg.cli import main
from dualseg.data import DatasetMeta
from dualseg.engine.options import DataConfig
from dualseg.engine.preflight import check_training_data
from dualseg.engine.rundir import check_run_dir, clear_run_dir
from dualseg.errors import DataError, RunExistsError
from reliability_helpers import BINARY, FOUR, class_maps, save, write_checkpoint, write_dataset


def test_label_map_entries_win_over_reduce_zero_label() -> None:
    meta = DatasetMeta(
        name="ade-like",
        class_names=("a", "b", "c"),
        palette=((1, 1, 1), (2, 2, 2), (3, 3, 3)),
        reduce_zero_label=True,
        label_map=((0, 2), (9, 255)),
    )
    lut = meta.lookup_table()
    assert lut[[0, 1, 2, 3, 4, 9, 255]].tolist() == [2, 0, 1, 2, -1, 255, 255]
    assert meta.describe_ignore() == "9, 255"  # raw 0 is mapped to a class here
    assert DatasetMeta.from_dict(meta.to_dict()) == meta  # meta.json keeps the whole mapping


def test_several_roots_are_scanned_together_before_training(tmp_path, capsys) -> None:
    low = write_dataset(tmp_path / "low", {"train": class_maps(2, 2)}, meta=FOUR)  # a, b
    high = [m + 2 for m in class_maps(2, 2)]  # c, d
    high_root = write_dataset(tmp_path / "high", {"train": high}, meta=FOUR)
    # (crops of the images' size: the default 360x480 would be warned about as padding)
    d = DataConfig(root=(str(low), str(high_root)), val_split=None, crop_size=(32, 32))
    check_training_data(d)  # every class is in one of the roots: no refusal, no warning
    assert "warning" not in capsys.readouterr().err
    check_training_data(DataConfig(root=str(low), val_split=None))  # c, d absent: a warning
    assert "have no pixels" in capsys.readouterr().err
    save(high_root / "trainannot" / "1.png", np.full((32, 32), 7, np.uint8))
    with pytest.raises(DataError, match=r"trainannot/1\.png: label values \[7\]"):
        check_training_data(d)


def test_a_pretrained_folder_is_checked_against_the_dataset_classes(tmp_path, capsys) -> None:
    folder = tmp_path / "four-model"
    dualseg.load_model(write_checkpoint(tmp_path / "four.pt", FOUR.class_names)).save_pretrained(
        folder
    )
    data = write_dataset(tmp_path / "bin", {"val": class_maps(1, 2)}, meta=BINARY)
    out = tmp_path / "e"
    assert main(["eval", "-c", str(folder), "--data", str(data), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has 4 classes ['a', 'b', 'c', 'd']" in err
    assert not (out / "metrics.json").exists()

    from dualseg.refine.base import load_base

    base = load_base(folder)  # a pretrained folder is a model, not a folder of .npz maps
    assert base.class_names == FOUR.class_names


def test_summary_json_is_part_of_a_run(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    with pytest.raises(RunExistsError, match=r"summary\.json"):
        clear_run_dir(run, resume=None, overwrite=False)
    # the check alone never removes anything, even with overwrite
    assert check_run_dir(run, resume=None, overwrite=True) == [run / "summary.json"]
    assert (run / "summary.json").exists()
    # replaced with the rest of the run, right before the new run's first write
    clear_run_dir(run, resume=None, overwrite=True)
    assert not (run / "summary.json").exists()


def test_eval_default_out_of_a_hub_model_is_in_the_current_folder() -> None:
    from dualseg.commands.eval import default_out

    assert default_out("hf://org/name", "val") == Path("eval_val_name")
    assert default_out("hf://org/name@v2", "val", variant="_tta") == Path("eval_val_name_tta")
    assert default_out("runs/x/best.pt", "test") == Path("runs/x/eval_test")
    assert default_out("models/unet.py:model", "val") == Path("models/eval_val_unet_model")
