"""A collate that says which sizes differ (and the fix) when a batch's images do: torch's says
``stack expects each tensor to be equal size`` in a traceback. A class, so ``spawn`` pickles it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import default_collate

from dualseg.errors import DataError


def _describe(shape: tuple[int, ...]) -> str:
    """``(3, 360, 480)`` -> ``480x360`` (width x height, as image viewers show it)."""
    if len(shape) >= 2:
        return f"{shape[-1]}x{shape[-2]}"
    return "x".join(str(s) for s in shape) or "a scalar"


class SameSizeCollate:
    """torch's default collate after checking each field has one shape across the batch;
    ``hint``: the fix to print (``"use --batch-size 1"``)."""

    def __init__(self, hint: str = "use a batch size of 1") -> None:
        self.hint = hint

    def __call__(self, batch: Sequence[Any]) -> Any:

        if len(batch) > 1 and isinstance(batch[0], tuple | list):
            for field in range(len(batch[0])):
                if not hasattr(batch[0][field], "shape"):
                    continue
                shapes = [tuple(sample[field].shape) for sample in batch]
                first = shapes[0]
                other = next((shape for shape in shapes if shape != first), first)
                if other != first:
                    what = ("images", "labels")[field] if field < 2 else f"samples (field {field})"
                    raise DataError(
                        f"two {what} of one batch differ in size ({_describe(first)} and "
                        f"{_describe(other)} px), and images of different sizes cannot be "
                        f"batched; {self.hint}"
                    )
        return default_collate(batch)

    def __repr__(self) -> str:
        return f"SameSizeCollate(hint={self.hint!r})"
