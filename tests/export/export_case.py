"""The tiny network every export test uses (imported by conftest.py and the tests)."""

ARCH = "dualseg_mobilenet_v2"
MODEL_KWARGS = {"num_classes": 3, "renet_hidden": 8}
CLASS_NAMES = ["road", "car", "sky"]
PALETTE = [[128, 64, 128], [0, 0, 142], [70, 130, 180]]
