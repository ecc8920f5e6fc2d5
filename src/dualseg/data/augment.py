"""``dualseg augment``: write N augmented pairs of a dataset (spec S1).

Output ``i`` is source pair ``i % N`` under seed ``(seed, i)``: a re-run with the same settings
(``augment.json``) skips the valid pairs and rewrites the rest identically. The list file and
``meta.json`` are written last, so ``build_dataset(DST)`` reads the result.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors

from dualseg.augment_defaults import check_augment_settings, seed_error
from dualseg.console import Progress, ProgressMode, progress_mode
from dualseg.data.datasets import SegmentationDataset, build_dataset
from dualseg.data.presets import META_FILE, without_source_ignore
from dualseg.data.transforms import (
    BLUR_PROB,
    HFLIP_PROB,
    JITTER,
    SCALE_RANGE,
    build_augment_pipeline,
    sample_seed,
    seeded,
)
from dualseg.errors import DataError
from dualseg.io import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_writable,
    encode_image,
)

SETTINGS_FILE = "augment.json"
IMAGE_FORMATS = {"png": "PNG", "jpg": "JPEG"}
AUGMENT_FLAGS = {  # how `dualseg augment` names each setting
    k: "--" + k.replace("_", "-")
    for k in ("crop_size", "scale_range", "hflip_prob", "blur_prob", "jitter")
}


class Augmenter:
    """Writes output pair ``i`` of an augmentation run (picklable: sent to worker processes)."""

    def __init__(self, dataset: SegmentationDataset, dst: Path, settings: dict) -> None:
        self.dataset, self.dst, self.settings = dataset, dst, settings

    def paths(self, i: int) -> tuple[Path, Path]:
        ext = self.settings["image_format"]
        return self.dst / "images" / f"{i:06d}.{ext}", self.dst / "labels" / f"{i:06d}.png"

    def __call__(self, i: int) -> bool:
        """Write pair ``i`` unless a valid one exists; return True when it was written."""
        img_path, label_path = self.paths(i)
        if _valid(img_path) and _valid(label_path):
            return False
        image, label = self.dataset.load_pair(i)
        s = self.settings
        pipeline = build_augment_pipeline(  # cheap to build: a few objects
            crop_size=tuple(s["crop_size"] or label.shape),
            scale_range=tuple(s["scale_range"]),
            hflip_prob=s["hflip_prob"],
            blur_prob=s["blur_prob"],
            jitter=tuple(s["jitter"]),
            image_fill=0,  # written images carry no normalization: pad black
        )
        with seeded(sample_seed(self.settings["seed"], index=i)):
            img_t, lbl_t = pipeline(
                tv_tensors.Image(np.ascontiguousarray(image.transpose(2, 0, 1))),
                tv_tensors.Mask(label),
            )
        fmt = IMAGE_FORMATS[self.settings["image_format"]]
        img_bytes = encode_image(img_t.permute(1, 2, 0).contiguous().numpy(), fmt)
        atomic_write_bytes(img_path, img_bytes)  # the label last: a pair is done
        atomic_write_bytes(label_path, encode_image(lbl_t.numpy().astype(np.uint8)))  # once both
        return True


def _valid(path: Path) -> bool:
    try:  # verify() checks PNG checksums; for JPEG it passes a truncated file
        with Image.open(path) as im:
            im.verify() if im.format == "PNG" else im.load()
    except Exception:  # missing, truncated or not an image
        return False
    return True


def _init_worker() -> None:
    # Ctrl-C reaches the process group: the parent alone reports it, in one line
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)


def augment_dataset(
    src: str | Path,
    dst: str | Path,
    *,
    count: int = 10_000,
    workers: int = 1,
    split: str = "train",
    layout: str = "auto",
    preset: str | None = None,
    label_format: str = "index",
    crop_size: tuple[int, int] | None = None,
    scale_range: tuple[float, float] = SCALE_RANGE,
    hflip_prob: float = HFLIP_PROB,
    blur_prob: float = BLUR_PROB,
    jitter: tuple[float, float, float, float] = JITTER,
    seed: int = 0,
    image_format: str = "png",
    list_name: str = "train.txt",
    progress: bool = True,
) -> tuple[int, int]:
    """Write ``count`` augmented pairs of ``src`` into ``dst``; return (written, skipped);
    ``progress``: a bar or lines (by the terminal), or nothing."""
    _check_options(count, seed, image_format, list_name)
    check_augment_settings(  # before anything is written: a bad value leaves no augment.json
        crop_size=crop_size,
        scale_range=scale_range,
        hflip_prob=hflip_prob,
        blur_prob=blur_prob,
        jitter=jitter,
        names=AUGMENT_FLAGS,
    )
    dst = check_writable(dst, kind="dir", what="DST")
    dataset = build_dataset(
        src, split=split, layout=layout, preset=preset, label_format=label_format
    )
    _check_destination(Path(src), dst, dataset, list_name)
    settings = {
        "src": str(Path(src).resolve()),
        "split": split,
        "crop_size": list(crop_size) if crop_size else None,
        "scale_range": list(scale_range),
        "hflip_prob": hflip_prob,
        "blur_prob": blur_prob,
        "jitter": list(jitter),
        "seed": seed,
        "image_format": image_format,
        # how the labels were read, which pairs in which order, and their size and mtime:
        # any change would mix two sources in one folder
        "layout": layout,
        "label_format": label_format,
        "meta": dataset.meta.to_dict(),
        "source_pairs": len(dataset.samples),
        "source_digest": _sha1(f"{i.resolve()}\t{lab.resolve()}" for i, lab in dataset.samples),
        "source_stamp": _sha1(  # sizes and mtimes: no file is read
            f"{st.st_size}:{st.st_mtime_ns}"
            for pair in dataset.samples
            for st in map(Path.stat, pair)
        ),
    }
    _claim(dst, settings)
    earlier = _pair_count(dst)
    if earlier > count:  # the list file would leave pairs on disk that no list names
        raise DataError(
            f"DST {dst} holds pairs up to number {earlier - 1} from an earlier run with these "
            f"settings, beyond --count {count}: pass --count {earlier} or more to resume it, or "
            "choose a new DST"
        )
    _remove_partial(dst)  # an earlier run's, killed mid-write
    mode = progress_mode(quiet=not progress)
    written = _write_pairs(Augmenter(dataset, dst, settings), count, workers, mode)
    ext = image_format
    lines = "".join(f"images/{i:06d}.{ext} labels/{i:06d}.png\n" for i in range(count))
    atomic_write_text(dst / list_name, lines)
    atomic_write_json(dst / META_FILE, without_source_ignore(dataset.meta).to_dict())
    return written, count - written


def _check_options(count: int, seed: int, image_format: str, list_name: str) -> None:
    if count < 1:
        raise DataError(f"--count must be >= 1, got {count}")
    if (problem := seed_error(seed, "--seed")) is not None:
        raise DataError(problem)
    if image_format not in IMAGE_FORMATS:
        raise DataError(f"image format {image_format!r}: use one of {sorted(IMAGE_FORMATS)}")
    if Path(list_name).name != list_name or not list_name.endswith(".txt"):  # not meta.json
        raise DataError(
            f"--list-name {list_name!r}: give a bare file name ending in .txt (e.g. train.txt); "
            "the list file is written into DST, beside images/ and labels/"
        )


def _write_pairs(augmenter: Augmenter, count: int, workers: int, mode: ProgressMode) -> int:
    """Write pairs ``0..count-1`` (those not there yet); return how many were written."""
    written = 0
    bar = Progress(total=count, desc="augment", unit="pair", mode=mode)
    if workers <= 1:
        for i in range(count):
            written += augmenter(i)
            bar.update()
    else:
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        try:
            with ctx.Pool(workers, initializer=_init_worker) as pool:  # augmenter sent per chunk
                for did in pool.imap_unordered(augmenter, range(count), chunksize=16):
                    written += did
                    bar.update()
        except BaseException:  # the pool is terminated: a worker may have died mid-write
            _remove_partial(augmenter.dst)
            raise
    bar.close()
    return written


def _remove_partial(dst: Path) -> None:
    """Remove unfinished writes' ``.<name>.*.tmp`` files from DST's output folders."""
    for folder in (dst / "images", dst / "labels"):
        for tmp in folder.glob(".*.tmp") if folder.is_dir() else ():
            tmp.unlink(missing_ok=True)


def _check_destination(src: Path, dst: Path, dataset: SegmentationDataset, list_name: str) -> None:
    """Refuse a ``dst`` whose writing would overwrite or change a dataset (the source, a folder
    inside it or holding its files, or a dataset dualseg augment did not write)."""
    src_dir, here = (src.parent if src.is_file() else src).resolve(), dst.resolve()
    if here == src_dir or src_dir in here.parents:  # inside: a split folder of the source
        where = "the" if here == src_dir else "inside the"
        raise DataError(f"DST {dst} is {where} source dataset {src}; choose a new folder")
    written = {here / list_name, here / META_FILE, here / SETTINGS_FILE}
    for path in (*(p for pair in dataset.samples for p in pair), src_dir / META_FILE, src):
        path = path.resolve()
        if path in written or path.parent in (here / "images", here / "labels"):
            raise DataError(
                f"DST {dst} would overwrite files of the source dataset {src} ({path}); "
                "choose a folder outside it"
            )
    if (here / SETTINGS_FILE).is_file():
        return  # a previous augment run's output: resumed (or refused) by _claim
    found = sorted(p.name for p in here.glob("*.txt")) if here.is_dir() else []
    found += [META_FILE] if (here / META_FILE).is_file() else []
    found += [f"{sub}/" for sub in ("images", "labels") if _has_files(here / sub)]
    if found:
        raise DataError(
            f"DST {dst} holds a dataset that dualseg augment did not write ({', '.join(found)}; "
            f"no {SETTINGS_FILE}); choose an empty or new folder"
        )


def _sha1(lines: Iterable[str]) -> str:
    return hashlib.sha1("\n".join(lines).encode("utf-8")).hexdigest()


def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(p.is_file() for p in folder.iterdir())


def _pair_count(dst: Path) -> int:
    """One past the highest pair number in ``dst`` (0 when empty)."""
    numbers = [
        int(p.stem)
        for folder in (dst / "images", dst / "labels")
        if folder.is_dir()
        for p in folder.iterdir()
        if p.stem.isdigit()
    ]
    return max(numbers) + 1 if numbers else 0


def _claim(dst: Path, settings: dict) -> None:
    """Refuse to mix outputs of different settings in one folder; an ``augment.json`` without
    pairs beside it is stale and replaced."""
    path = dst / SETTINGS_FILE
    settings = json.loads(json.dumps(settings))  # as it reads back from the file
    if path.is_file() and (_has_files(dst / "images") or _has_files(dst / "labels")):
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise DataError(
                f"{path}: not UTF-8 JSON, so the settings of the pairs in {dst} are unknown; "
                "re-create them: empty the folder (or choose an empty DST) and run again"
            ) from None
        except (OSError, json.JSONDecodeError):
            old = None
        if old != settings:
            changed = sorted(k for k in settings if not old or old.get(k) != settings[k])
            if changed == ["source_stamp"]:
                raise DataError(
                    f"{dst}: holds pairs augmented from source files that have changed since "
                    "(same paths, another size or time: edited in place?); resuming would mix "
                    "pairs of the old and the new files: choose an empty DST folder"
                )
            raise DataError(
                f"{dst}: holds pairs augmented with other settings ({', '.join(changed)} "
                "differ); resume with the same options, or choose an empty DST folder"
            )
    else:
        atomic_write_json(path, settings)
