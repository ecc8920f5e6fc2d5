"""Spec S1 augmentation defaults, written once (a leaf: the training config reads them
without importing torch; ``dualseg.data.transforms`` re-exports them).

Random scale + crop, horizontal flip, filtering (Gaussian blur) and colour jitter. Used by
``build_train_transform`` (``dualseg refine fit``), ``augment_dataset`` (``dualseg augment``)
and the training config's ``data.*`` fields (``dualseg train``).
"""

SCALE_RANGE = (0.5, 2.0)  # random scale factors
HFLIP_PROB = 0.5
BLUR_PROB = 0.5  # S1 "filtering": Gaussian blur
BLUR_SIGMA = (0.1, 2.0)
JITTER = (0.3, 0.3, 0.3, 0.0)  # colour jitter: brightness, contrast, saturation, hue
