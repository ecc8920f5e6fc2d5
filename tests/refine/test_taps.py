"""Method B on any model's own features (dualseg.refine.taps): a tiny smp Unet as the base."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dualseg.cli import main
from dualseg.errors import ConfigError, DataError
from dualseg.refine import BoundaryRefiner, RefinerConfig, list_taps, pick_taps

smp = pytest.importorskip("segmentation_models_pytorch")

TAPS = ("encoder.layer1", "encoder.layer4")


class _Stripes(torch.utils.data.Dataset):
    """64x64 images of three vertical stripes whose colours are their classes."""

    def __init__(self, n: int = 4) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        label = torch.zeros(64, 64, dtype=torch.long)
        a, b = 16 + int(torch.randint(0, 8, (1,), generator=g)), 40
        label[:, a:], label[:, b:] = 1, 2
        colours = torch.tensor([[-1.0, 0, 1], [1, -1, 0], [0, 1, -1]])
        image = colours[label].permute(2, 0, 1) + 0.3 * torch.randn(3, 64, 64, generator=g)
        return image, label


def _unet(encoder: str = "resnet18") -> torch.nn.Module:
    torch.manual_seed(0)
    return smp.Unet(encoder, encoder_weights=None, classes=3).eval()


def _fit(base: torch.nn.Module, **kw) -> BoundaryRefiner:
    cfg = RefinerConfig(embed_dim=8, decoder_channels=8, steps=3, batch_size=2, radius=3,
                        num_triplets=64, aspp_rates=(1, 2), top_n=3)  # fmt: skip
    return BoundaryRefiner.fit(_Stripes(), class_names=list("abc"), config=cfg, weights=None,
                               base=base, progress=False, **kw)  # fmt: skip


def test_the_taps_of_an_smp_unet_are_listed_and_picked() -> None:
    base = _unet()
    taps = {t.name: t for t in list_taps(base, torch.zeros(1, 3, 64, 64))}
    assert (taps["encoder.layer1"].channels, taps["encoder.layer1"].stride) == (64, 4)
    assert (taps["encoder.layer4"].channels, taps["encoder.layer4"].stride) == (512, 32)
    # the deepest stage at the embedding's stride (16), not the encoder's last (32)
    assert pick_taps(base, list(taps.values()), high_stride=16) == (
        "encoder.layer1",
        "encoder.layer3",
    )
    assert pick_taps(base, list(taps.values()), high_stride=32) == TAPS
    mobile = _unet("mobilenet_v2")
    picked = pick_taps(mobile, list_taps(mobile), high_stride=16)
    assert picked == ("encoder.features.3", "encoder.features.13")


def test_a_tap_refiner_fits_refines_round_trips_and_refuses_another_base(tmp_path) -> None:
    base = _unet()
    refiner = _fit(base, base_features=TAPS)
    assert refiner.taps.names == TAPS and refiner.taps.channels == (64, 512)
    assert refiner.taps.strides == (4, 32) and refiner.config.output_stride == 32
    assert not any(k.startswith("backbone.") for k in refiner.net.state_dict())  # base not saved
    images = torch.stack([_Stripes()[i][0] for i in range(2)])
    labels, changed = refiner.refine(images, base=base, return_changed=True)
    assert changed.shape == labels.shape
    assert labels.shape == (2, 64, 64)
    # the same labels when the caller runs the base and hands over the taps
    with refiner.shared_features(base) as shared:
        logits = base(images)
        features = shared.take(images)
    assert features is not None and features.low.shape[-2:] == (16, 16)
    torch.testing.assert_close(refiner.refine(images, logits, features=features), labels)

    path = tmp_path / "refiner.pt"
    refiner.save(path)
    loaded = BoundaryRefiner.load(path)
    assert loaded.taps == refiner.taps
    torch.testing.assert_close(loaded.refine(images, base=base), labels)
    refiner.save_pretrained(tmp_path / "folder")
    torch.testing.assert_close(
        BoundaryRefiner.load(tmp_path / "folder").refine(images, base=base), labels
    )
    with pytest.raises(ConfigError, match="base itself"):  # no base: nothing to tap
        BoundaryRefiner.load(path).refine(images, logits)

    with pytest.raises(DataError, match=r"encoder\.layer1"):  # no such module
        loaded.refine(images, base=_unet("mobilenet_v2"))
    wide = smp.Unet("resnet50", encoder_weights=None, classes=3).eval()
    with pytest.raises(DataError, match=r"256 channels.*64 channels") as err:
        loaded.refine(images, base=wide)
    assert "\n" not in str(err.value)

    class Halved(smp.Unet):  # the same modules and channels, at twice the strides
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(torch.nn.functional.avg_pool2d(x, 2))

    torch.manual_seed(0)
    halved = Halved("resnet18", encoder_weights=None, classes=3).eval()
    with pytest.raises(DataError, match=r"64 channels, stride 8, but .* stride 4\)"):
        loaded.refine(images, base=halved)

    out = tmp_path / "r.onnx"
    assert main(["export", "--refiner", str(path), "--format", "onnx", "--out", str(out)]) == 1


class _Padded(torch.nn.Module):
    """smp's Unet on any size, as users wrap it: padded to a multiple of 32 (bottom and right,
    or centred), the logits cropped back."""

    def __init__(self, unet: torch.nn.Module, centred: bool = False) -> None:
        super().__init__()
        self.unet, self.centred = unet, centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h, w), (ph, pw) = x.shape[-2:], (-x.shape[-2] % 32, -x.shape[-1] % 32)
        top, left = (ph // 2, pw // 2) if self.centred else (0, 0)
        out = self.unet(torch.nn.functional.pad(x, (left, pw - left, top, ph - top)))
        return out[..., top : top + h, left : left + w]


@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("high", ["unet.encoder.layer4", "unet.decoder.blocks.0"])  # 32, 16
def test_taps_are_read_from_a_base_that_pads_its_input(centred: bool, high: str) -> None:
    base = _Padded(_unet(), centred).eval()
    refiner = _fit(base, base_features=("unet.encoder.layer1", high))
    crops = [_Stripes()[i] for i in range(2)]
    images = torch.stack([x[:, :40, :56] for x, _ in crops])  # sides not multiples of 32
    with torch.no_grad(), refiner.shared_features(base) as shared:
        base(images)
        features = shared.take(images)
    # padded bottom and right (checked by value), the taps cover the image: the base runs once
    # (at stride 16 the base pads further than the refiner would: the taps are cropped to what
    # the refiner's padding spans); centred, they would be shifted: not read
    assert (features is None) == centred
    if centred:
        return
    # scores with boundaries (the random base predicts one class): the prototype distances
    # there are the same from the taps read as from its own run of the base on its own padded copy
    labels = torch.stack([y[:40, :56] for _, y in crops])
    probs = torch.nn.functional.one_hot(labels, 3).permute(0, 3, 1, 2) * 0.7 + 0.1
    own = refiner.candidates(images, probs, features=None)
    assert own.edge.any()
    read = refiner.candidates(images, probs, features=features)
    torch.testing.assert_close(read.distance, own.distance)
    torch.testing.assert_close(refiner.refine(images, probs, features=features),
                               refiner.refine(images, probs))  # fmt: skip


def test_auto_taps_and_a_base_returning_hugging_face_logits() -> None:
    base = _unet("mobilenet_v2")
    refiner = _fit(base, base_features=("auto",))
    assert refiner.taps.names == ("encoder.features.3", "encoder.features.13")

    class Output:  # as transformers' segmentation models: logits at 1/4 of the image size
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits

    def quarter(x: torch.Tensor) -> Output:
        return Output(torch.nn.functional.avg_pool2d(base(x), 4))

    images = torch.stack([_Stripes()[i][0] for i in range(2)])
    plain = BoundaryRefiner.fit(
        _Stripes(), class_names=list("abc"), weights=None, progress=False,
        config=RefinerConfig(backbone="resnet18", embed_dim=8, steps=2, batch_size=2, radius=3,
                             num_triplets=64, aspp_rates=(1, 2), input_scale=1.0),
    )  # fmt: skip
    assert plain.refine(images, base=quarter).shape == (2, 64, 64)
    with pytest.raises(ConfigError, match="no taps could be picked"):
        _fit(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1)), base_features=("auto",))


def test_refine_layers_lists_the_modules_of_a_python_base(tmp_path, capsys) -> None:
    spec = tmp_path / "mymodel.py"
    spec.write_text(
        "import segmentation_models_pytorch as smp\n"
        "model = smp.Unet('resnet18', encoder_weights=None, classes=3)\n"
    )
    assert main(["refine", "layers", "--base", f"{spec}:model", "--size", "64", "64"]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer4" in out and "512" in out
    assert "--base-features encoder.layer1 encoder.layer3" in out
    assert main(["refine", "layers", "--base", f"{spec}:nothing"]) == 1
    assert "nothing" in capsys.readouterr().err


def _fit_argv(data, spec, out) -> list[str]:
    argv = ["refine", "fit", "--data", str(data), "--base", spec, "--out", str(out)]
    argv += ["--embed-dim", "4", "--steps", "1", "--batch-size", "2", "--crop-size", "64", "64"]
    argv += ["--radius", "2", "--num-triplets", "16", "--aspp-rates", "1", "2", "--device", "cpu"]
    return [*argv, "--no-progress", "--log-every", "0"]


def _python_base(tmp_path, n_train: int, more: str = "") -> tuple:
    """Synthetic data and ``mymodel.py`` defining ``model``, an 8-class random smp Unet."""
    from dualseg.data import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "data", n_train=n_train, n_val=1, size=(64, 64))
    spec = tmp_path / "mymodel.py"
    spec.write_text(
        "import torch, segmentation_models_pytorch as smp\n"
        "torch.manual_seed(0)\n"
        f"model = smp.Unet('resnet18', encoder_weights=None, classes=8)\n{more}"
    )
    return data, spec


def test_refine_fit_and_apply_on_the_taps_of_a_python_base(tmp_path, capsys) -> None:
    data, spec = _python_base(tmp_path, n_train=3)
    out = tmp_path / "r.pt"
    argv = _fit_argv(data, f"{spec}:model", out)
    assert main([*argv, "--base-features", "auto"]) == 1  # no --decoder-channels
    assert "--decoder-channels must be > 0 with base_features" in capsys.readouterr().err
    # the decision chosen on held-out images reads the taps of the base's own forward
    *train, dev = (data / "train.txt").read_text().splitlines()
    (data / "train.txt").write_text("\n".join(train) + "\n")
    (data / "dev.txt").write_text(dev + "\n")
    assert main([*argv, "--base-features", "encoder.layer1", "encoder.layer4",
                 "--decoder-channels", "4", "--calibrate-split", "dev"]) == 0  # fmt: skip
    fitted = BoundaryRefiner.load(out)
    assert fitted.taps.names == TAPS and fitted.calibration["images"] == 1
    images = sorted((data / "images").glob("*.png"))[:1]
    refined = tmp_path / "refined"
    argv = ["refine", "apply", str(images[0]), "-r", str(out), "-b", f"{spec}:model"]
    assert main([*argv, "-o", str(refined), "--device", "cpu", "--quiet"]) == 0
    assert (refined / "labels" / f"{images[0].stem}.png").is_file()
    assert main([*argv[:-2], "-b", str(tmp_path / "nope.py:model"), "-o", str(tmp_path / "o")]) == 1
    assert "no file" in capsys.readouterr().err


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("pydensecrf") is None,
    reason="pydensecrf2 not installed (dualseg[crf])",
)
def test_refine_apply_crf_writes_the_same_outputs(tmp_path) -> None:
    from dualseg.data import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "data", n_train=1, n_val=1, size=(64, 64))
    spec = tmp_path / "mymodel.py"
    spec.write_text(
        "import segmentation_models_pytorch as smp\n"
        "model = smp.Unet('resnet18', encoder_weights=None, classes=8)\n"
    )
    image = sorted((data / "images").glob("*.png"))[0]
    out = tmp_path / "crf"
    argv = ["refine", "apply", str(image), "--crf", "-b", f"{spec}:model", "-o", str(out)]
    assert main([*argv, "--device", "cpu", "--quiet"]) == 0
    for kind in ("labels", "color", "overlay", "changed"):
        assert (out / kind / f"{image.stem}.png").is_file()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("pydensecrf") is None,
    reason="pydensecrf2 not installed (dualseg[crf])",
)
def test_refine_apply_crf_takes_a_model_that_returns_probabilities(tmp_path) -> None:
    """A model ending in softmax gives the CRF its probabilities, not their softmax."""
    from PIL import Image

    from dualseg.data import make_synthetic_dataset

    data = make_synthetic_dataset(tmp_path / "data", n_train=1, n_val=1, size=(64, 64))
    image = sorted((data / "images").glob("*.png"))[0]
    spec = tmp_path / "mymodel.py"
    spec.write_text(
        "import segmentation_models_pytorch as smp, torch\n"
        "torch.manual_seed(0)\n"
        "logits = smp.Unet('resnet18', encoder_weights=None, classes=8)\n"
        "probs = torch.nn.Sequential(logits, torch.nn.Softmax(1))\n"
    )
    labels = {}
    for name in ("logits", "probs"):
        argv = ["refine", "apply", str(image), "--crf", "-b", f"{spec}:{name}"]
        assert main([*argv, "-o", str(tmp_path / name), "--device", "cpu", "--quiet"]) == 0
        labels[name] = np.asarray(Image.open(tmp_path / name / "labels" / f"{image.stem}.png"))
    assert (labels["probs"] == labels["logits"]).all()


def test_eval_scores_a_python_model_and_its_tap_refiner(tmp_path, capsys) -> None:
    """``eval -c FILE.py:NAME``: any PyTorch model, its classes from the data's description."""
    three = "three = smp.Unet('resnet18', encoder_weights=None, classes=3)\n"
    data, spec = _python_base(tmp_path, n_train=2, more=three)
    out = tmp_path / "r.pt"
    argv = _fit_argv(data, f"{spec}:model", out)
    assert main([*argv, "--base-features", "auto", "--decoder-channels", "4"]) == 0
    plain = tmp_path / "plain"  # a folder that describes no classes
    for sub in ("images", "labels"):
        (plain / sub).mkdir(parents=True)
        (plain / sub / "a.png").write_bytes((data / sub / "val_00000.png").read_bytes())
    evaluate = ["eval", "-c", f"{spec}:model", "--data", str(plain), "--quiet", "--device", "cpu"]
    assert main([*evaluate, "--split", "train", "--out", str(tmp_path / "e0")]) == 1
    assert "carries no class names: pass --preset" in capsys.readouterr().err
    evaluate[4] = str(data)  # the synthetic layout names its classes
    assert main([*evaluate, "--refiner", str(out), "--out", str(tmp_path / "e1")]) == 0
    metrics = json.loads((tmp_path / "e1" / "metrics.json").read_text())
    assert metrics["num_images"] == 1 and "refined" in metrics
    evaluate[2] = f"{spec}:three"  # another number of classes than the data names
    assert main([*evaluate, "--out", str(tmp_path / "e2")]) == 1
    assert "gives 3 class scores and the data names 8 classes" in capsys.readouterr().err
