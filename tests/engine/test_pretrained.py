"""Pretrained folders: save_pretrained / load_model(folder | hf://), export (refiner folders:
test_pretrained_refiner.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dualseg
from checkpoint_helpers import SYNTHETIC as META
from checkpoint_helpers import SYNTHETIC_KWARGS as KWARGS
from checkpoint_helpers import small_refiner, synthetic_contract, write_synthetic_checkpoint
from dualseg.cli import main as cli_main
from dualseg.engine.pretrained import CONFIG_NAME, WEIGHTS_NAME, read_pretrained
from dualseg.errors import CheckpointError, ConfigError
from dualseg.refine import BoundaryRefiner

SRC = Path(dualseg.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    return write_synthetic_checkpoint(path, metrics={"iteration": 7, "miou": 0.25})


@pytest.fixture(scope="module")
def folder(ckpt, tmp_path_factory) -> Path:
    return dualseg.load_model(ckpt).save_pretrained(tmp_path_factory.mktemp("pre") / "m")


@pytest.fixture
def rgb() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (33, 41, 3), dtype=np.uint8)


def test_folder_round_trip_gives_identical_predictions(ckpt, folder, rgb) -> None:
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert config["arch"] == "dualseg_mobilenet_v2" and config["model_kwargs"] == KWARGS
    assert config["class_names"] == list(META.class_names)
    assert config["palette"] == [list(c) for c in META.palette]
    assert config["normalization"]["mean"] == [0.485, 0.456, 0.406]
    a, b = dualseg.load_model(ckpt), dualseg.load_model(folder)
    assert b.class_names == a.class_names and b.meta.palette == a.meta.palette
    assert np.array_equal(a.predict_proba(rgb), b.predict_proba(rgb))
    # the weights file is plain safetensors: readable without dualseg, tensors only
    from safetensors.torch import load_file

    weights = load_file(str(folder / WEIGHTS_NAME))
    ref = a.model.state_dict()
    assert weights.keys() == ref.keys() and all(torch.equal(weights[k], ref[k]) for k in ref)


def test_save_refuses_to_overwrite_and_bad_folders_are_one_line_errors(folder, tmp_path) -> None:
    seg = dualseg.load_model(folder)
    with pytest.raises(ConfigError, match=r"already holds config\.json"):
        seg.save_pretrained(folder)
    seg.save_pretrained(folder, overwrite=True)  # explicit: allowed

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CONFIG_NAME).write_text((folder / CONFIG_NAME).read_text())
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model weights not found"):
        dualseg.load_model(broken)
    (broken / WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00not safetensors at all")
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file") as err:
        dualseg.load_model(broken)
    assert "\n" not in str(err.value)
    (broken / CONFIG_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is corrupt"):
        dualseg.load_model(broken)
    (broken / CONFIG_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a dualseg pretrained model"):
        dualseg.load_model(broken)
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"not a pretrained folder \(pass .*last\.pt"):
        dualseg.load_model(run)
    config = json.loads((folder / CONFIG_NAME).read_text())
    config["normalization"]["mean"] = [0.5, 0.5, 0.5]
    (broken / CONFIG_NAME).write_text(json.dumps(config))
    (broken / WEIGHTS_NAME).write_bytes((folder / WEIGHTS_NAME).read_bytes())
    with pytest.raises(CheckpointError, match="expects input normalization mean"):
        dualseg.load_model(broken)


def test_missing_huggingface_hub_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dualseg\[hub\]'"):
        dualseg.load_model("hf://org/name")
    with pytest.raises(ConfigError, match=r"pip install 'dualseg\[hub\]'"):
        BoundaryRefiner.load("hf://org/name")


def _hub_cache(home: Path, repo: str, files: dict[str, bytes]) -> str:
    """The huggingface_hub cache layout: refs/main -> snapshots/<commit>/<files>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return commit


def test_save_pretrained_refuses_a_model_its_description_would_not_rebuild(ckpt, tmp_path) -> None:
    from dualseg.engine.pretrained import save_pretrained

    seg = dualseg.load_model(ckpt)
    other = {**seg.model_kwargs, "output_stride": 8}  # built at stride 16
    with pytest.raises(ConfigError, match=r"not what arch='dualseg_mobilenet_v2'.*dilation"):
        save_pretrained(seg.model, tmp_path / "s16", arch=seg.arch, model_kwargs=other,
                        meta=seg.meta)  # fmt: skip
    wrong = {**seg.model_kwargs, "num_classes": seg.meta.num_classes + 1}
    with pytest.raises(ConfigError, match="shape"):
        save_pretrained(seg.model, tmp_path / "k", arch=seg.arch, model_kwargs=wrong,
                        meta=seg.meta)  # fmt: skip
    compiled = torch.nn.Module()
    compiled._orig_mod = seg.model  # the key prefix torch.compile's wrapper gives
    with pytest.raises(ConfigError, match=r"torch.compile's wrapper; save .*model._orig_mod"):
        save_pretrained(compiled, tmp_path / "c", arch=seg.arch, model_kwargs=seg.model_kwargs,
                        meta=seg.meta)  # fmt: skip
    # what leaves the output alone passes: SyncBatchNorm (DDP training), BatchNorm momentum
    import copy

    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(seg.model))
    for m in synced.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.01
    save_pretrained(synced, tmp_path / "synced", arch=seg.arch, model_kwargs=seg.model_kwargs,
                    meta=seg.meta)  # fmt: skip
    # model_kwargs without num_classes (a checkpoint naming only its classes) take the meta's
    bare = {k: v for k, v in seg.model_kwargs.items() if k != "num_classes"}
    save_pretrained(seg.model, tmp_path / "bare", arch=seg.arch, model_kwargs=bare, meta=seg.meta)
    assert dualseg.load_model(tmp_path / "bare").meta.num_classes == seg.meta.num_classes
    with torch.no_grad():
        next(seg.model.parameters()).fill_(float("nan"))
    with pytest.raises(ConfigError, match="NaN or infinite weights"):
        seg.save_pretrained(tmp_path / "nan")
    written = ("s16", "k", "c", "nan")
    assert not any((tmp_path / name).exists() for name in written)


def test_an_empty_path_is_refused_not_read_as_the_current_folder(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="got an empty one"):
        dualseg.load_model(ckpt).save_pretrained("")
    with pytest.raises(ConfigError, match="got an empty one"):
        small_refiner().save_pretrained("")
    with pytest.raises(ConfigError, match="the model path is empty"):
        dualseg.load_model("")
    with pytest.raises(ConfigError, match="the refiner path is empty"):
        BoundaryRefiner.load("")
    assert list(tmp_path.iterdir()) == []


def test_hf_source_reads_the_local_hub_cache_offline(folder, tmp_path, rgb) -> None:
    """hf://org/name through huggingface_hub, offline, from a cache laid out as the hub does."""
    pytest.importorskip("huggingface_hub")
    names = tuple(json.loads((folder / CONFIG_NAME).read_text())["class_names"])
    refiner_dir = small_refiner(names).save_pretrained(tmp_path / "r")  # fit for that model
    files = {n: (folder / n).read_bytes() for n in (CONFIG_NAME, WEIGHTS_NAME)}
    files.update({p.name: p.read_bytes() for p in refiner_dir.iterdir()})
    home = tmp_path / "hf_home"
    _hub_cache(home, "someorg/camvid-tiny", files)
    expected = dualseg.load_model(folder).predict(rgb)
    np.save(tmp_path / "rgb.npy", rgb)
    script = f"""
import numpy as np
import dualseg
from dualseg.refine import BoundaryRefiner
seg = dualseg.load_model("hf://someorg/camvid-tiny")
np.save({str(tmp_path / "out.npy")!r}, seg.predict(np.load({str(tmp_path / "rgb.npy")!r})))
ref = BoundaryRefiner.load("hf://someorg/camvid-tiny")
print("refiner", ref.class_names)
try:
    dualseg.load_model("hf://someorg/not-cached")
except dualseg.errors.CheckpointError as err:
    print("error:", err)
"""
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(SRC),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("HF_HUB_CACHE", None)
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr
    assert np.array_equal(np.load(tmp_path / "out.npy"), expected)
    assert f"refiner {names}" in res.stdout
    assert "error: cannot fetch hf://someorg/not-cached" in res.stdout
    assert "HF_HUB_OFFLINE is set" in res.stdout


def test_export_format_pretrained_cli(ckpt, tmp_path, capsys, rgb) -> None:
    out = tmp_path / "exported"
    assert cli_main(["export", "--checkpoint", str(ckpt), "--format", "pretrained", "--out",
                     str(out)]) == 0  # fmt: skip
    assert "config.json + model.safetensors" in capsys.readouterr().out
    state = read_pretrained(out)
    assert state["metrics"] == {"iteration": 7, "miou": 0.25}
    a, b = dualseg.load_model(ckpt), dualseg.load_model(out)
    assert np.array_equal(a.predict(rgb), b.predict(rgb))
    # a second export into the same folder is refused (one line), --overwrite allows it
    args = ["export", "-c", str(ckpt), "--format", "pretrained", "--out", str(out)]
    assert cli_main(args) == 1
    assert "already holds" in capsys.readouterr().err
    assert cli_main([*args, "--overwrite"]) == 0

    names = dualseg.load_model(ckpt).meta.class_names
    refiner = small_refiner(names)  # fit for that model: it joins the model's folder
    refiner_file = refiner.save(tmp_path / "refiner.pt")
    args = ["export", "--refiner", str(refiner_file), "--format", "pretrained", "--out", str(out)]
    assert cli_main(args) == 0  # the refiner joins the model in the same folder
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [CONFIG_NAME, WEIGHTS_NAME, "refiner.json", "refiner.safetensors"]
    )
    loaded = BoundaryRefiner.load(out)
    images = torch.randn(1, 3, 32, 32)
    probs = torch.randn(1, len(names), 32, 32).softmax(1)
    assert torch.equal(loaded.refine(images, probs), refiner.refine(images, probs))
    # a refiner fit for other classes is refused there: the folder is loaded as a pair
    other = small_refiner().save(tmp_path / "other.pt")
    args = ["export", "--refiner", str(other), "--format", "pretrained", "--out", str(out)]
    assert cli_main([*args, "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "describes a model of other classes than the refiner" in err, err


def test_predict_and_eval_take_a_pretrained_folder_and_follow_the_progress_rule(
    folder, ckpt, tmp_path, capsys, rgb
) -> None:
    from PIL import Image

    from dualseg.data import make_synthetic_dataset

    images = tmp_path / "images"
    images.mkdir()
    for i in range(2):
        Image.fromarray(rgb).save(images / f"{i}.png")
    out = tmp_path / "pred"
    assert cli_main(["predict", str(images), "-c", str(folder), "-o", str(out)]) == 0
    err = capsys.readouterr().err  # not a terminal: a plain progress line, no bar
    assert "predict: 2/2 (100%) img" in err and "\r" not in err
    expected = dualseg.load_model(ckpt).predict(rgb)
    assert np.array_equal(np.asarray(Image.open(out / "labels" / "0.png")), expected)
    again = ["predict", str(images), "-c", str(folder), "-o", str(out), "--quiet", "--overwrite"]
    assert cli_main(again) == 0
    assert "predict:" not in capsys.readouterr().err

    data = make_synthetic_dataset(tmp_path / "syn", n_train=1, n_val=2, size=(48, 64))
    args = ["eval", "-c", str(folder), "--data", str(data), "--out", str(tmp_path / "ev")]
    assert cli_main([*args, "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "eval: 2/2 (100%) batch" in captured.err and "mIoU" in captured.out
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["num_images"] == 2


def test_a_folder_keeps_how_the_training_labels_were_read(tmp_path, capsys) -> None:
    """A model trained with --data.label_map is scored on the classes it learnt from its
    folder as from its checkpoint (the folder used to drop the map: another mIoU, no word)."""
    from dualseg.data import make_synthetic_dataset

    shuffled = "0:1,1:2,2:3,3:4,4:5,5:6,6:7,7:0"
    data_cfg = {"preset": "synthetic", "label_map": shuffled, "ignore_index": 255}
    contract = synthetic_contract({i: (i + 1) % 8 for i in range(8)})
    ckpt = write_synthetic_checkpoint(
        tmp_path / "best.pt", config={"data": data_cfg}, label_contract=contract
    )
    out = tmp_path / "pre"
    assert cli_main(["export", "-c", str(ckpt), "--format", "pretrained", "--out", str(out)]) == 0
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["training_labels"] == {"label_map": shuffled, "ignore_index": 255}
    assert read_pretrained(out)["config"]["data"]["label_map"] == shuffled
    again = tmp_path / "again"  # through the Python API too
    dualseg.load_model(out).save_pretrained(again)
    assert (
        json.loads((again / CONFIG_NAME).read_text())["training_labels"]
        == (config["training_labels"])
    )

    data = make_synthetic_dataset(tmp_path / "syn", n_train=1, n_val=2, size=(48, 64))
    scores = []
    for source in (ckpt, out):
        ev = tmp_path / f"ev_{Path(source).name}"
        argv = ["eval", "-c", str(source), "--data", str(data), "-o", str(ev), "--threads", "1"]
        assert cli_main(argv) == 0
        assert f"data.label_map {shuffled}" in capsys.readouterr().err  # the note
        scores.append(json.loads((ev / "metrics.json").read_text())["miou"])
    assert scores[0] == scores[1]


def test_a_folder_with_unknown_training_label_keys_is_refused(folder, tmp_path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / CONFIG_NAME).read_text())
    (bad / CONFIG_NAME).write_text(json.dumps({**config, "training_labels": {"labelmap": "1:2"}}))
    with pytest.raises(CheckpointError, match="training_labels must map some of label_format"):
        read_pretrained(bad)


@pytest.mark.parametrize(
    ("entry", "value", "said"),
    [
        ("palette", [[1, 2]] * 8, "palette must be a list of one [r, g, b] in 0..255 per class"),
        ("palette", [["a", "b", "c"]] * 8, "palette must be a list of one [r, g, b]"),
        ("palette", [[0, 0, 300]] * 8, "palette must be a list of one [r, g, b] in 0..255"),
        ("ignore_index", "abc", "ignore_index must be 255 (dualseg's ignore value), got 'abc'"),
        ("class_names", "skyroad", "class_names must be a list of one name per class, got 'sky"),
        ("class_names", None, "class_names must be a list of one name per class, got None"),
        ("palette", None, "palette must be a list of one [r, g, b] in 0..255 per class, got No"),
        ("ignore_index", 0, "ignore_index must be 255 (dualseg's ignore value), got 0"),
        ("arch", ["deeplabv3_mobilenet_v2"], "names architecture ['deeplabv3_mobilenet_v2']"),
        ("class_names", [1, 2, 3, 4, 5, 6, 7, 8], "class_names must be a list of one name per"),
    ],
)
def test_a_damaged_config_json_is_one_line(folder, tmp_path, capsys, entry, value, said) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / CONFIG_NAME).read_text())
    (bad / CONFIG_NAME).write_text(json.dumps({**config, entry: value}))
    image = tmp_path / "in.png"
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(image)
    out = tmp_path / "out"
    assert cli_main(["predict", str(image), "-c", str(bad), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and str(bad / CONFIG_NAME) in err, err
    assert not out.exists()


def test_one_file_of_a_folder_or_a_folder_as_onnx_names_the_folder(folder, capsys) -> None:
    image = folder.parent / "in.png"
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(image)
    out = folder.parent / "never"
    for name in (WEIGHTS_NAME, CONFIG_NAME):  # said "a bare state dict" / "corrupt" before
        assert cli_main(["predict", str(image), "-c", str(folder / name), "-o", str(out)]) == 1
        assert f"is one file of the pretrained folder {folder}; pass the folder" in (
            capsys.readouterr().err
        )
    assert cli_main(["predict", str(image), "--onnx", str(folder), "-o", str(out)]) == 1
    err = capsys.readouterr().err  # said "exported model not found" of a folder that exists
    assert "is a pretrained folder, not an exported ONNX" in err and "(-c)" in err
    assert not out.exists()


def test_an_export_into_the_files_of_the_folder_being_exported_is_refused(folder, capsys) -> None:
    before = (folder / WEIGHTS_NAME).read_bytes()
    argv = ["export", "-c", str(folder), "--format", "onnx", "--out", str(folder / WEIGHTS_NAME)]
    assert cli_main([*argv, "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert f"would overwrite --checkpoint {folder} ({WEIGHTS_NAME})" in err, err
    assert (folder / WEIGHTS_NAME).read_bytes() == before


def test_an_overwrite_stopped_midway_never_pairs_new_weights_with_the_old_config(
    ckpt, tmp_path, monkeypatch
) -> None:
    import dualseg.engine.pretrained as P

    seg = dualseg.load_model(ckpt)
    out = seg.save_pretrained(tmp_path / "m")

    def killed(path, tensors):  # the new weights land, then the run is stopped
        (path).write_bytes(b"new weights")
        raise KeyboardInterrupt

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(P, "write_safetensors", killed)
    with pytest.raises(KeyboardInterrupt):
        seg.save_pretrained(out, overwrite=True)
    # the earlier pair stays whole and loadable (removing its config first broke it), and no
    # staged file is left behind
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    dualseg.load_model(out)
