"""Where the commands' outputs go, and what they never replace: an existing output (unless
``overwrite``), an input image or a dataset file (always) is refused before any work."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dualseg import viz
from dualseg.data.layouts import IMAGE_SUFFIXES, available_splits, discover
from dualseg.errors import DataError, OutputError
from dualseg.imaging import exif_orientation
from dualseg.io import atomic_save_image, atomic_write_bytes, check_writable, label_png

OUTPUT_FOLDERS = ("labels", "color", "overlay", "probs")  # what predict writes into OUT
OWN_FOLDERS = (*OUTPUT_FOLDERS, "changed")  # with refine apply's: never read as inputs
# each --probs npz: float16 [C, H, W] probs, class_names, source path, rgb_digest of the image
PROBS_KEYS = ("probs", "class_names", "source", "image_sha1")
FIGURES = ("confusion_matrix.png", "per_class_iou.png", "confusion_matrix_refined.png")
EVAL_FILES = ("metrics.json", *FIGURES)  # what an evaluation writes into its OUT


def unique_names(found: Sequence[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """``(path, name)`` pairs with distinct names (case-insensitively): a free name is kept,
    others get the first free ``name_k``; a file listed again keeps its first name."""
    keys = [path.resolve() for path, _ in found]
    by_file: dict[Path, str] = {}
    used: set[str] = set()
    for key, (_, name) in zip(keys, found):
        if key not in by_file and name.casefold() not in used:
            by_file[key] = name
            used.add(name.casefold())
    for key, (_, name) in zip(keys, found):
        if key not in by_file:
            k = 1
            while f"{name}_{k}".casefold() in used:
                k += 1
            by_file[key] = f"{name}_{k}"
            used.add(by_file[key].casefold())
    return [(path, by_file[key]) for key, (path, _) in zip(keys, found)]


def dataset_files(root: str | os.PathLike[str], *, layout: str = "auto") -> Iterator[Path]:
    """The files of the dataset at ``root`` (any split), lazily."""
    root = Path(root)
    yield root if root.is_file() else root / "meta.json"
    for split in dict.fromkeys([*available_splits(root, layout), "train", "val", "test"]):
        try:
            found = discover(root, split=split, layout=layout)
        except DataError:
            continue
        if found.source is not None and found.source.is_file():
            yield found.source
        for image, label in found.samples:
            yield image
            yield label


def _file_id(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return st.st_dev, st.st_ino
    return None


def check_outputs(
    outputs: Iterable[Path],
    *,
    overwrite: bool,
    protected: Iterable[tuple[str, Iterable[Path]]] = (),
    what: str = "--out",
) -> None:
    """Refuse an existing output: always when it is one of the ``protected`` files
    (``(description, paths)`` groups, by any path), otherwise unless ``overwrite``."""
    outputs = [Path(p) for p in outputs]
    for folder in {p.parent for p in outputs}:
        blocker = next((f for f in (folder, *folder.parents) if os.path.lexists(f)), None)
        if blocker is not None and not blocker.is_dir():
            raise OutputError(f"{what}: {blocker} is a file where an output folder goes; move it")
    existing = [p for p in outputs if os.path.lexists(p)]
    if not existing:
        return
    if folders := [p for p in existing if p.is_dir()]:
        raise OutputError(f"{what}: {folders[0]} is a folder where an output file goes; move it")
    ids = {_file_id(p): p for p in existing} if protected else {}
    ids.pop(None, None)
    for description, paths in protected:
        for source in paths:
            hit = ids.get(_file_id(Path(source)))
            if hit is not None:
                same = "" if os.path.abspath(hit) == os.path.abspath(source) else f" ({source})"
                raise OutputError(
                    f"{what}: {hit} is {description}{same}; it is never written over, not even "
                    f"with --overwrite: choose another {what}"
                )
    if not overwrite:
        more = f" (and {len(existing) - 1} more output files)" if len(existing) > 1 else ""
        raise OutputError(
            f"{what}: {existing[0]} already exists{more}; pass --overwrite to replace, "
            f"or choose another {what}"
        )


def collect_images(
    inputs: Sequence[str], *, out: Path | None = None, command: str = "predict"
) -> list[tuple[Path, str]]:
    """Files, folders (recursively) and globs as ``(path, output name)`` pairs, never the
    files of ``out``'s own folders nor of an earlier run's outputs inside an input folder."""
    skipped = [] if out is None else [(out / f).resolve() for f in OWN_FOLDERS]
    earlier: set[Path] = set()  # earlier outputs whose files were left out

    def wanted(f: Path, root: Path | None = None) -> bool:
        if not f.is_file() or f.suffix.lower() not in IMAGE_SUFFIXES:
            return False
        if any(f.resolve().is_relative_to(s) for s in skipped):
            return False
        for folder in f.relative_to(root).parents[:-1] if root is not None else ():
            run = (root / folder).parent
            if folder.name in OWN_FOLDERS and all(
                (run / d).is_dir() for d in ("labels", "overlay")
            ):
                earlier.add(run)
                return False
        return True

    found: list[tuple[Path, str]] = []
    missing: list[str] = []
    for item in inputs:
        if not item.strip():
            raise DataError("an input is an empty path; name an image file, a folder or a glob")
        path = Path(item)
        if path.is_dir():
            files = [(f, f.relative_to(path).with_suffix("").as_posix())
                     for f in sorted(path.rglob("*")) if wanted(f, path)]  # fmt: skip
            why = "a folder with no images"
            if any(path.resolve().is_relative_to(s) for s in skipped):
                why = "its images are this command's outputs under --out, never inputs"
        elif path.is_file():
            files, why = [(path, path.stem)], ""
        elif glob.has_magic(item):
            matches = sorted(Path(f) for f in glob.glob(item, recursive=True))
            files = [(f, f.stem) for f in matches if wanted(f)]
            for folder in (m for m in matches if m.is_dir()):
                files += [(f, (folder.name / f.relative_to(folder)).with_suffix("").as_posix())
                          for f in sorted(folder.rglob("*")) if wanted(f, folder)]  # fmt: skip
            why = "no image matches this pattern"
        else:
            files, why = [], "no such file or folder"
        found += files
        if not files:
            missing.append(f"{item} ({why})")
    if missing:
        raise DataError("input not found: " + "; ".join(missing))
    if earlier:
        shown = ", ".join(str(f) for f in sorted(earlier)[:3])
        print(
            f"dualseg {command}: note: left out the outputs of an earlier run found among the "
            f"inputs ({shown}{' ...' if len(earlier) > 3 else ''})",
            file=sys.stderr,
        )
    kept: dict[str, tuple[Path, str]] = {}  # a file listed twice is segmented once
    for path, name in unique_names(found):
        kept.setdefault(name, (path, name))
    return list(kept.values())


def check_image_outputs(
    out: Path,
    images: Sequence[tuple[Path, str]],
    files: Sequence[tuple[str, str]],
    *,
    overwrite: bool,
    data: str | None = None,
    command: str = "predict",
) -> None:
    """Refuse outputs ``out/<folder>/<name><suffix>`` that exist (unless ``overwrite``) or are
    an input image or a file of the ``data`` dataset or of a dataset at ``out`` (always)."""
    outputs = [out / folder / f"{name}{suffix}" for _, name in images for folder, suffix in files]
    protected = [("an input image", [path for path, _ in images])]
    if data:
        protected.append((f"a file of the dataset {data}", dataset_files(data)))
    # --out is a dataset when it says so, or when the inputs are its images/ and no earlier run
    images_dir = (out / "images").resolve()
    paired = any(path.resolve().is_relative_to(images_dir) for path, _ in images)
    earlier_run = (out / "overlay").is_dir() or (out / "changed").is_dir()
    if (out / "meta.json").is_file() or any(out.glob("*.txt")) or (paired and not earlier_run):
        protected.append((f"a file of the dataset {out}", dataset_files(out)))
    check_outputs(outputs, overwrite=overwrite, protected=protected)
    if not earlier_run:
        return
    ours = {p.resolve() for p in outputs}
    mine = [out / folder for folder, _ in files if (out / folder).is_dir()]
    others = sorted(f for folder in mine for f in folder.rglob("*") if f.is_file()
                    and f.suffix in (".png", ".npz") and f.resolve() not in ours)  # fmt: skip
    if others:
        print(
            f"dualseg {command}: note: {out} also holds {len(others)} output files of images "
            f"this run does not segment (e.g. {others[0].relative_to(out).with_suffix('')}), "
            "from an earlier run; use a new --out to keep the two apart",
            file=sys.stderr,
        )


def save_probs(
    path: Path,
    probs: np.ndarray,
    class_names: Iterable[str],
    source: str,
    image_sha1: str | None = None,
) -> None:
    """Write one ``--probs`` file (:data:`PROBS_KEYS`), compressed and atomically."""
    buf = io.BytesIO()
    digest = {} if image_sha1 is None else {"image_sha1": np.asarray(image_sha1)}
    names = np.asarray(list(class_names), dtype=str)
    np.savez_compressed(buf, probs=probs.astype(np.float16), class_names=names,
                        source=np.asarray(source), **digest)  # fmt: skip
    atomic_write_bytes(path, buf.getvalue())


def write_outputs(
    out: Path,
    name: str,
    image: np.ndarray,
    label: np.ndarray,
    palette: Any,
    *,
    alpha: float = 0.5,
) -> None:
    """``labels/``, ``color/`` and ``overlay/`` PNGs of one image (atomic writes). ``image``:
    an RGB array, or a large image's row reader (``image[y0:y1]``): colours are made in row
    bands of about 4 megapixels, so memory follows the band."""
    h, w = label.shape[:2]
    color, over = np.empty((h, w, 3), np.uint8), np.empty((h, w, 3), np.uint8)
    for y in range(0, h, step := max(1, 2**22 // max(w, 1))):
        color[y : y + step] = viz.colorize(label[y : y + step], palette)
        over[y : y + step] = viz.overlay(
            image[y : y + step], label[y : y + step], palette, alpha=alpha
        )
    atomic_save_image(out / "labels" / f"{name}.png", label_png(label, len(palette)))
    atomic_save_image(out / "color" / f"{name}.png", color)
    atomic_save_image(out / "overlay" / f"{name}.png", over)


def prediction_names(samples: list) -> list[str]:
    """The output name of each ``(image_path, label_path)`` sample, as predict names them."""
    return [name for _, name in unique_names([(Path(img), Path(img).stem) for img, _ in samples])]


def prediction_files(out: Path, names: list[str], *, refined: bool) -> list[Path]:
    """Every file :class:`PredictionWriter` writes for these names."""
    kinds = ("", "refined_") if refined else ("",)
    return [out / f"{k}{f}" / f"{n}.png" for n in names for k in kinds for f in ("labels", "color")]


class PredictionWriter:
    """``evaluate(on_batch=...)`` hook writing ``labels/`` and ``color/`` PNGs per sample (and
    ``refined_*`` with a refiner); ``samples`` in loader order (not shuffled)."""

    def __init__(self, samples: list, out: Path, palette: Any, batch_size: int) -> None:
        self.names, self.out = prediction_names(samples), out
        self.palette, self.batch_size = palette, batch_size
        self.created: list[Path] = []  # files this evaluation added (not replaced)

    def _save(self, path: Path, array: Any) -> None:
        if not path.exists():
            self.created.append(path)
        atomic_save_image(path, array)

    def __call__(self, index: int, images: Any, labels: Any, pred: Any, refined: Any) -> None:
        for k in range(pred.shape[0]):
            name = self.names[index * self.batch_size + k]
            for kind, lab in (("", pred[k]), ("refined_", None if refined is None else refined[k])):
                if lab is not None:
                    arr = label_png(lab.to("cpu").numpy(), len(self.palette))
                    self._save(self.out / f"{kind}labels" / f"{name}.png", arr)
                    self._save(self.out / f"{kind}color" / f"{name}.png",
                               viz.colorize(arr, self.palette))  # fmt: skip

    def undo(self) -> int:
        """Remove the files this evaluation added (it stopped on an error); how many."""
        for path in self.created:
            path.unlink(missing_ok=True)
        for folder in {path.parent for path in self.created}:
            with contextlib.suppress(OSError):  # a folder this evaluation made, now empty
                folder.rmdir()
        return len(self.created)


def mixed_size_batch(samples: list, batch_size: int) -> str | None:
    """A line on the first batch of ``samples`` whose images differ in size (file headers)."""

    def size(path: str) -> tuple[int, int] | None:
        try:
            with Image.open(path) as im:
                w, h = im.size
                return (w, h) if exif_orientation(im, path) < 5 else (h, w)
        except Exception:  # unreadable: the run itself names the file
            return None

    for start in range(0, len(samples), batch_size):
        sizes = [(img, s) for img, _ in samples[start : start + batch_size] if (s := size(img))]
        if other := next(((img, s) for img, s in sizes if s != sizes[0][1]), None):
            (a, (wa, ha)), (b, (wb, hb)) = sizes[0], other
            return (
                f"two images of one batch differ in size ({wa}x{ha} and {wb}x{hb} px: {a} and "
                f"{b}), and images of different sizes cannot be batched"
            )
    return None


def write_figures(
    out: Path, metrics: dict[str, Any], class_names: Any, *, refined_by: str = "method B"
) -> list[Path]:
    """:data:`FIGURES` in ``out`` (the refined confusion matrix with a refiner, named by
    ``refined_by``: method B or dense CRF); their paths."""
    viz.save_confusion_matrix(out / FIGURES[0], metrics["confusion_matrix"], class_names)
    series, written = {"model": metrics["iou"]}, [out / FIGURES[0], out / FIGURES[1]]
    if (refined := metrics.get("refined")) is not None:
        series[f"model + {refined_by}"] = refined["iou"]
        written.append(out / FIGURES[2])
        viz.save_confusion_matrix(
            written[2],
            refined["confusion_matrix"],
            class_names,
            title=f"{refined_by}: confusion matrix (row-normalized, %)",
        )
    viz.save_class_iou(written[1], series, class_names)
    return written


def default_out(checkpoint: str, split: str, *, variant: str = "") -> Path:
    """``eval --out``'s default: ``eval_SPLIT[_NAME]`` beside the checkpoint (``./`` for hf://,
    ``FILE_NAME`` for a model ``FILE.py:NAME``)."""
    if str(checkpoint).startswith("hf:/"):
        repo = str(checkpoint).rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0]
        return Path(f"eval_{split}_{repo}{variant}")
    path = Path(checkpoint)
    name = path.stem if path.is_file() else path.name
    if ":" in name and not path.exists():  # FILE.py:NAME: no colon in a folder name
        file, attr = name.rsplit(":", 1)
        name = f"{Path(file).stem}_{attr}"
    tag = "" if path.name == "best.pt" else f"_{name}"
    return path.parent / f"eval_{split}{tag}{variant}"


def check_eval_outputs(
    out: Path, predictions: str | None, *, data: str, split: str, layout: str, refined: bool,
    overwrite: bool,
) -> list[Path]:  # fmt: skip
    """Refuse an unwritable place, earlier outputs (unless ``overwrite``) or dataset files;
    returns an earlier evaluation's refined predictions that this one leaves out."""
    check_writable(out, kind="dir", what="--out")
    if not predictions:
        check_outputs([out / name for name in EVAL_FILES], overwrite=overwrite, what="--out")
        return []
    check_writable(predictions, kind="dir", what="--save-predictions")
    names = prediction_names(discover(data, split=split, layout=layout).samples)
    kept = [(f"a file of the dataset {data}", dataset_files(data, layout=layout))]
    ours = prediction_files(Path(predictions), names, refined=refined)
    check_outputs(ours, overwrite=overwrite, protected=kept, what="--save-predictions")
    stale = sorted(set(prediction_files(Path(predictions), names, refined=True)) - set(ours))
    check_outputs(stale, overwrite=True, protected=kept, what="--save-predictions")
    check_outputs([out / name for name in EVAL_FILES], overwrite=overwrite, what="--out")
    return [p for p in stale if p.exists()] if overwrite else []
