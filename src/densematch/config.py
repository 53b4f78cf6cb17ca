"""Settings scoped by :func:`config_context`: the memory budget, half precision and the kernel.

Only the public functions read these settings, once per call, and hand the engine what they
resolved to (a budget in bytes, a :class:`densematch.precision.Precision`); nothing below them
reads global state. ``memory=`` on a call wins over the scoped value, which wins over the
``DENSEMATCH_MEMORY`` environment variable, which wins over a default derived from the memory
the device has free (:func:`densematch.budget.default_budget`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import TypeVar

import torch

from ._oprules import read_once
from .budget import default_budget, parse_memory
from .choices import HalfSetting, KernelSetting

__all__ = ["HALF_SETTINGS", "KERNEL_SETTINGS", "config_context", "get_config", "resolve_memory"]

HALF_SETTINGS = ("auto", "bfloat16", "float16", "off")
KERNEL_SETTINGS = ("auto", "torch", "triton")

T = TypeVar("T")

_memory: contextvars.ContextVar[int | str | None] = contextvars.ContextVar("densematch_memory", default=None)
_half: contextvars.ContextVar[str] = contextvars.ContextVar("densematch_half", default="auto")
_kernel: contextvars.ContextVar[str] = contextvars.ContextVar("densematch_kernel", default="auto")


@read_once
def get_config() -> dict[str, int | str | None]:
    """The current settings, as a dict: ``memory``, ``half`` and ``kernel``."""
    return {"memory": _memory.get(), "half": _half.get(), "kernel": _kernel.get()}


@read_once
def half_setting() -> str:
    """The scoped ``half`` setting (one of :data:`HALF_SETTINGS`)."""
    return _half.get()


@read_once
def kernel_setting() -> str:
    """The scoped ``kernel`` setting (one of :data:`KERNEL_SETTINGS`)."""
    return _kernel.get()


@read_once
def resolve_memory(memory: int | str | None, device: torch.device) -> int:
    """The working-memory budget of one call, in bytes.

    ``memory`` if given; else the scoped :func:`config_context` value or ``DENSEMATCH_MEMORY``;
    else :func:`densematch.budget.default_budget`: half of what the device has free, capped at
    512 MiB on a CPU and 8 GiB on a GPU, where bigger tiles stop paying off.
    """
    if memory is None:
        memory = _memory.get()
    if memory is None:
        memory = os.environ.get("DENSEMATCH_MEMORY") or None
    return default_budget(device) if memory is None else parse_memory(memory)


def _check_setting(name: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar[T], value: T | None) -> Iterator[None]:
    """``var`` set to ``value`` inside the block, unless ``value`` is None."""
    if value is None:
        yield
        return
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def config_context(
    *, memory: int | str | None = None, half: HalfSetting | None = None, kernel: KernelSetting | None = None
) -> Iterator[None]:
    """Scope settings for every densematch call inside the block.

    Parameters
    ----------
    memory : int or str, optional
        The default memory budget (see :func:`resolve_memory`).
    half : {"auto", "bfloat16", "float16", "off"}, optional
        Which half-precision operands ``precision="exact"`` and ``"fast"`` use. "auto" (the
        default) decides from what the device is (tensor-core GPUs, CPUs with AMX and AMD CPUs
        with AVX-512 BF16 use half precision, others float32; never a timing); the others force
        a choice ("off": never).
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
    _check_setting("half", half, HALF_SETTINGS)
    _check_setting("kernel", kernel, KERNEL_SETTINGS)
    # only the settings given change, so blocks nest
    with _scoped(_memory, memory), _scoped(_half, half), _scoped(_kernel, kernel):
        yield
