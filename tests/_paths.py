"""Every search path a device may choose, forced on whatever machine runs the tests.

The device picks the path of ``precision="exact"`` (plain float32 on most CPUs, certified
bfloat16 on CPUs with AMX, the fused Triton kernel on CUDA). Each path is forced here through
``config_context``, so a CPU without AMX runs the AMX path's logic and every machine runs the
kernel's (under Triton's interpreter, which the root conftest.py turns on).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

import densematch

# the device the paths run on: the run's --device (the root conftest.py), cpu by default
DEVICE = torch.device(os.environ.get("DENSEMATCH_TEST_DEVICE", "cpu"))

# name: (precision=, config_context settings); kernel="torch" keeps the C kernels out too
PATHS: dict[str, tuple[str, dict[str, str]]] = {
    "float32": ("float32", {"half": "off", "kernel": "torch"}),
    # the AVX2 default: float32 scores, the C merge and the C pair values
    "float32-c": ("exact", {"half": "off", "kernel": "auto"}),
    "bfloat16": ("exact", {"half": "bfloat16", "kernel": "torch"}),
    # the AMX default: bfloat16 products, bounds, merge and listing in one C call per tile
    "bfloat16-c": ("exact", {"half": "bfloat16", "kernel": "auto"}),
    "float16": ("exact", {"half": "float16", "kernel": "torch"}),
    "kernel-float32": ("float32", {"half": "off", "kernel": "triton"}),
    "kernel-bfloat16": ("exact", {"half": "bfloat16", "kernel": "triton"}),
}
# the paths without the Triton interpreter (slow: for small inputs only)
TORCH_PATHS = [p for p in PATHS if not p.startswith("kernel")]


@contextlib.contextmanager
def on_path(name: str, metric: str = "l2") -> Iterator[str]:
    """Force the path ``name``; yields the ``precision=`` to pass. Kernel paths of metrics the
    kernel does not take (l1, linf) run the torch engine, as ``kernel="auto"`` would."""
    precision, settings = PATHS[name]
    if settings["kernel"] == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("Triton is not installed: the kernel path cannot run here")
        if metric in ("l1", "linf"):
            settings = {**settings, "kernel": "auto"}
    with densematch.config_context(**settings):
        yield precision


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the run's device (:data:`DEVICE`), for a search the tests then judge on
    the CPU."""
    return tuple(t.to(DEVICE) for t in tensors)
