"""Method A's dual-branch network (spec S2), its parts, and the peer DeepLabV3; build one by
name (a :data:`MODELS` key) with :func:`build_model`."""

from dualseg.models.aspp import ASPP
from dualseg.models.backbones import build_backbone
from dualseg.models.base import SegmentationModel
from dualseg.models.coord import CoordChannels
from dualseg.models.deeplab import DeepLabV3
from dualseg.models.dualbranch import Branch, DualBranchNet, Fusion
from dualseg.models.factory import MODELS, backbone_of, build_model
from dualseg.models.renet import ReNetLayer

__all__ = [
    "ASPP",
    "MODELS",
    "Branch",
    "CoordChannels",
    "DeepLabV3",
    "DualBranchNet",
    "Fusion",
    "ReNetLayer",
    "SegmentationModel",
    "backbone_of",
    "build_backbone",
    "build_model",
]
