"""The names each choice takes, as ``Literal`` types for the public signatures: a type checker
then refuses ``metric="l3"`` before anything runs. tests/test_package.py keeps each equal to the
tuple the runtime checks against."""

from __future__ import annotations

from typing import Literal

__all__ = [
    "HalfSetting",
    "KernelSetting",
    "LayoutName",
    "MetricName",
    "ObjectiveName",
    "PrecisionName",
    "RefineName",
    "SamplingName",
    "SoftMode",
]

MetricName = Literal["cosine", "dot", "l2", "sqeuclidean", "l1", "linf"]
LayoutName = Literal["hwc", "chw", "flat"]
PrecisionName = Literal["exact", "float32", "fast", "float64"]
SoftMode = Literal["softmax", "dual_softmax"]
ObjectiveName = Literal["l1", "l2", "ncc"]
SamplingName = Literal["nearest", "bilinear"]
RefineName = Literal["parabola", "soft", "features"]
HalfSetting = Literal["auto", "bfloat16", "float16", "off"]
KernelSetting = Literal["auto", "torch", "triton"]
