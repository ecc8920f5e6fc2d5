"""Method B's commands refuse what would give a silently wrong refiner or lose work: the
decision calibrated on an evaluation split, labels read otherwise than the base was trained,
a fit that never drew a triplet, a state file that is the refiner, an apply that would stop
half-way, an --overwrite fit that a later --resume would mix with the fit it replaced."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from checkpoint_helpers import synthetic_contract, write_synthetic_checkpoint
from dualseg.cli import main
from dualseg.data import make_synthetic_dataset
from dualseg.refine import BoundaryRefiner
from reliability_helpers import one_line, refused


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trust") / "data"
    return Path(make_synthetic_dataset(root, n_train=4, n_val=2, size=(48, 64), seed=0))


@pytest.fixture(scope="module")
def base(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("base") / "base.pt")


def fit(data: Path, base: Path | None, out: Path, *extra: str) -> list[str]:
    argv = ["refine", "fit", "--data", str(data), "--out", str(out), "--embed-dim", "8"]
    argv += ["--steps", "2", "--batch-size", "2", "--crop-size", "32", "32", "--radius", "2"]
    argv += ["--num-triplets", "32", "--device", "cpu", "--no-progress", "--log-every", "0"]
    return [*argv, "--init-backbone", "none", *(["--base", str(base)] if base else []), *extra]


def test_the_decision_is_never_calibrated_on_an_evaluation_split(data, base, tmp_path, capsys):
    out = tmp_path / "r.pt"
    for split in ("val", "test"):
        assert main(fit(data, base, out, "--calibrate-split", split)) == 1
        err = one_line(capsys)
        assert f"--calibrate-split {split} is an evaluation split" in err and "train" in err
    assert not out.exists()


def test_a_state_file_that_is_the_refiner_is_refused_before_the_fit(data, tmp_path, capsys):
    out = tmp_path / "r.pt"
    assert main(fit(data, None, out, "--checkpoint", str(out))) == 1
    assert "--checkpoint" in one_line(capsys) and not out.exists()


def test_a_blocked_switch_outside_the_classes_is_refused_before_the_fit(data, tmp_path, capsys):
    out = tmp_path / "r.pt"
    assert main(fit(data, None, out, "--blocked-switches", "1:2,0:99")) == 1
    assert "blocked switch 0:99 names a class outside 0..7: pass --blocked-switches" in one_line(
        capsys
    )
    assert not out.exists() and not (tmp_path / "r.train.pt").exists()


def test_labels_are_read_as_the_base_was_trained(data, tmp_path, capsys):
    """A base trained with --data.label_map 200:2: the fit reads class 2 from raw 200 too;
    without that mapping the raw 200 pixels are no class, refused in one line."""
    root = Path(shutil.copytree(data, tmp_path / "raw"))
    for path in (root / "labels").glob("*.png"):
        label = np.array(Image.open(path))
        label[label == 2] = 200
        Image.fromarray(label).save(path)
    config = {"data": {"preset": "synthetic", "label_map": "200:2"}}
    mapped = write_synthetic_checkpoint(
        tmp_path / "mapped.pt", config=config, label_contract=synthetic_contract({200: 2})
    )
    out = tmp_path / "r.pt"
    assert main(fit(root, mapped, out)) == 0
    err = capsys.readouterr().err
    assert "labels read as" in err and "data.label_map 200:2" in err
    assert main(fit(root, mapped, tmp_path / "raw.pt", "--label-map", "none")) == 1
    assert "200" in one_line(capsys)
    # a resume reads the labels as the fit it continues did, or is refused
    again = fit(root, mapped, out, "--resume", "--steps", "3", "--label-map", "200:2,7:0")
    assert main(again) == 1
    assert "labels:" in one_line(capsys)


def test_a_fit_that_never_draws_a_triplet_is_refused(data, tmp_path, capsys):
    flat = Path(shutil.copytree(data, tmp_path / "flat"))
    for path in (flat / "labels").glob("*.png"):  # one class everywhere: no boundary
        Image.fromarray(np.zeros_like(np.array(Image.open(path)))).save(path)
    out = tmp_path / "r.pt"
    assert main(fit(flat, None, out)) == 1
    assert "no triplet could be drawn in 2 steps" in one_line(capsys)
    assert not out.exists()


def test_overwrite_drops_the_replaced_fits_state_only_once_every_input_is_checked(
    data, tmp_path, capsys
):
    out = tmp_path / "r.pt"
    assert main(fit(data, None, out)) == 0
    state = tmp_path / "r.train.pt"
    kept = state.read_bytes()
    # a typo found before the fit: the earlier fit's state is still there to resume
    assert main(fit(data, None, out, "--overwrite", "--label-map", "3-2")) == 1
    assert "label map entry" in one_line(capsys) and state.read_bytes() == kept
    # once the new fit starts, the replaced fit's state is gone (a stop before the new fit's
    # first save leaves none for a later --resume to continue): here it is the new fit's
    from dualseg.refine.formats import TRAIN_FORMAT, load_state

    assert main(fit(data, None, out, "--overwrite", "--steps", "1")) == 0
    assert load_state(state, TRAIN_FORMAT, "state")["step"] == 1


def test_apply_with_a_probability_folder_checks_every_image_first(data, base, tmp_path, capsys):
    images = sorted((data / "images").glob("val_*.png"))
    probs = tmp_path / "probs"
    assert main(["predict", str(images[0]), "-c", str(base), "--probs", "-o", str(probs)]) == 0
    refiner = tmp_path / "r.pt"
    assert main(fit(data, None, refiner)) == 0
    capsys.readouterr()
    out = tmp_path / "applied"
    argv = ["refine", "apply", "--refiner", str(refiner), "--base", str(probs), "--out", str(out)]
    assert main([*argv, *map(str, images)]) == 1
    assert "no probabilities for image" in one_line(capsys)
    assert not out.exists() or not any(out.rglob("*.png"))  # nothing half-written
    # the stored source is the resolved path: found from any working folder
    stored = np.load(probs / "probs" / f"{images[0].stem}.npz")["source"]
    assert Path(str(stored)).is_absolute()


def test_a_refiner_calibrated_on_another_base_is_said(data, base, tmp_path, capsys):
    import torch

    from dualseg.engine.checkpoint import load_checkpoint, save_checkpoint

    dev = Path(shutil.copytree(data, tmp_path / "dev"))
    lines = (dev / "train.txt").read_text().splitlines(keepends=True)  # dev carved from train
    (dev / "train.txt").write_text("".join(lines[:-2]))
    (dev / "dev.txt").write_text("".join(lines[-2:]))
    refiner = tmp_path / "r.pt"
    assert main(fit(dev, base, refiner, "--calibrate-split", "dev")) == 0
    digests = BoundaryRefiner.load(refiner).calibration["image_digests"]  # eval finds them so
    assert len(digests) == 2 and len(set(digests)) == 2
    state = {k: v for k, v in load_checkpoint(base).items() if not k.startswith("_")}
    state["model"] = {
        k: v + 0.01 if torch.is_floating_point(v) else v for k, v in state["model"].items()
    }
    other = save_checkpoint(tmp_path / "other.pt", state)
    capsys.readouterr()
    argv = ["eval", "--data", str(dev), "--refiner", str(refiner), "--quiet"]
    assert main([*argv, "-c", str(base), "--out", str(tmp_path / "e1")]) == 0
    assert "another base model" not in capsys.readouterr().err
    assert main([*argv, "-c", str(other), "--out", str(tmp_path / "e2")]) == 0
    assert "were chosen on another base model than this one" in capsys.readouterr().err
    # overriding Top-N at apply: the calibration ran at the stored value, and Top-1 is a no-op
    image = sorted((dev / "images").iterdir())[0]
    apply = ["refine", "apply", str(image), "-r", str(refiner), "-b", str(base), "--quiet"]
    assert main([*apply, "-o", str(tmp_path / "a"), "--top-n", "1", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "decision options were chosen on its calibration split at top_n 5" in err, err
    assert "Top-N 1 leaves each pixel one candidate" in err
    # more than the classes: every class is a candidate, said rather than cut without a word
    assert main([*apply, "-o", str(tmp_path / "b"), "--top-n", "50", "--device", "cpu"]) == 0
    classes = BoundaryRefiner.load(refiner).num_classes
    assert f"Top-N 50 is more than the {classes} classes" in capsys.readouterr().err


STRIPES = """import torch

class Stripes(torch.nn.Module):  # 8 vertical stripes, one per synthetic class
    def forward(self, x):
        n, _, h, w = x.shape
        cls = torch.arange(w) * 8 // w
        return 4.0 * torch.nn.functional.one_hot(cls, 8).T[None, :, None].expand(n, 8, h, w)

model = Stripes()
"""


def test_eval_and_apply_set_the_decision_for_one_run(data, tmp_path, capsys) -> None:
    """Comparing decisions on one's own data needs no copy of the refiner: eval and apply take
    the decision flags for one run, say them in metrics.json, and refuse a bad value or a flag
    with nothing to set in one line."""
    import json

    refiner, stripes = tmp_path / "r.pt", tmp_path / "stripes.py"
    assert main(fit(data, None, refiner, "--gate-margin", "none")) == 0  # spelt as eval takes it
    stripes.write_text(STRIPES)  # a base with boundaries to refine (the checkpoint has none)
    argv = ["eval", "-c", f"{stripes}:model", "--data", str(data), "--quiet", "--refiner"]
    argv.append(str(refiner))

    def scored(name: str, *flags: str) -> dict:
        assert main([*argv, "--out", str(tmp_path / name), *flags]) == 0
        return json.loads((tmp_path / name / "metrics.json").read_text())

    stored, never = (
        scored("stored"),
        scored("never", "--switch-cost", "1e6", "--gate-margin", "none"),
    )
    assert stored["refiner_options"]["switch_cost"] == 0.0 and stored["refine"]["changed"] > 0
    assert never["refiner_options"] | {"switch_cost": 0.0} == stored["refiner_options"]
    assert never["refine"]["changed"] == 0 and never["refined"]["miou"] == never["miou"]
    assert BoundaryRefiner.load(refiner).config.switch_cost == 0.0  # the file is not changed
    every = ",".join(f"{a}:{b}" for a in range(8) for b in range(8) if a != b)
    blocked = scored("blocked", "--blocked-switches", every)  # no switch left: nothing changes
    assert len(blocked["refiner_options"]["blocked_switches"]) == 56
    assert blocked["refine"]["changed"] == 0
    one = scored("top1", "--top-n", "1", "--radius", "3")  # on eval as on apply
    assert one["refiner_options"]["radius"] == 3 and one["refine"]["changed"] == 0
    assert "Top-N 1 leaves each pixel one candidate" in capsys.readouterr().err
    # the notes come after the checks: a refused pair gets its one line and nothing before it
    other = Path(shutil.copytree(data, tmp_path / "renamed"))
    meta = json.loads((other / "meta.json").read_text())
    meta["class_names"][-1] = "signs"
    (other / "meta.json").write_text(json.dumps(meta))
    assert "class names" in refused([*argv[:4], str(other), *argv[5:], "--top-n", "1"], capsys)
    capsys.readouterr()
    for flags, said in (
        (["--switch-cost", "-1"], "argument --switch-cost: must be >= 0 and finite, got -1"),
        (["--gate-margin", "2"], "argument --gate-margin: must be in [0, 1] or None, got 2"),
        (["--blocked-switches", "1-4"], "argument --blocked-switches: expected A:B pairs"),
        (
            ["--blocked-switches", "0:8"],
            "blocked switch 0:8 names a class outside 0..7: pass --blocked-switches pairs of",
        ),
    ):
        assert said in refused([*argv, "--out", str(tmp_path / "bad"), *flags], capsys)
    assert main([*argv[:6], "--min-prob", "0.2", "--out", str(tmp_path / "no")]) == 1
    assert "--min-prob set a method-B refiner's options: pass --refiner" in one_line(capsys)
    image = str(sorted((data / "images").iterdir())[0])
    apply = ["refine", "apply", image, "-b", f"{stripes}:model", "--quiet", "--device", "cpu"]
    assert (
        main([*apply, "-r", str(refiner), "-o", str(tmp_path / "a"), "--switch-cost", "1e6"]) == 0
    )
    assert "0 pixels changed" in capsys.readouterr().out
    assert main([*apply, "--crf", "-o", str(tmp_path / "c"), "--prior-weight", "1"]) == 1
    assert "--prior-weight set method B's refiner; --crf has none" in one_line(capsys)


@pytest.mark.skipif(
    importlib.util.find_spec("pydensecrf") is None, reason="pydensecrf2 not installed"
)
def test_eval_scores_dense_crf_beside_the_base(data, tmp_path, capsys) -> None:
    """``eval --crf``: the baseline scored on one's own labelled images, as method B is."""
    import json

    stripes = tmp_path / "stripes.py"
    stripes.write_text(STRIPES)
    argv = ["eval", "-c", f"{stripes}:model", "--data", str(data), "--quiet", "--crf"]
    assert main([*argv, "--out", str(tmp_path / "crf")]) == 0
    m = json.loads((tmp_path / "crf" / "metrics.json").read_text())
    assert m["crf"]["iterations"] == 5 and m["refiner"] is None and m["refiner_options"] is None
    assert m["refine"]["changed"] > 0 and m["refined"]["miou"] != m["miou"]
    assert "--switch-cost set method B's refiner; --crf has none" in refused(
        [*argv, "--switch-cost", "0.1"], capsys
    )
    said = refused([*argv, "--refiner", "r.pt"], capsys)
    assert "--refiner: not allowed with argument --crf" in said


def test_the_same_seed_fits_the_same_refiner(data, base, tmp_path) -> None:
    """--seed drew the batches and triplets but not the network's first weights: two runs of
    one command gave refiners that disagreed on a third of an image's pixels."""
    import torch

    def state(out: Path) -> dict:
        return torch.load(out, map_location="cpu", weights_only=True)

    a, b, c = (tmp_path / f"{k}.pt" for k in "abc")
    for out, seed in ((a, "3"), (b, "3"), (c, "4")):
        assert main(fit(data, base, out, "--seed", seed)) == 0
    first, again, other = state(a), state(b), state(c)
    same = [torch.equal(first["model"][k], again["model"][k]) for k in first["model"]]
    assert all(same) and torch.equal(first["prototypes"], again["prototypes"])
    assert not torch.equal(first["prototypes"], other["prototypes"])


def test_apply_outputs_are_no_inputs_and_a_failed_image_leaves_no_stale_outputs(
    data, base, tmp_path, capsys
) -> None:
    refiner = tmp_path / "r.pt"
    assert main(fit(data, base, refiner)) == 0
    inputs = tmp_path / "q"
    inputs.mkdir()
    for name in ("a", "b"):
        shutil.copy(
            data / "images" / f"val_0000{'0' if name == 'a' else '1'}.png", inputs / f"{name}.png"
        )
    out = inputs / "out"  # inside the inputs: its folders are never inputs
    apply = ["refine", "apply", str(inputs), "-r", str(refiner), "-b", str(base), "-o", str(out)]
    apply += ["--device", "cpu", "-q"]
    assert main(apply) == 0
    # predict into the same folder does not read refine apply's changed/ masks as images
    predict = ["predict", str(inputs), "-c", str(base), "-o", str(out), "--overwrite", "-q"]
    assert main(predict) == 0
    assert sorted(
        p.relative_to(out / "labels").as_posix() for p in (out / "labels").rglob("*.png")
    ) == [
        "a.png",
        "b.png",
    ]
    # an image that can no longer be read: its earlier outputs go, they would look current
    (inputs / "b.png").write_bytes((inputs / "b.png").read_bytes()[:100])
    capsys.readouterr()
    assert main([*apply, "--overwrite"]) == 1
    assert "1 of 2 input image(s) could not be read" in capsys.readouterr().err
    for folder in ("labels", "color", "overlay", "changed"):
        assert (out / folder / "a.png").is_file() and not (out / folder / "b.png").exists()


def test_a_collapsed_embedding_is_said(data, tmp_path, caplog) -> None:
    """Two steps from random weights: all prototypes within 1e-6 of each other, and the
    refiner relabelled a fifth of an image on rounding noise, without a word."""
    with caplog.at_level("WARNING", logger="dualseg.refine.fit"):
        assert main(fit(data, None, tmp_path / "r.pt")) == 0
    said = [r.getMessage() for r in caplog.records if "coincide" in r.getMessage()]
    assert said and "the embedding has collapsed" in said[0] and "--steps" in said[0]
