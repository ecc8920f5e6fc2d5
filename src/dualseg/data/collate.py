"""Batch collation that says what is wrong when the images of a batch differ in size.

Evaluation runs on images at their own size (no crop), so a dataset whose images are not all
the same size cannot be batched: torch's default collate then fails with ``RuntimeError: stack
expects each tensor to be equal size``, a traceback that names neither the images nor the fix.
:class:`SameSizeCollate` checks the sizes first and raises one :class:`DataError` line with the
two sizes and the fix (``hint``: the flag of the command using it).

    loader = DataLoader(dataset, batch_size=4, collate_fn=SameSizeCollate("use --batch-size 1"))

It is a class, not a closure, so that DataLoader workers started with ``spawn`` can pickle it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dualseg.errors import DataError

__all__ = ["SameSizeCollate"]


def _size(x: Any) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(int(s) for s in shape)


def _describe(shape: tuple[int, ...]) -> str:
    """``(3, 360, 480)`` -> ``480x360`` (width x height, as image viewers show it)."""
    if len(shape) >= 2:
        return f"{shape[-1]}x{shape[-2]}"
    return "x".join(str(s) for s in shape) or "a scalar"


class SameSizeCollate:
    """``collate_fn`` for ``(image, label, ...)`` samples: torch's default collate, after
    checking that each field has one shape across the batch.

    ``hint``: the fix to print, e.g. ``"use --batch-size 1"`` (eval) or
    ``"set --data.val_batch_size 1"`` (training's validation).
    """

    def __init__(self, hint: str = "use a batch size of 1") -> None:
        self.hint = hint

    def __call__(self, batch: Sequence[Any]) -> Any:
        from torch.utils.data import default_collate

        if len(batch) > 1 and isinstance(batch[0], tuple | list):
            for field in range(len(batch[0])):
                shapes = [_size(sample[field]) for sample in batch]
                first = shapes[0]
                if first is None:
                    continue
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
