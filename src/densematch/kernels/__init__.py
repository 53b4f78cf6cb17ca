"""Kernels the engine and the distances call where they apply.

- :mod:`densematch.kernels.topk` (Triton, optional: without it, or without a GPU, the engine's
  torch path runs): :func:`~densematch.kernels.topk.topk_launch` multiplies query and reference
  tiles on the tensor cores and merges each score tile into a running top-k per row without
  writing it to memory; with the certificate of :mod:`densematch.precision` it also lists every
  candidate inside the rounding bound, for the engine to re-score by the direct form.
- :mod:`densematch.kernels.native` (C, built once per machine, called through ctypes): l1/linf
  distances and their gradients, the passes around l2's product, the engine's tile merge with
  the near-tie listing, the certified bfloat16 step, and the values of chosen pairs.
- :func:`ops_for` (:mod:`densematch.kernels.c_ops`): the one answer to "may the C kernels run,
  and can they?", as the :class:`densematch.ops.Ops` a call hands down.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

import torch

from .c_ops import ops_for

if TYPE_CHECKING:
    from ..metrics import Metric

__all__ = ["MAX_K", "interpreting", "ops_for", "triton_available", "wanted"]

# The kernel keeps the running top-k in registers: k slots per row, merged k times per tile.
MAX_K = 8


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def wanted(backend: str, device: torch.device, metric: Metric, k: int) -> bool:
    """Whether the engine should run the fused kernel for this search.

    ``backend`` (:attr:`densematch.precision.Precision.backend`): "auto" picks the kernel on CUDA
    devices with Triton installed, for matrix metrics and k <= MAX_K; "torch" never does;
    "triton" insists, and raises a ValueError saying why when the kernel cannot run.
    """
    if backend == "torch":
        return False
    fits = metric.matrix and k <= MAX_K
    if backend == "triton":
        if not fits:
            raise ValueError(
                f"kernel='triton' needs a matrix metric (cosine, dot, l2, sqeuclidean) and k <= {MAX_K}, "
                f"got metric={metric.name!r}, k={k}; use kernel='auto'"
            )
        if not triton_available():
            raise ValueError("kernel='triton' needs Triton: pip install triton (or densematch[gpu])")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kernel='triton' runs on CUDA tensors, or on the CPU under TRITON_INTERPRET=1; got {device}"
            )
        return True
    return fits and device.type == "cuda" and triton_available()
