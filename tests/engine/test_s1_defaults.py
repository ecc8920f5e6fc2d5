"""Spec S1 augmentation: one set of defaults for train, refine fit and augment."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from dualseg.cli import main
from dualseg.commands.refine import build_parser as refine_parser
from dualseg.data import make_synthetic_dataset
from dualseg.data import transforms as T
from dualseg.data.augment import augment_dataset
from dualseg.engine.options import DataConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_synthetic.yaml"


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()}


def test_one_set_of_s1_defaults() -> None:
    want = {
        "scale_range": T.SCALE_RANGE,
        "hflip_prob": T.HFLIP_PROB,
        "blur_prob": T.BLUR_PROB,
        "jitter": T.JITTER,
    }
    for fn in (T.build_train_transform, T.build_augment_pipeline, augment_dataset):
        got = _defaults(fn)
        assert {k: got[k] for k in want} == want, fn.__name__
    d = DataConfig()
    b, c, s, h = T.JITTER
    assert (d.scale_range, d.hflip_prob, d.blur_prob) == (
        T.SCALE_RANGE,
        T.HFLIP_PROB,
        T.BLUR_PROB,
    )
    assert d.jitter == b == c == s and h == 0.0  # DataConfig's one strength: no hue
    fit = refine_parser().parse_args(["fit", "--data", "x"])
    assert tuple(fit.scale_range) == T.SCALE_RANGE


BAD_AUGMENT = [  # (augment flags, train flags, what the one line says)
    (["--scale-range", "2", "0.5"], ["--data.scale_range", "[2,0.5]"], "0 < MIN <= MAX"),
    (["--scale-range", "0", "1"], ["--data.scale_range", "[0,1]"], "0 < MIN <= MAX"),
    # the scaled image is allocated whole: 100000 was an allocator traceback
    (["--scale-range", "1e5", "1e5"], ["--data.scale_range", "[1,1e5]"], "MAX must be at most 8"),
    (["--hflip-prob", "3"], ["--data.hflip_prob", "3"], "a probability must be in [0, 1]"),
    (["--blur-prob", "-0.5"], ["--data.blur_prob", "-0.5"], "a probability must be in [0, 1]"),
    (["--jitter", "5", "5", "5", "5"], ["--data.jitter", "-1"], "jitter must be"),
    (["--crop-size", "0", "0"], ["--data.crop_size", "[0,0]"], "crop"),
]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("augment", "train", "says"), BAD_AUGMENT)
def test_bad_augmentation_values_are_one_line_before_anything_is_written(
    augment: list[str], train: list[str], says: str, tmp_path: Path, capsys
) -> None:
    src = make_synthetic_dataset(tmp_path / "syn", n_train=2, n_val=1, size=(16, 24))
    dst = tmp_path / "aug"
    assert main(["augment", str(src), str(dst), "--count", "2", "--quiet", *augment]) == 1
    err = _one_line(capsys)
    assert augment[0] in err and says in err
    assert not dst.exists()  # no augment.json left to block the corrected run
    assert main(["augment", str(src), str(dst), "--count", "2", "--quiet"]) == 0

    out = tmp_path / "run"
    argv = ["train", "--config", str(TINY), "--data.root", str(src), "--train.out_dir", str(out)]
    assert main([*argv, *train]) == 1
    err = _one_line(capsys)
    assert train[0][2:] in err and (says in err or "crop_size must be positive" in err)
    assert not out.exists()


def test_refine_fit_refuses_bad_values(tmp_path: Path, capsys) -> None:
    argv = ["refine", "fit", "--data", str(tmp_path), "-o", str(tmp_path / "r.pt")]
    assert main([*argv, "--scale-range", "2", "0.5"]) == 1
    assert _one_line(capsys).endswith(
        "--scale-range 2 0.5: the scale factors must satisfy 0 < MIN <= MAX (e.g. 0.5 2)"
    )
    assert main([*argv, "--crop-size", "0", "0"]) == 1
    assert "--crop-size 0 0" in _one_line(capsys)
    assert list(tmp_path.iterdir()) == []
