"""Checkpoints: atomic save, safe load, clear errors, model rebuild, RNG round trip."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from checkpoint_helpers import contract
from dualseg.engine.checkpoint import (
    FORMAT,
    build_model_from_checkpoint,
    capture_rng_state,
    check_compatible,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from dualseg.errors import CheckpointError
from dualseg.models import build_model

KWARGS = {"num_classes": 3, "renet_hidden": 4, "aspp_rates": [1, 2]}


def _state(model: nn.Module, **extra) -> dict:
    return {
        "arch": "dualseg_mobilenet_v2",
        "model_kwargs": dict(KWARGS),
        "model": model.state_dict(),
        "class_names": ["a", "b", "c"],
        "palette": [(1, 2, 3), (4, 5, 6), (7, 8, 9)],
        "ignore_index": 255,
        "label_contract": contract(["a", "b", "c"], [(1, 2, 3), (4, 5, 6), (7, 8, 9)]),
        **extra,
    }


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return build_model("dualseg_mobilenet_v2", **KWARGS).eval()


def test_round_trip_rebuilds_identical_model(tmp_path: Path, model: nn.Module) -> None:
    path = save_checkpoint(tmp_path / "c.pt", _state(model, iteration=7))
    # Loads with the safe unpickler, and carries format + version.
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == FORMAT and raw["version"]
    ckpt = load_checkpoint(path)
    assert ckpt["iteration"] == 7
    rebuilt, meta = build_model_from_checkpoint(ckpt)
    assert meta.class_names == ("a", "b", "c") and meta.palette[1] == (4, 5, 6)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), model(x))
    assert not rebuilt.training


def test_numpy_and_tuples_are_stored_plainly(tmp_path: Path, model: nn.Module) -> None:
    state = _state(model, sampler={"perm": np.arange(4), "n": np.int64(3)}, rng=capture_rng_state())
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "c.pt", state))
    assert torch.equal(ckpt["sampler"]["perm"], torch.arange(4))
    assert ckpt["sampler"]["n"] == 3 and isinstance(ckpt["sampler"]["n"], int)


def test_rng_state_round_trip(tmp_path: Path, model: nn.Module) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path / "c.pt", _state(model, rng=capture_rng_state()))
    ckpt = load_checkpoint(path)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng_state(ckpt["rng"])
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_missing_folder_truncated_and_foreign_files(tmp_path: Path, model: nn.Module) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_checkpoint(tmp_path)

    good = save_checkpoint(tmp_path / "good.pt", _state(model))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(truncated)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt or not a PyTorch checkpoint"):
        load_checkpoint(garbage)

    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    with pytest.raises(CheckpointError, match=r"not a dualseg checkpoint"):
        load_checkpoint(bare)

    other = tmp_path / "other.pt"
    torch.save({**_state(model), "format": "dualseg-checkpoint/99"}, other)
    with pytest.raises(CheckpointError, match="dualseg-checkpoint/99"):
        load_checkpoint(other)

    unsafe = tmp_path / "unsafe.pt"  # an arbitrary pickled object: refused, never executed
    torch.save({"format": FORMAT, "x": argparse.Namespace(a=1)}, unsafe)
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_checkpoint(unsafe)
    # one that would run a command when unpickled (os.system: a module torch blocks) is named
    # as unsafe too, not as "corrupt"
    torch.save({"format": FORMAT, "x": _RunsACommand()}, unsafe)
    with pytest.raises(CheckpointError, match=r"cannot be loaded safely.*\.system"):
        load_checkpoint(unsafe)


class _RunsACommand:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


def test_save_is_atomic_on_failure(tmp_path: Path, model: nn.Module) -> None:
    path = save_checkpoint(tmp_path / "c.pt", _state(model, iteration=1))
    before = path.read_bytes()
    with pytest.raises(TypeError, match="cannot store"):
        save_checkpoint(path, _state(model, iteration=2, bad=object()))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind
    # a folder, or a path below a file: one line naming it (os.replace named a temp file)
    from dualseg.errors import OutputError

    with pytest.raises(OutputError, match=r"is a folder; give a file path inside it"):
        save_checkpoint(tmp_path, _state(model))
    with pytest.raises(OutputError, match=r"c\.pt is a file, not a folder"):
        save_checkpoint(path / "x.pt", _state(model))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_compatibility_errors_name_both_sides(tmp_path: Path, model: nn.Module) -> None:
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "c.pt", _state(model)))
    check_compatible(ckpt, arch="dualseg_mobilenet_v2", num_classes=3)
    expected = r"'dualseg_mobilenet_v2'.*expected 'dualseg_resnet18'"
    with pytest.raises(CheckpointError, match=expected):
        check_compatible(ckpt, arch="dualseg_resnet18")
    with pytest.raises(CheckpointError, match=r"3 classes \(expected 11\)"):
        check_compatible(ckpt, num_classes=11)


def test_state_dict_mismatch_is_a_clear_error(tmp_path: Path, model: nn.Module) -> None:
    # The weights belong to a 5-class model but the checkpoint claims 3: no raw stack trace.
    five = build_model("dualseg_mobilenet_v2", **{**KWARGS, "num_classes": 5})
    path = save_checkpoint(tmp_path / "c.pt", {**_state(model), "model": five.state_dict()})
    with pytest.raises(CheckpointError, match=r"'dualseg_mobilenet_v2' with 3 classes.*shape"):
        build_model_from_checkpoint(load_checkpoint(path))
    # Weights of another architecture under this arch's name.
    other = nn.Sequential(nn.Conv2d(3, 3, 1))
    path = save_checkpoint(tmp_path / "d.pt", {**_state(model), "model": other.state_dict()})
    with pytest.raises(CheckpointError, match="missing"):
        build_model_from_checkpoint(load_checkpoint(path))
    unknown = save_checkpoint(tmp_path / "e.pt", {**_state(model), "arch": "no_such_net"})
    with pytest.raises(CheckpointError, match="no_such_net"):
        build_model_from_checkpoint(load_checkpoint(unknown))


def test_odd_model_kwargs_in_a_checkpoint_are_one_line_or_filled_in(tmp_path: Path) -> None:
    from checkpoint_helpers import SYNTHETIC_KWARGS, write_synthetic_checkpoint
    from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
    from dualseg.errors import CheckpointError

    no_count = {k: v for k, v in SYNTHETIC_KWARGS.items() if k != "num_classes"}
    path = write_synthetic_checkpoint(tmp_path / "a.pt", model_kwargs=no_count)
    _, meta = build_model_from_checkpoint(load_checkpoint(path))  # the class list's count
    assert meta.num_classes == SYNTHETIC_KWARGS["num_classes"]
    bad = write_synthetic_checkpoint(
        tmp_path / "b.pt", model_kwargs={**SYNTHETIC_KWARGS, "aspp_rates": 4}
    )
    with pytest.raises(CheckpointError, match=r"b\.pt: its model_kwargs do not build") as err:
        build_model_from_checkpoint(load_checkpoint(bad))
    assert "\n" not in str(err.value)


def test_a_checkpoint_with_nan_weights_is_refused_not_answered_with_class_0(
    tmp_path: Path,
) -> None:
    from checkpoint_helpers import write_synthetic_checkpoint
    from dualseg.engine.checkpoint import load_checkpoint
    from dualseg.engine.predict import load_model

    path = write_synthetic_checkpoint(tmp_path / "ok.pt")
    state = load_checkpoint(path)
    state["model"]["rgb.aspp.convs.0.weight"][0, 0, 0, 0] = float("inf")
    broken = save_checkpoint(tmp_path / "diverged.pt", state)
    with pytest.raises(CheckpointError, match=r"diverged\.pt holds NaN or infinite weights"):
        load_model(broken)
    load_model(path)  # the healthy one loads
