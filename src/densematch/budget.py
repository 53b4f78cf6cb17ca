"""Memory budgets: parse sizes, find the memory a device has free, and cut work into chunks.

One setting drives every chunk size in densematch (:func:`densematch.config.resolve_memory`
chooses it) and one rule, :func:`chunk_rows`, turns it into rows.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

__all__ = ["chunk_rows", "default_budget", "free_memory", "parse_memory"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")

# Past these, larger tiles stop being faster (measured in benchmarks/suites/bench_match.py): on a CPU
# the tiles should stay near the caches; a GPU wants big tiles but needs no more than a few GiB.
DEFAULT_CAP_CPU = 512 * 1024**2
DEFAULT_CAP_CUDA = 8 * 1024**3


def parse_memory(memory: int | str, name: str = "memory") -> int:
    """Turn a memory size into bytes.

    Parameters
    ----------
    memory : int or str
        Bytes as an int, or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5 GiB"`` or ``"4096"``.
        Decimal units (kB, MB, GB) are powers of 1000; binary ones (KiB, MiB, GiB, and bare
        K, M, G) are powers of 1024.
    name : str, default="memory"
        The argument's name, for error messages.

    Returns
    -------
    int
        The size in bytes, at least 1.

    Examples
    --------
    >>> parse_memory("64MiB")
    67108864
    >>> parse_memory("2GB")
    2000000000
    """
    if isinstance(memory, (bool, np.bool_)) or not isinstance(memory, (int, np.integer, str)):
        raise TypeError(f"{name} must be an int of bytes or a string such as '256MiB', got {type(memory).__name__}")
    if not isinstance(memory, str):
        value = int(memory)
    else:
        m = _MEMORY_RE.match(memory)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a size such as '256MiB', '2GB' or '1048576', got {memory!r}")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{name} must be a positive number of bytes, got {memory!r}")
    return value


def free_memory(device: torch.device) -> int:
    """Bytes the device can still hand out: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    unused = _unused_ram()
    return 4 * 1024**3 if unused is None else unused


def default_budget(device: torch.device) -> int:
    """Half of what the device has free, capped at 512 MiB on a CPU and 8 GiB on a GPU."""
    cap = DEFAULT_CAP_CUDA if device.type == "cuda" else DEFAULT_CAP_CPU
    unused = None if device.type == "cuda" else _unused_ram()
    if unused is not None and unused >= 4 * cap:
        # RAM no process uses is 4x the cap: what is available (that, less the kernel's reserve,
        # plus what caches would give back) holds 2x it, so the cap it is, without the 20 us
        # read of /proc/meminfo every call made
        return cap
    return max(1, min(free_memory(device) // 2, cap))


def _unused_ram() -> int | None:
    """The host's RAM no process uses (MemFree), from one system call; None where unknown."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def chunk_rows(budget: int, per_row: int, what: str, *, fixed: int = 0, fix: str = "raise memory") -> int:
    """How many rows of ``per_row`` bytes fit in ``budget`` beside ``fixed`` bytes: the one
    chunking rule of densematch, with its one error.

    Raises
    ------
    ValueError
        "memory=<budget> bytes cannot hold <what>: at least <fixed + per_row> bytes are needed;
        <fix>" when not even one row fits.

    Examples
    --------
    >>> chunk_rows(1000, 300, "one tile", fixed=100)
    3
    """
    rows = (budget - fixed) // per_row
    if rows < 1:
        raise ValueError(
            f"memory={budget} bytes cannot hold {what}: at least {fixed + per_row} bytes are needed; {fix}"
        )
    return int(rows)
