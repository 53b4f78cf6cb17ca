"""What this installation runs: versions, the CPU features seen, which search paths the device
picks and whether the C kernels are in use (``densematch.show_config()``, ``densematch info``)."""

from __future__ import annotations

import os
import platform
import sys
from typing import TextIO

import numpy as np
import torch

from .config import get_config, resolve_memory
from .kernels import native, triton_available
from .precision import cpu_bf16_unit, cpu_capabilities, device_half

# the environment variables densematch reads, beside config_context
ENVIRONMENT = (
    "DENSEMATCH_MEMORY",
    "DENSEMATCH_NATIVE",
    "DENSEMATCH_NATIVE_LEVEL",
    "DENSEMATCH_CACHE",
    "DENSEMATCH_KERNEL_BLOCKS",
)


def _cpu() -> tuple[str, str]:
    """The CPU's name and the instruction sets that matter here, from torch's own probe."""
    caps = cpu_capabilities() or {}
    names = ("avx2", "fma3", "avx512_f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")
    seen = [name for name in names if caps.get(name) is True]
    name = str(caps.get("cpu_name") or platform.processor() or platform.machine())
    return name, ", ".join(seen) or "none of AVX2, AVX-512, AMX"


def config_report() -> dict[str, str]:
    """The report :func:`show_config` prints, as (name, value) strings."""
    cpu = torch.device("cpu")
    half = {m: device_half(cpu, m) for m in ("cosine", "l2")}
    cpu_name, features = _cpu()
    report = {
        "densematch": sys.modules["densematch"].__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu": cpu_name,
        "cpu features": features,
        "threads": str(torch.get_num_threads()),
        'precision="exact" on the CPU': f"certified bfloat16 ({cpu_bf16_unit()})"
        if cpu_bf16_unit()
        else f"plain float32 (half: {half['cosine'] or 'none'})",
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available",
        "triton": "installed" if triton_available() else "not installed",
        "default memory (cpu)": f"{resolve_memory(None, cpu) / 2**20:.0f} MiB",
    }
    report.update(native.status())
    report.update({f"config {k}": str(v) for k, v in get_config().items()})
    report.update({name: os.environ[name] for name in ENVIRONMENT if name in os.environ})
    return report


def show_config(file: TextIO | None = None) -> dict[str, str]:
    """Print what this installation runs (versions, CPU features, the path ``precision="exact"``
    takes, whether the C kernels are in use and how they were built, the settings and the
    environment variables read) and return it as a dict.

    Examples
    --------
    >>> import densematch, io
    >>> report = densematch.show_config(file=io.StringIO())
    >>> report["densematch"] == densematch.__version__, "kernels" in report
    (True, True)
    """
    report = config_report()
    width = max(map(len, report))
    for name, value in report.items():
        print(f"{name:<{width}}  {value}", file=file)
    return report
