"""``dualseg data check --write-meta``: a ``meta.json`` inferred from the label values (0..K-1
as they are, 255 beside them ignore; any other set through a ``label_map``), with placeholder
names for the user to review.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dualseg.data.datasets import meta_path
from dualseg.data.layouts import detect_any_split, discover
from dualseg.data.presets import IGNORE_INDEX, DatasetMeta, voc_palette
from dualseg.data.readers import raw_label_values
from dualseg.errors import DataError
from dualseg.io import atomic_write_json


def infer_meta(root: str | Path, *, layout: str, splits: Iterable[str]) -> DatasetMeta:
    """The classes ``root``'s label files hold (read once each, across ``splits``)."""
    root, splits = Path(root), tuple(splits)
    if layout == "auto":
        layout = detect_any_split(root, splits)
    labels = {label for s in splits for _, label in discover(root, split=s, layout=layout).samples}
    found: set[int] = set()
    for label in sorted(labels):  # a flat folder serves every split: each file read once
        found |= {int(v) for v in raw_label_values(label)}
    values = sorted(found)
    if len(values) < 2 or values[-1] > IGNORE_INDEX:
        why = "values above 255 fit no class id" if len(values) > 1 else "one value, one class"
        raise DataError(
            f"cannot infer classes from the label values {values[:8]} ({why}); describe them "
            "in meta.json by hand"
        )
    classes = values
    if len(values) > 2 and values == [*range(len(values) - 1), IGNORE_INDEX]:
        classes = values[:-1]  # 0..K-1 and 255: the usual ignore value beside the classes
    k = len(classes)  # over 254: DatasetMeta refuses it
    label_map = {} if classes == list(range(k)) else {v: i for i, v in enumerate(classes)}
    names = ("background", "foreground") if k == 2 else tuple(f"class_{i}" for i in range(k))
    return DatasetMeta(
        name=(root.parent if root.is_file() else root).name or "dataset",
        class_names=names,
        palette=((0, 0, 0), (255, 255, 255)) if k == 2 else voc_palette(k),
        ignore_value=None if IGNORE_INDEX in label_map else IGNORE_INDEX,  # 255: a class here
        label_map=tuple(label_map.items()),
    )


def write_meta(root: str | Path, meta: DatasetMeta, *, overwrite: bool = False) -> Path:
    """Write ``meta`` as ROOT/meta.json (atomically); an existing file only with ``overwrite``."""
    path = meta_path(Path(root))
    if path.exists() and not overwrite:
        raise DataError(
            f"{path} exists: review it, or pass --overwrite to replace it with classes "
            "inferred from the label values"
        )
    note = "inferred by 'dualseg data check --write-meta' from the label values: review the names"
    atomic_write_json(path, {"_comment": note, **meta.to_dict()})
    return path
