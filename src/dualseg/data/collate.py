"""A collate that names the sizes that differ (and the fix) when a batch's images do; torch's
says ``stack expects each tensor to be equal size`` in a traceback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.utils.data import default_collate

from dualseg.errors import DataError


@dataclass(frozen=True)  # picklable: sent to spawned loader workers
class SameSizeCollate:
    """torch's default collate of ``(image, label)`` samples after checking that they have one
    size; ``hint``: the fix to print (``"use --batch-size 1"``)."""

    hint: str = "use a batch size of 1"

    def __call__(self, batch: Sequence[tuple[Tensor, Tensor]]) -> Any:
        for field, what in enumerate(("images", "labels")):
            (h, w), *rest = {tuple(sample[field].shape[-2:]): 0 for sample in batch}
            if rest:
                (h2, w2) = rest[0]
                raise DataError(
                    f"two {what} of one batch differ in size ({w}x{h} and {w2}x{h2} px), and "
                    f"images of different sizes cannot be batched; {self.hint}"
                )
        return default_collate(batch)
