"""``dualseg export`` never replaces its own input, and replaces an earlier export only with
``--overwrite``, for every format; each refusal is one line and writes nothing."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from dualseg.cli import main
from dualseg.refine import BoundaryRefiner, RefinerConfig, build_embedding_net


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    """A private copy of the session checkpoint (a failing test must not damage the shared one)."""
    return Path(shutil.copy(checkpoint, tmp_path / "last.pt"))


@pytest.fixture
def refiner_file(tmp_path) -> Path:
    torch.manual_seed(0)
    cfg = RefinerConfig(embed_dim=4)
    net = build_embedding_net(
        cfg.backbone,
        embed_dim=cfg.embed_dim,
        output_stride=cfg.output_stride,
        aspp_rates=cfg.aspp_rates,
    )
    refiner = BoundaryRefiner(
        net, torch.eye(3, 4), torch.ones(3, dtype=torch.bool), class_names="abc", config=cfg
    )
    return refiner.save(tmp_path / "refiner.pt")


@pytest.mark.parametrize("fmt", ["onnx", "torchscript", "pretrained"])
def test_export_onto_its_own_checkpoint_is_refused(ckpt, capsys, fmt) -> None:
    before = _digest(ckpt)
    line = _refused(["export", "-c", str(ckpt), "--format", fmt, "--out", str(ckpt)], capsys)
    assert f"would overwrite --checkpoint {ckpt}" in line and "choose another --out" in line
    assert _digest(ckpt) == before
    # --overwrite does not change that, nor does a path spelled differently
    other = ckpt.parent / "sub" / ".." / ckpt.name
    args = ["export", "-c", str(ckpt), "--format", fmt, "--out", str(other), "--overwrite"]
    assert "would overwrite --checkpoint" in _refused(args, capsys)
    assert _digest(ckpt) == before and sorted(p.name for p in ckpt.parent.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_onto_its_own_refiner_or_its_sidecar_is_refused(refiner_file, capsys, fmt):
    before = _digest(refiner_file)
    args = ["export", "--refiner", str(refiner_file), "--format", fmt, "--out", str(refiner_file)]
    assert "would overwrite --refiner" in _refused([*args, "--overwrite"], capsys)
    json_out = refiner_file.with_name("emb.json")  # the sidecar would replace the model
    args = ["export", "--refiner", str(refiner_file), "--format", fmt, "--out", str(json_out)]
    assert "sidecar" in _refused(args, capsys)
    assert _digest(refiner_file) == before
    assert [p.name for p in refiner_file.parent.iterdir()] == ["refiner.pt"]


def test_an_earlier_export_stays_whole_when_the_new_one_is_interrupted(ckpt, tmp_path, monkeypatch):
    """The export is built and checked in memory and written by one atomic rename, so a run
    stopped at any point before leaves the earlier export as it was, and no temporary file."""
    import dualseg.export.export as E

    out = tmp_path / "model.onnx"
    out.write_bytes(b"an earlier export")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a signal would stop it, the new export built

    monkeypatch.setattr(E, "verify_export", killed)
    args = ["export", "-c", str(ckpt), "--out", str(out), "--size", "32", "32", "--overwrite"]
    assert main(args) == 130  # "dualseg: interrupted"
    assert out.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "model.onnx"]  # none left


@pytest.mark.parametrize(("fmt", "suffix"), [("onnx", ".onnx"), ("torchscript", ".pt")])
def test_existing_out_needs_overwrite(ckpt, tmp_path, capsys, fmt, suffix) -> None:
    out = tmp_path / f"model{suffix}"
    out.write_bytes(b"an earlier export")
    args = ["export", "-c", str(ckpt), "--format", fmt, "--out", str(out), "--size", "32", "32"]
    line = _refused(args, capsys)
    assert str(out) in line and "--overwrite" in line
    assert out.read_bytes() == b"an earlier export"
    assert main([*args, "--overwrite", "--no-verify"]) == 0
    assert out.read_bytes() != b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", out.name]  # no temp file


def test_existing_refiner_sidecar_needs_overwrite(refiner_file, tmp_path, capsys) -> None:
    out, sidecar = tmp_path / "emb.pt", tmp_path / "emb.json"
    sidecar.write_text("{}")
    args = ["export", "--refiner", str(refiner_file), "--format", "torchscript", "--out", str(out)]
    line = _refused([*args, "--size", "32", "32"], capsys)
    assert str(sidecar) in line and "--overwrite" in line
    assert not out.exists() and sidecar.read_text() == "{}"
    assert main([*args, "--size", "32", "32", "--overwrite", "--no-verify"]) == 0
    assert out.exists() and sidecar.read_text() != "{}"


def test_export_never_writes_over_a_checkpoint_or_a_refiner(refiner_file, tmp_path, capsys):
    import shutil

    victim = shutil.copy(refiner_file, tmp_path / "victim.pt")  # another refiner, say
    kept = victim.read_bytes()
    args = ["export", "--refiner", str(refiner_file), "--format", "torchscript", "--out",
            str(victim), "--size", "32", "32", "--overwrite", "--no-verify"]  # fmt: skip
    line = _refused(args, capsys)
    assert f"--out {victim} is a dualseg file (dualseg-refiner/1)" in line
    assert victim.read_bytes() == kept and not (tmp_path / "victim.json").exists()


def test_a_pretrained_folders_refiner_json_is_never_a_sidecar(refiner_file, tmp_path, capsys):
    folder = tmp_path / "camvid-model"
    folder.mkdir()
    (folder / "refiner.json").write_text("{}")  # a pretrained refiner: json + safetensors
    (folder / "refiner.safetensors").write_bytes(b"weights")
    out = folder / "refiner.onnx"
    args = ["export", "--refiner", str(refiner_file), "--format", "onnx", "--out", str(out)]
    for extra in ([], ["--overwrite"]):  # not even with --overwrite
        line = _refused([*args, *extra], capsys)
        assert "pretrained folder" in line and "--overwrite" not in line
    assert (folder / "refiner.json").read_text() == "{}" and not out.exists()


@pytest.mark.parametrize(
    ("fmt", "name", "said"),
    [
        ("onnx", "model.pt", "name it {dir}/model.onnx"),  # later read as a corrupt .pt
        ("onnx", "model", "name it {dir}/model.onnx"),
        ("onnx", "model.v2", "name it {dir}/model.v2.onnx"),
        ("torchscript", "model.onnx", "name it {dir}/model.pt"),  # later taken for ONNX
    ],
)
def test_an_out_named_for_another_format_is_refused(ckpt, tmp_path, capsys, fmt, name, said):
    out = tmp_path / name
    args = ["export", "-c", str(ckpt), "--format", fmt, "--out", str(out), "--size", "32", "32"]
    line = _refused(args, capsys)
    assert f"--out {out}: --format {fmt}" in line and said.format(dir=tmp_path) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_a_folder_as_out_is_refused_in_one_line(ckpt, tmp_path, capsys, monkeypatch) -> None:
    """--out . once reached the suffix check's Path.with_suffix: a ValueError traceback."""
    monkeypatch.chdir(tmp_path)
    for out in (".", str(tmp_path)):
        args = ["export", "-c", str(ckpt), "--out", out, "--overwrite", "--size", "32", "32"]
        assert "is an existing folder" in _refused(args, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_export_model_leaves_the_callers_model_as_it_was_and_checks_the_names(tmp_path) -> None:
    """The Python export ran the caller's model into eval mode for good, and wrote a class-name
    list of another length than the model's outputs (refused only when the file was loaded)."""
    from dualseg.errors import ConfigError
    from dualseg.export.export import export_model
    from dualseg.models import build_model

    torch.manual_seed(0)
    model = build_model("deeplabv3_mobilenet_v2", num_classes=3).train()
    with pytest.raises(ConfigError, match="2 class names for a model with 3 classes"):
        export_model(model, tmp_path / "m.pt", class_names=["a", "b"], format="torchscript")
    assert not (tmp_path / "m.pt").exists()
    export_model(model, tmp_path / "m.pt", class_names="abc", format="torchscript")
    assert model.training and (tmp_path / "m.pt").is_file()


def test_output_probs_with_a_refiner_is_refused_not_ignored(refiner_file, capsys, tmp_path):
    out = tmp_path / "emb.onnx"
    argv = ["export", "--refiner", str(refiner_file), "--out", str(out), "--output", "probs"]
    line = _refused(argv, capsys)
    assert "--output probs applies to a --checkpoint export" in line and not out.exists()
