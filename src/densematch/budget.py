"""Memory budgets and settings: parse budgets, find the memory a device has free, scope defaults.

One setting drives every chunk size in densematch. ``memory=`` on a call wins; otherwise the
value of :func:`config_context` (or the ``DENSEMATCH_MEMORY`` environment variable); otherwise a
default derived from the memory the device has free, capped where bigger tiles stop paying off.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["chunk_rows", "config_context", "get_config", "parse_memory", "resolve_memory"]

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

# Past these, larger tiles stop being faster (measured in benchmarks/bench_match.py): on a CPU
# the tiles should stay near the caches; a GPU wants big tiles but needs no more than a few GiB.
DEFAULT_CAP_CPU = 512 * 1024**2
DEFAULT_CAP_CUDA = 8 * 1024**3

_memory_setting: contextvars.ContextVar[int | str | None] = contextvars.ContextVar("densematch_memory", default=None)
_half_setting: contextvars.ContextVar[str] = contextvars.ContextVar("densematch_half", default="auto")
_kernel_setting: contextvars.ContextVar[str] = contextvars.ContextVar("densematch_kernel", default="auto")
HALF_SETTINGS = ("auto", "bfloat16", "float16", "off")
KERNEL_SETTINGS = ("auto", "torch", "triton")


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
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4 * 1024**3


def resolve_memory(memory: int | str | None, device: torch.device) -> int:
    """The working-memory budget of one call, in bytes.

    ``memory`` if given; else the scoped :func:`config_context` value or ``DENSEMATCH_MEMORY``;
    else half of what the device has free, capped at 512 MiB on a CPU and 8 GiB on a GPU.
    """
    if memory is None:
        memory = _memory_setting.get()
    if memory is None:
        memory = os.environ.get("DENSEMATCH_MEMORY") or None
    if memory is not None:
        return parse_memory(memory)
    cap = DEFAULT_CAP_CUDA if device.type == "cuda" else DEFAULT_CAP_CPU
    return max(1, min(free_memory(device) // 2, cap))


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


def get_config() -> dict[str, int | str | None]:
    """The current settings, as a dict: ``memory``, ``half`` and ``kernel``."""
    return {"memory": _memory_setting.get(), "half": _half_setting.get(), "kernel": _kernel_setting.get()}


@contextlib.contextmanager
def config_context(
    *, memory: int | str | None = None, half: str | None = None, kernel: str | None = None
) -> Iterator[None]:
    """Scope settings for every densematch call inside the block.

    Parameters
    ----------
    memory : int or str, optional
        The default memory budget (see :func:`resolve_memory`).
    half : {"auto", "bfloat16", "float16", "off"}, optional
        Which half-precision operands ``precision="exact"`` and ``"fast"`` use. "auto" (the
        default) decides from what the device is (tensor-core GPUs and CPUs with AMX use half
        precision, others float32; never a timing); the others force a choice ("off": never).
    kernel : {"auto", "torch", "triton"}, optional
        Which search runs: "auto" (the default) uses the fused Triton kernel on CUDA devices when
        Triton is installed; "torch" never does; "triton" always does (on a CPU only under
        TRITON_INTERPRET=1, Triton's interpreter, for tests).

    Notes
    -----
    Settings live in :mod:`contextvars`: they follow the code inside the block, including
    asyncio tasks it starts, but not work handed to a thread pool, whose threads start from
    the defaults. Carry them with ``contextvars.copy_context().run``::

        with densematch.config_context(memory="1GiB"):
            ctx = contextvars.copy_context()
            futures = [pool.submit(ctx.copy().run, densematch.match, a, b) for a, b in pairs]

    Examples
    --------
    >>> import densematch
    >>> with densematch.config_context(memory="64MiB", half="off"):
    ...     densematch.get_config()
    {'memory': '64MiB', 'half': 'off', 'kernel': 'auto'}
    """
    if memory is not None:
        parse_memory(memory)
    for name, value, choices in (("half", half, HALF_SETTINGS), ("kernel", kernel, KERNEL_SETTINGS)):
        if value is not None and value not in choices:
            listed = ", ".join(repr(c) for c in choices)
            raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    # only the settings given change, so blocks nest
    settings = ((_memory_setting, memory), (_half_setting, half), (_kernel_setting, kernel))
    changes = [(var, value) for var, value in settings if value is not None]
    tokens = [(var, var.set(value)) for var, value in changes]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)
