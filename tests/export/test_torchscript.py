"""TorchScript export: parity at two sizes (and an odd one), metadata in _extra_files."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from export_case import CLASS_NAMES, PALETTE

from dualseg.cli import main
from dualseg.errors import CheckpointError, ConfigError
from dualseg.export.runtime import ExportedSegmenter, OnnxSegmenter, read_export_info
from dualseg.serialization import TORCHSCRIPT_META


@pytest.fixture(scope="module")
def scripted(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ts") / "tiny.pt"
    args = ["export", "-c", str(checkpoint), "--format", "torchscript", "--out", str(out)]
    assert main([*args, "--dynamic", "--output", "probs", "--no-verify"]) == 0
    return out


def test_torchscript_matches_pytorch_at_several_sizes(scripted, torch_model):
    model, _ = torch_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated in 2.14
        loaded = torch.jit.load(str(scripted))
    for shape in [(1, 3, 64, 64), (2, 3, 64, 96), (1, 3, 41, 57)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            ref, got = model(x).softmax(1), loaded(x)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_torchscript_metadata(scripted):
    extra = {TORCHSCRIPT_META: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.load(str(scripted), _extra_files=extra)
    info = json.loads(extra[TORCHSCRIPT_META])
    assert info["class_names"] == CLASS_NAMES and info["palette"] == PALETTE
    assert info["output"] == "probs"
    assert read_export_info(scripted) == info  # read from the zip, without torch


def test_an_export_carries_its_training_images_digests_and_label_contract(checkpoint, tmp_path):
    """Checkpoints and pretrained folders kept the training images' content digests (eval
    warns on them); the exports dropped them."""
    from dualseg.data.contract import content_digests, digests_to_hex
    from dualseg.engine.checkpoint import load_checkpoint, save_checkpoint
    from dualseg.export.export import export_checkpoint

    image = tmp_path / "train.png"
    image.write_bytes(b"some training image")
    ckpt = load_checkpoint(checkpoint)
    ckpt["train_images"] = content_digests([image])
    save_checkpoint(tmp_path / "seen.pt", ckpt)
    export_checkpoint(tmp_path / "seen.pt", tmp_path / "seen.ts.pt", format="torchscript")
    info = read_export_info(tmp_path / "seen.ts.pt")
    assert info["train_images"] == digests_to_hex(content_digests([image]))
    contract = ExportedSegmenter(tmp_path / "seen.ts.pt").contract
    assert contract is not None and list(contract.class_names) == CLASS_NAMES


def test_exported_segmenter_runs_torchscript(scripted, torch_model):
    model, meta = torch_model
    from dualseg.engine.predict import Segmenter

    image = np.random.default_rng(0).integers(0, 256, (45, 61, 3), dtype=np.uint8)
    got = ExportedSegmenter(scripted).predict_proba(image)
    np.testing.assert_allclose(got, Segmenter(model, meta).predict_proba(image), atol=1e-4)
    with pytest.raises(CheckpointError, match="TorchScript file"):
        OnnxSegmenter(scripted)


def test_read_export_info_tells_a_checkpoint_and_a_foreign_torchscript_apart(tmp_path) -> None:
    ckpt = tmp_path / "ckpt.pt"  # torch.save: a zip archive, but not TorchScript
    torch.save({"model": {"w": torch.zeros(1)}}, ckpt)
    with pytest.raises(CheckpointError, match=r"is no exported model: a PyTorch file .*-c"):
        read_export_info(ckpt)
    refiner = tmp_path / "refiner.pt"
    torch.save({"format": "dualseg-refiner/1"}, refiner)
    with pytest.raises(CheckpointError, match=r"is no exported model: a method-B refiner"):
        read_export_info(refiner)
    foreign = tmp_path / "foreign.pt"  # TorchScript that dualseg export did not write
    torch.jit.save(torch.jit.script(torch.nn.ReLU()), foreign)
    with pytest.raises(CheckpointError, match="without dualseg metadata"):
        read_export_info(foreign)


def test_a_torchscript_file_cut_short_is_not_blamed_on_onnx(scripted, tmp_path) -> None:
    cut = tmp_path / "cut.pt"  # an interrupted copy: the zip's central directory is missing
    cut.write_bytes(scripted.read_bytes()[: scripted.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"zip archive .* cut short") as err:
        read_export_info(cut)
    assert "ONNX" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b'{"format": "dualseg-export/1", "class_names"', "is not valid JSON"),  # cut short
        (None, "class_names must be a non-empty list"),  # the entry removed
    ],
)
def test_damaged_torchscript_metadata_is_one_error(scripted, tmp_path, text, said) -> None:
    import zipfile

    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(scripted) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith(f"extra/{TORCHSCRIPT_META}"):
                info = json.loads(data)
                info.pop("class_names")
                data = text if text is not None else json.dumps(info).encode()
            dst.writestr(item, data)
    with pytest.raises(CheckpointError, match=said) as err:
        ExportedSegmenter(bad)
    assert str(bad) in str(err.value)


def test_exported_segmenter_threads_and_batch_size_are_honoured_or_refused(scripted) -> None:
    image = np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    before = torch.get_num_threads()
    seen: list[int] = []
    want = before + 1  # not the count torch has: the test could not fail otherwise
    seg = ExportedSegmenter(scripted, threads=want)
    runner = seg.runner.module
    seg.runner.module = lambda x: (seen.append(torch.get_num_threads()), runner(x))[1]
    seg.predict(image)
    assert seen == [want] and torch.get_num_threads() == before  # for the run only
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1, got -3"):
        seg.predict_batch([image, image], batch_size=-3)
    for bad in (-1, 2.5, True, 100_000):
        with pytest.raises(ConfigError, match=r"threads must be None or an int 0\.\.1024"):
            ExportedSegmenter(scripted, threads=bad)
    # 0 is the runtime's default, as dualseg predict --threads 0; numpy's ints are ints
    assert ExportedSegmenter(scripted, threads=0).runner.threads is None
    assert ExportedSegmenter(scripted, threads=np.int64(want)).runner.threads == want
