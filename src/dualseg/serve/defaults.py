"""Defaults of ``dualseg serve`` and ``create_app``, written once (no FastAPI import, so
``dualseg serve --help`` works without the ``serve`` extra installed)."""

from __future__ import annotations

DEFAULT_MAX_MEGAPIXELS = 20.0  # larger images are refused (413), checked from the header
DEFAULT_MAX_UPLOAD_MB = 25.0  # larger uploads are refused (413) while they stream in
DEFAULT_WORK_MEGAPIXELS = 1.0  # larger images are inferred downscaled to this many pixels
DEFAULT_WORKERS = 2  # inference threads: a small request is served beside a large one
DEFAULT_QUEUE_SIZE = 8  # requests waiting for a worker beyond the running ones; then 503
EXTRA_HINT = "pip install 'dualseg[serve]'"
