"""The one safe loader: ``torch.load(weights_only=True)`` with a one-line error per failure.

Checkpoints, refiners, refiner training states and weight files all load through
:func:`safe_torch_load`. Nothing is ever unpickled beyond what ``weights_only=True`` allows, and
no message suggests turning that off: a file holding other objects was not written by dualseg,
and plain weights belong in a state-dict file (``torch.save(model.state_dict(), path)``).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from dualseg.errors import CheckpointError

__all__ = ["safe_torch_load"]

PLAIN_WEIGHTS_HINT = (
    "for plain weights save a state dict (torch.save(model.state_dict(), path)) and pass that "
    "file as weights"
)


def safe_torch_load(
    path: str | os.PathLike[str],
    *,
    what: str,
    fix: str,
    written_by: str = "",
    map_location: Any = "cpu",
) -> Any:
    """Load ``path`` with ``weights_only=True``; every failure is one :class:`CheckpointError`.

    ``what`` names the kind of file in messages ("checkpoint", "refiner", ...), ``fix`` says
    what to do with an unreadable one, ``written_by`` where a missing one comes from.
    """
    import torch

    path = Path(path)
    where = f"; {written_by}" if written_by else ""
    if not path.exists():
        raise CheckpointError(f"{what} not found: {path} (check the path{where})")
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a {what} file{where}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found is None or not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is corrupt or not a PyTorch {what} file; {fix}"
            ) from None
        raise CheckpointError(
            f"{path} contains objects that cannot be loaded safely (weights_only=True; it holds "
            f"a {found.group(1)}), so it is not a dualseg {what}; {PLAIN_WEIGHTS_HINT}"
        ) from None
    except (KeyError, IndexError, TypeError) as err:
        # the legacy (non-zip) unpickler reading a text or other non-PyTorch file: a text
        # file fails with KeyError of some byte value
        raise CheckpointError(
            f"{path} is corrupt or not a PyTorch {what} file ({type(err).__name__} while "
            f"unpickling); {fix}"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{path} is corrupt or truncated and cannot be read ({first}); {fix}"
        ) from None
