"""Mistakes a user makes on the command line: one line naming the value and the fix, nothing
written over that should not be (a dataset, a model, an earlier result), no traceback."""

from __future__ import annotations

import shutil

import pytest
import torch
from cli_argv import TINY, fit_argv, md5, train_argv

from dualseg.cli import main as cli_main
from dualseg.data import make_synthetic_dataset
from reliability_helpers import refused, tree


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--model.renet_layers", "5", "renet_layers"),
        ("--model.renet_hidden", "0", "renet_hidden"),
        ("--model.fusion", "foo", "fusion"),
        ("--model.coord_radius", "foo", "coord_radius"),
        ("--model.upsample_order", "foo", "upsample_order"),
        ("--model.aspp_rates", "[0, 2]", "aspp_rates"),
        ("--model.gray_conv_init", "foo", "gray_conv_init"),
        ("--model.renet_patch", "0", "renet_patch"),
    ],
)
def test_a_bad_model_value_is_one_line_before_any_output(files, capsys, flag, value, named):
    out = files["root"] / f"run_{named}"
    line = refused(train_argv(files, out, flag, value), capsys)
    assert f"model.{named}" in line and value.strip("[]").split(",")[0] in line
    assert not out.exists()


def test_a_config_section_that_is_not_a_mapping_is_one_line(files, capsys) -> None:
    bad = files["root"] / "scalar.yaml"
    bad.write_text("data: 5\n")
    line = refused(["train", "--config", str(bad)], capsys)
    assert "'data'" in line and "mapping" in line


def test_resume_needs_a_training_checkpoint_with_iterations_left(files, capsys) -> None:
    # weights alone (what write_synthetic_checkpoint writes) cannot be resumed
    line = refused(train_argv(files, files["root"] / "r1", "--resume", str(files["ckpt"])), capsys)
    assert "training state" in line and "last.pt" in line
    run = files["root"] / "r2"
    assert cli_main(train_argv(files, run, "--train.max_iters", "2")) == 0
    config = (run / "config.yaml").read_text()
    line = refused(
        train_argv(files, run, "--resume", str(run / "last.pt"), "--train.max_iters", "1"), capsys
    )
    assert "iteration 2" in line and "--train.max_iters 2" in line
    assert (run / "config.yaml").read_text() == config  # the run's record is unchanged


def test_a_dualseg_checkpoint_as_backbone_weights_says_what_it_is(files, capsys) -> None:
    line = refused(
        train_argv(files, files["root"] / "w", "--model.weights", str(files["ckpt"])), capsys
    )
    assert "not backbone weights" in line and "--resume" in line and "--init-backbone" in line


def test_eval_keeps_an_earlier_evaluation_unless_overwrite(files, capsys) -> None:
    out = files["root"] / "eval"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "-o", str(out),
            "--device", "cpu", "-q"]  # fmt: skip
    assert cli_main(argv) == 0
    first = md5(out / "metrics.json")
    capsys.readouterr()
    line = refused(argv, capsys)
    assert "metrics.json" in line and "--overwrite" in line
    assert md5(out / "metrics.json") == first
    assert cli_main([*argv, "--overwrite"]) == 0
    # the default folder: a sliding-window evaluation sits beside the plain one
    plain = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "--device", "cpu"]
    assert cli_main([*plain, "-q"]) == 0 and cli_main([*plain, "-q", "--mode", "slide"]) == 0
    assert (files["ckpt"].parent / "eval_val_model" / "metrics.json").is_file()
    assert (files["ckpt"].parent / "eval_val_model_slide" / "metrics.json").is_file()
    # a run's best.pt and last.pt: each its own default folder, neither refused
    run = files["root"] / "run_pair"
    run.mkdir()
    for name in ("best.pt", "last.pt"):
        shutil.copy(files["ckpt"], run / name)
        argv = ["eval", "-c", str(run / name), "--data", str(files["data"]), "--device", "cpu"]
        assert cli_main([*argv, "-q"]) == 0
    assert (run / "eval_val" / "metrics.json").is_file()
    assert (run / "eval_val_last" / "metrics.json").is_file()


def test_export_refuses_an_opset_this_torch_cannot_write(files, capsys, tmp_path) -> None:
    pytest.importorskip("onnx")
    out = tmp_path / "m.onnx"
    argv = ["export", "-c", str(files["ckpt"]), "--out", str(out), "--size", "32", "32"]
    line = refused([*argv, "--opset", "99"], capsys)
    assert "opset must be in" in line and "99" in line
    assert refused([*argv, "--tolerance", "-1"], capsys).endswith("got -1.0")
    assert not out.exists()


def test_export_removes_an_export_that_fails_its_verification(files, capsys, tmp_path, monkeypatch):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import dualseg.export.export as export_module

    monkeypatch.setattr(export_module, "verify_export", lambda *a, **k: 0.5)
    out = tmp_path / "m.onnx"
    argv = ["export", "-c", str(files["ckpt"]), "--out", str(out), "--size", "32", "32"]
    line = refused(argv, capsys)
    assert "above --tolerance" in line and "removed" in line
    assert not out.exists()
    out.write_bytes(b"an earlier export")
    line = refused([*argv, "--overwrite"], capsys)
    assert out.read_bytes() == b"an earlier export" and sorted(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("flag", ["--max-upload-mb", "--max-megapixels", "--work-megapixels"])
def test_serve_refuses_limits_that_are_not_finite(files, capsys, flag) -> None:
    line = refused(["serve", "-c", str(files["ckpt"]), flag, "nan"], capsys)
    assert "finite" in line


def test_augment_checks_the_list_name_and_a_smaller_count(files, capsys, tmp_path) -> None:
    argv = ["augment", str(files["data"]), str(tmp_path / "aug"), "--crop-size", "16", "16", "-q"]
    for name in ("../escaped.txt", "augment.json", "list"):
        line = refused([*argv, "--count", "2", "--list-name", name], capsys)
        assert "--list-name" in line and ".txt" in line
    assert tree(tmp_path) == []
    assert cli_main([*argv, "--count", "3"]) == 0
    line = refused([*argv, "--count", "2"], capsys)
    assert "up to number 2" in line and "--count 3" in line
    (tmp_path / "aug" / "labels" / "000000.png").unlink()  # a gap, as an interrupted run leaves
    line = refused([*argv, "--count", "2"], capsys)
    assert "--count 3" in line
    assert len((tmp_path / "aug" / "train.txt").read_text().splitlines()) == 3


def test_train_messages_name_a_flag_once(tmp_path, capsys) -> None:
    # the data layer names --layout; each command's error line names its own spelling, once
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(
        ["train", "--data.root", str(empty), "--train.out_dir", str(tmp_path / "r")], capsys
    )
    assert line.count("--data.layout") == 1 and "--layout" not in line.replace("--data.layout", "")
    line = refused(["data", "check", str(empty)], capsys)
    assert line.count("--layout") == 1 and "--data.layout" not in line


def test_a_config_key_left_blank_is_one_line_naming_it(files, capsys) -> None:
    blank = files["root"] / "blank.yaml"
    blank.write_text(TINY.read_text().replace("max_iters: 6", "max_iters:"))
    assert "max_iters:\n" in blank.read_text()
    out = files["root"] / "run_blank"
    line = refused(train_argv(files, out, "--config", str(blank)), capsys)
    assert "train.max_iters has no value" in line and "leave the key out" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--data.train_split", ""], "empty name"),
        (["--data.val_split", " "], "empty name"),
        (["--train.seed", "-1"], "train.seed must be in 0..4294967295"),
    ],
)
def test_an_empty_split_or_a_negative_seed_is_refused(files, capsys, flags, named) -> None:
    out = files["root"] / f"run_{len(named)}"
    assert named in refused(train_argv(files, out, *flags), capsys)
    assert not out.exists()


def test_an_empty_split_name_reads_no_split_in_any_command(files, capsys) -> None:
    """ "" once read the flat images of every split: training and validation images mixed."""
    out = files["root"] / "eval_empty"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "--split", "",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert "empty name" in refused(argv, capsys)
    assert not (out / "metrics.json").exists()
    # data check too: it counted every split's images as one split and exited 0
    assert "empty name" in refused(["data", "check", str(files["data"]), "--split", ""], capsys)


def test_a_crop_larger_than_any_image_side_is_refused_before_writing(files, capsys, tmp_path):
    out = tmp_path / "aug"
    argv = ["augment", str(files["data"]), str(out), "--count", "2", "-q"]
    line = refused([*argv, "--crop-size", "100000", "100000"], capsys)  # 120 GB: a traceback
    assert "--crop-size 100000 100000" in line and "from 1 to 8192 pixels" in line
    assert not out.exists()
    line = refused(
        train_argv(files, files["root"] / "run_crop", "--data.crop_size", "[9000, 9]"), capsys
    )
    assert "data.crop_size" in line and "8192" in line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--val-split", "train"], "--val-split does not apply to the synthetic data"),
        (["--seed", "-1"], "--seed must be in"),
        (["--threads", "-3"], "--threads: must be >= 0"),
        (["--threads", "100000"], "--threads: must be at most 1024"),  # OpenMP fails otherwise
        (["--workers", "-1"], "--workers must be >= 0"),
        (["--n-show", "-1"], "--n-show must be >= 0 (got -1)"),  # once: exit 0, no panel
        (["--refine-prototypes", "0"], "--refine-prototypes must be >= 1"),
        (["--lr", "inf"], "optim.lr must be > 0 and finite"),  # exit 0 and NaN weights
        (["--arch", "deeplabv3_mobilenet_v2", "--renet-layers", "7"], "--renet-layers applies"),
    ],
)
def test_demo_refuses_before_writing(files, capsys, flags, named) -> None:
    out = files["root"] / f"demo_{flags[0].strip('-')}"
    argv = ["demo", "--n-train", "2", "--n-val", "2", "--size", "32", "48", "--iters", "1",
            "--batch-size", "2", "--weights", "none", "--quiet", "--out", str(out)]  # fmt: skip
    argv += flags
    assert named in refused(argv, capsys)
    assert not out.exists()


def test_a_raw_value_both_ignored_and_mapped_is_refused(files, capsys) -> None:
    argv = ["data", "check", str(files["data"]), "--label-map", "255:1", "--ignore-index", "255",
            "--quiet"]  # fmt: skip
    assert "both the ignore value" in refused(argv, capsys)


@pytest.mark.parametrize(
    ("fmt", "flags"),
    [
        ("pretrained", ["--output", "probs"]),
        ("pretrained", ["--size", "64", "64"]),
        ("torchscript", ["--opset", "17"]),
        ("torchscript", ["--exporter", "dynamo"]),
    ],
)
def test_an_export_option_the_format_does_not_read_is_refused(files, capsys, fmt, flags):
    out = files["root"] / f"export_{fmt}_{flags[0].strip('-')}"
    argv = ["export", "-c", str(files["ckpt"]), "--format", fmt, "--out", str(out), *flags]
    line = refused(argv, capsys)
    assert f"{flags[0]} does not apply to --format {fmt}" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("train:\n  max_iters: 3\n   lr: [1\n", "is not valid YAML (line 3"),
        ("", "is empty"),
        ("trian:\n  max_iters: 3\n", "(line 1): unknown config section trian; did you mean train?"),
        # PyYAML keeps the last of a repeated key silently; the file's reader may see the first
        ("optim:\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.01\n", "key 'lr' is written twice"),
        ("train:\n  max_iters: 3\ntrain:\n  seed: 1\n", "'train' is written twice (lines 1"),
    ],
)
def test_a_bad_second_config_file_is_named(files, capsys, text, said) -> None:
    bad = files["root"] / f"second_{len(text)}.yaml"
    bad.write_text(text)
    line = refused(train_argv(files, files["root"] / "run_second", "--config", str(bad)), capsys)
    assert said in line and bad.name in line


def test_an_infinite_learning_rate_in_a_config_file_is_refused(files, capsys) -> None:
    """YAML's .inf passed "lr > 0": a 1-iteration run ended "done" with every weight NaN."""
    for key in ("lr", "head_lr_mult"):
        config = files["root"] / f"inf_{key}.yaml"
        config.write_text(f"optim:\n  {key}: .inf\n")
        out = files["root"] / f"run_inf_{key}"
        line = refused(
            train_argv(files, out, "--config", str(config), "--train.max_iters", "1"), capsys
        )
        assert f"optim.{key} must be > 0 and finite" in line
        assert not out.exists()
    line = refused(fit_argv(files, "--lr", "inf", "--out", str(files["root"] / "inf.pt")), capsys)
    assert "lr must be > 0 and finite, got inf" in line
    assert not (files["root"] / "inf.pt").exists()


def test_an_image_or_a_checkpoint_as_config_is_one_line(files, capsys) -> None:
    """Bytes that are not UTF-8 once escaped as a UnicodeDecodeError traceback."""
    image = sorted((files["data"] / "images").iterdir())[0]
    for wrong in (image, files["ckpt"]):
        line = refused(["train", "--config", str(wrong)], capsys)
        assert f"{wrong} is not a YAML text file" in line and "pass a config file" in line
        out = files["root"] / "run_binary_config"
        line = refused(train_argv(files, out, "--config", str(wrong)), capsys)
        assert f"{wrong} is not a YAML text file" in line and not out.exists()


@pytest.mark.parametrize("size", [["4", "64"], ["100000", "100000"]])
def test_an_export_size_out_of_range_is_one_line(files, capsys, size) -> None:
    out = files["root"] / f"size_{size[0]}.onnx"
    argv = ["export", "-c", str(files["ckpt"]), "--format", "onnx", "--out", str(out), "--size"]
    line = refused([*argv, *size], capsys)  # 100000x100000 ran out of memory: a traceback
    assert f"--size must be between 8x8 and 8192x8192, got {size[0]}x{size[1]}" in line
    assert not out.exists()


def test_a_flag_a_later_config_sets_again_is_refused_not_dropped(files, capsys) -> None:
    """jsonargparse lets the later --config win: --train.out_dir runs/new before --config
    keep.yaml trained (with --overwrite: over) keep.yaml's run folder, not runs/new."""
    keep = files["root"] / "keep.yaml"
    kept_run = files["root"] / "kept_run"
    keep.write_text(f"train:\n  out_dir: {kept_run}\n")
    new = files["root"] / "new_run"
    argv = ["train", "--config", str(TINY), "--data.root", str(files["data"]),
            "--train.out_dir", str(new), "--overwrite", "--config", str(keep)]  # fmt: skip
    line = refused(argv, capsys)
    assert f"--train.out_dir comes before --config {keep}, which sets train.out_dir" in line
    assert "put --config first" in line
    assert not new.exists() and not kept_run.exists()
    # a section's own file (--train FILE), and shortened flags, pass the same checks
    section = files["root"] / "train_section.yaml"
    section.write_text(f"out_dir: {kept_run}\n")
    head = ["train", "--config", str(TINY), "--data.root", str(files["data"])]
    line = refused([*head, "--train.out_dir", str(new), "--train", str(section)], capsys)
    assert f"--train.out_dir comes before --train {section}" in line
    twice = files["root"] / "optim_twice.yaml"
    twice.write_text("lr: 0.1\nlr: 0.001\n")
    assert "key 'lr' is written twice" in refused([*head, "--optim", str(twice)], capsys)
    assert "unknown flag --conf; did you mean --config?" in refused(
        [*head, "--conf", str(keep)], capsys
    )
    assert "unknown flag --train.out_d;" in refused([*head, "--train.out_d", str(new)], capsys)
    assert not new.exists() and not kept_run.exists()
    # a flag the later config leaves alone still counts: nothing to refuse
    ok = files["root"] / "flag_first"
    argv = ["train", "--optim.momentum", "0.8", "--config", str(TINY), "--quiet",
            "--data.root", str(files["data"]), "--data.crop_size", "[32, 32]",
            "--train.max_iters", "1", "--train.out_dir", str(ok)]  # fmt: skip
    assert cli_main(argv) == 0 and (ok / "last.pt").is_file()
    assert "momentum: 0.8" in (ok / "config.yaml").read_text()


@pytest.mark.parametrize(
    ("section", "key", "value", "says"),
    [
        ("train", "min_delta", ".nan", "train.min_delta must be >= 0 and finite"),
        ("train", "min_delta", "-1", "train.min_delta must be >= 0 and finite"),
        ("optim", "weight_decay", ".inf", "optim.weight_decay must be >= 0 and finite"),
        ("optim", "l2_lambda", ".inf", "optim.l2_lambda must be >= 0 and finite"),
        ("optim", "poly_power", ".inf", "optim.poly_power must be >= 0 and finite"),
        ("model", "renet_init_bound", ".nan", "renet_init_bound must be > 0 and finite"),
        ("model", "aspp_init_std", ".nan", "aspp_init_std >= 0 and finite"),
    ],
)
def test_yaml_infinities_and_nans_are_refused_before_any_output(
    files, capsys, section, key, value, says
) -> None:
    """YAML's .nan / .inf pass a plain >= 0: NaN min_delta stopped an improving run early,
    an infinite poly power trained at LR 0, an infinite L2 blamed the LR, a NaN init bound
    was a traceback."""
    extra = files["root"] / f"{key}_{value}.yaml"
    extra.write_text(f"{section}:\n  {key}: {value}\n")
    out = files["root"] / f"run_{key}_{value}"
    line = refused(train_argv(files, out, "--config", str(extra)), capsys)
    assert says in line and not out.exists()


def test_nan_class_weights_are_refused_by_name(files, capsys) -> None:
    out = files["root"] / "run_nan_weights"
    weights = "[.nan, 1, 1, 1, 1, 1, 1, 1]"
    line = refused(train_argv(files, out, "--optim.class_weights", weights), capsys)
    assert "class_weights" in line and "NaN or infinite" in line


@pytest.mark.parametrize(
    ("key", "value"),
    [("iteration", "abc"), ("optimizer", []), ("sampler", {}), ("rng", {}), ("config", "x")],
)
def test_resuming_from_a_damaged_training_checkpoint_is_one_line(files, capsys, key, value):
    run = files["root"] / "damaged_src"
    if not (run / "last.pt").is_file():
        assert cli_main(train_argv(files, run, "--train.max_iters", "1")) == 0
    state = torch.load(run / "last.pt", weights_only=True)
    state[key] = value
    damaged = files["root"] / f"damaged_{key}.pt"
    torch.save(state, damaged)
    out = files["root"] / f"resumed_{key}"
    argv = train_argv(files, out, "--resume", str(damaged), "--train.max_iters", "2")
    line = refused(argv, capsys)
    assert f"{damaged} is a damaged training checkpoint" in line
    assert not out.exists()


def test_eval_of_a_list_file_scores_and_names_that_split(files, capsys, tmp_path) -> None:
    """--data train.txt scored the training images and wrote them down as val."""
    import json

    out = tmp_path / "e"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"] / "train.txt"),
            "--device", "cpu", "-q"]  # fmt: skip
    assert cli_main([*argv, "-o", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split"] == "train" and metrics["num_images"] == 2
    capsys.readouterr()  # the random model's warnings (one class everywhere)
    line = refused([*argv, "--split", "val", "-o", str(tmp_path / "e2")], capsys)
    assert "train.txt is one split, 'train'; drop --split val" in line
    assert not (tmp_path / "e2").exists()


def test_a_list_file_and_another_split_are_refused_by_every_command(files, capsys, tmp_path):
    """--data val.txt --split train: refine fit and augment used val's images as train, and
    data check reported them as train, without a word (eval already refused it)."""
    val = str(files["data"] / "val.txt")
    out = tmp_path / "out"
    for argv, flag in [
        (["refine", "fit", *fit_argv(files, "--out", str(out / "r.pt"))[2:]], "--data"),
        (["augment", val, str(out / "aug"), "--count", "1"], "SRC"),
        (["data", "check", val, "--split", "val", "--split", "train"], "ROOT"),
    ]:
        if argv[0] == "refine":
            argv[argv.index("--data") + 1] = val
        argv += [] if argv[0] == "data" else ["--split", "train"]
        line = refused(argv, capsys)
        assert f"{flag} {val} is one split, 'val'; drop --split train" in line, argv[0]
    assert not out.exists()
    # without --split, the list file names its split
    assert cli_main(["augment", val, str(out / "aug"), "--count", "1", "-q"]) == 0
    record = out / "aug" / "augment.json"
    assert '"split": "val"' in record.read_text()
    assert cli_main(["augment", val, str(out / "aug"), "--count", "2", "-q"]) == 0  # resumes


def test_eval_amp_on_the_cpu_is_ignored_as_its_help_says(files, tmp_path) -> None:
    import json

    out = tmp_path / "e"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "--device", "cpu",
            "-q", "--amp", "-o", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    assert json.loads((out / "metrics.json").read_text())["amp"] is False


def test_eval_warns_when_an_ignore_value_takes_a_class_out_of_the_score(files, capsys, tmp_path):
    """--ignore-index 3 made class 3's pixels ignore: mIoU averaged 7 of 8 classes, unsaid."""
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(files["data"]), "--device", "cpu",
            "-q", "-o", str(tmp_path / "e"), "--ignore-index", "3"]  # fmt: skip
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: no raw label value means class 3 'sidewalk'" in err
    assert cli_main([*argv[:-2], "-o", str(tmp_path / "e2")]) == 0
    assert "no raw label value" not in capsys.readouterr().err


def test_eval_finds_a_mixed_size_batch_before_it_writes_a_prediction(files, capsys, tmp_path):
    """The batch of mixed sizes failed at its turn, after the predictions before it were
    written: the rerun with --batch-size 1 was then refused for the existing files."""
    from PIL import Image

    data = make_synthetic_dataset(tmp_path / "d", n_train=1, n_val=3, size=(32, 48))
    last = sorted((data / "images").glob("val_*.png"))[-1]
    Image.open(last).resize((40, 32)).save(last)
    label = data / "labels" / last.name
    Image.open(label).resize((40, 32), Image.NEAREST).save(label)
    preds = tmp_path / "preds"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(data), "--device", "cpu", "-q",
            "-o", str(tmp_path / "e"), "--save-predictions", str(preds)]  # fmt: skip
    line = refused([*argv, "--batch-size", "3"], capsys)
    assert "two images of one batch differ in size (48x32 and 40x32 px" in line
    assert last.name in line and "--batch-size 1" in line
    assert not preds.exists() and not (tmp_path / "e").exists()
    assert cli_main([*argv, "--batch-size", "1"]) == 0


def test_eval_reads_every_label_before_it_writes_a_prediction(files, capsys, tmp_path):
    """A bad label found at its turn left the predictions before it written: the corrected
    rerun was then refused for the existing files."""
    import numpy as np
    from PIL import Image

    data = make_synthetic_dataset(tmp_path / "d", n_train=1, n_val=3, size=(32, 48))
    last = sorted((data / "labels").glob("val_*.png"))[-1]
    Image.fromarray(np.full((32, 48), 200, np.uint8)).save(last)  # no class, not ignore
    preds = tmp_path / "preds"
    argv = ["eval", "-c", str(files["ckpt"]), "--data", str(data), "--device", "cpu", "-q",
            "-o", str(tmp_path / "e"), "--save-predictions", str(preds)]  # fmt: skip
    line = refused(argv, capsys)
    assert last.name in line and "200" in line
    assert not preds.exists() and not (tmp_path / "e").exists()
