"""The label contract: how a model's training data was read, stored with the model.

Class names, palette and the raw-value mapping (a :class:`DatasetMeta`), the label format
and the bit depth of 16-bit images, as resolved when the model was trained (meta.json, a
preset, ``--data.*`` flags). Checkpoints, pretrained folders and exports keep its
:meth:`LabelContract.to_dict`; ``eval`` / ``predict`` read data with it unless told otherwise,
and refuse a dataset that describes itself otherwise (:meth:`LabelContract.differences`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.data.presets import DatasetMeta
from dualseg.data.readers import LABEL_FORMATS
from dualseg.errors import DataError


@dataclass(frozen=True)
class LabelContract:
    """What a label value and a pixel value meant to the model when it was trained."""

    meta: DatasetMeta
    label_format: str = "index"
    bit_depth: int | None = None  # of 16-bit images; None: detected from their values

    def __post_init__(self) -> None:
        if self.label_format not in LABEL_FORMATS:
            raise DataError(
                f"label_format {self.label_format!r}: use one of {', '.join(LABEL_FORMATS)}"
            )
        depth = self.bit_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                                  or not 8 <= depth <= 16):  # fmt: skip
            raise DataError(f"bit_depth {depth!r}: give the bits per sample, 8 to 16, or null")

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.meta.class_names

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form: ``meta.json``'s keys plus ``label_format`` and ``bit_depth``."""
        return {**self.meta.to_dict(), "label_format": self.label_format,
                "bit_depth": self.bit_depth}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabelContract:
        if not isinstance(d, dict):
            raise DataError(f"a label contract is a dict, got {type(d).__name__}")
        return cls(
            meta=DatasetMeta.from_dict(d),
            label_format=d.get("label_format") or "index",
            bit_depth=d.get("bit_depth"),
        )

    def rows(self) -> dict[str, str]:
        """Each part of the contract as a short text (what :meth:`differences` compares)."""
        out = {
            "classes": ", ".join(self.meta.class_names),
            "label values": self.meta.describe_mapping(),
            "label format": self.label_format,
            "bit depth": "detected" if self.bit_depth is None else f"{self.bit_depth}-bit",
        }
        if self.label_format == "color":  # index labels use the palette only to draw
            out["palette"] = " ".join(map(_hex, self.meta.palette))
            out["void colours"] = " ".join(map(_hex, self.meta.void_colors))
        return out

    def differences(self, other: LabelContract, *, sides: tuple[str, str] = ("model", "data")
                    ) -> list[str]:  # fmt: skip
        """One ``"part: SIDE0 ... | SIDE1 ..."`` line per part that reads labels or pixels
        otherwise in ``other``; empty when both read every file the same way."""
        mine, theirs = self.rows(), other.rows()
        same_mapping = bool((self.meta.lookup_table() == other.meta.lookup_table()).all())
        out = []
        for key in (*mine, *(k for k in theirs if k not in mine)):
            if key == "label values" and same_mapping:
                continue  # the same table said in other words (an explicit 0:0 entry)
            a, b = mine.get(key, "-"), theirs.get(key, "-")
            if a != b:
                out.append(f"{key}: {sides[0]} [{a}] | {sides[1]} [{b}]")
        return out


def _hex(rgb: Any) -> str:
    return "#" + "".join(f"{int(v):02x}" for v in rgb)


def content_digests(paths: Iterable[str | Path]) -> np.ndarray:
    """``int64 [N]``: the first 8 bytes of each file's SHA-1, so a copy of a training image
    under another name or folder is still known (8 bytes an image keeps a checkpoint small)."""
    digests = [hashlib.sha1(Path(p).read_bytes()).digest()[:8] for p in paths]
    return np.frombuffer(b"".join(digests), dtype="<i8").copy()


def count_seen(paths: Iterable[str | Path], seen: Any) -> int:
    """How many of ``paths`` have their content among ``seen`` (:func:`content_digests`)."""
    known = set(np.asarray(seen, dtype=np.int64).tolist())
    return sum(int(d) in known for d in content_digests(paths).tolist())


def digests_to_hex(seen: Any) -> list[str]:
    """:func:`content_digests` as 16-digit hex strings, as a JSON file keeps them."""
    raw = np.asarray(seen, dtype="<i8").tobytes()
    return [raw[i : i + 8].hex() for i in range(0, len(raw), 8)]


def digests_from_hex(texts: Any) -> np.ndarray:
    """:func:`digests_to_hex`'s strings back as ``int64 [N]``; ValueError for anything else."""
    if not isinstance(texts, list) or not all(isinstance(t, str) and len(t) == 16 for t in texts):
        raise ValueError("expected a list of 16-digit hex strings")
    return np.frombuffer(bytes.fromhex("".join(texts)), dtype="<i8").copy()
