"""Validation at the public boundary: one message shape, "<argument> must <rule>, got <value>"."""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake

from ._oprules import recording
from .threads import share_out, share_size, workers_for

__all__ = [
    "as_tensor",
    "check_bool",
    "check_choice",
    "check_features",
    "check_finite",
    "check_int",
    "check_mask",
    "check_pair",
    "check_real",
    "options_by_keyword",
]

_F = TypeVar("_F", bound=Callable[..., Any])

LAYOUTS = ("hwc", "chw", "flat")
_SHAPES = {
    "hwc": ("(H, W, C)", "(B, H, W, C)"),
    "chw": ("(C, H, W)", "(B, C, H, W)"),
    "flat": ("(N, C)", "(B, N, C)"),
}
# Elements checked per step for NaN/Inf, so the check's own temporaries stay small; on a CPU
# with several threads, steps of at least _FINITE_SHARE elements go to worker threads
_FINITE_CHUNK = 1 << 22
_FINITE_SHARE = 1 << 18


def as_tensor(x: Any, name: str) -> torch.Tensor:
    """A torch view of ``x`` (numpy arrays are shared, not copied where their strides allow)."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "fiub":
            try:
                return torch.from_numpy(x)
            except ValueError:  # negative strides
                return torch.from_numpy(np.ascontiguousarray(x))
        raise TypeError(f"{name} must hold numbers, got a numpy array of dtype {x.dtype}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {x.layout}; convert with .to_dense()")
    if x.is_meta:
        raise TypeError(f"{name} must hold data, got a tensor on the meta device")
    return x


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def check_bool(value: Any, name: str) -> bool:
    """A bool (Python's or numpy's), never a string or a number that reads as one: "False" is
    truthy, so ``bool(value)`` would turn it into True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def check_real(value: Any, name: str, low: float, high: float, *, low_open: bool = False, finite: bool = True) -> float:
    """A real number (Python or numpy) in [low, high], or (low, high] with ``low_open``; finite
    unless ``finite=False`` (an infinite bound then admits that infinity)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if not (low < value if low_open else low <= value) or not value <= high:
        rule = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def not_finite(name: str) -> str:
    """The error of :func:`check_finite` for the argument ``name`` (also where C finds it)."""
    return f"{name} must hold only finite values, got NaN or Inf; clean it first (for example with torch.nan_to_num)"


def check_finite(x: torch.Tensor, name: str, mask: torch.Tensor | None = None) -> None:
    """Raise ValueError if ``x`` holds NaN or Inf (checked in chunks, so temporaries stay small).

    With ``mask`` (boolean, of x's leading shape), only the entries it keeps are checked: users
    pad ragged batches with NaN under a mask, and masked-out entries are never read."""
    if x.numel() == 0:
        return
    message = not_finite(name)
    if mask is not None:
        x, mask = x.reshape(mask.numel(), -1), mask.reshape(-1)
    if recording() or (type(x) is not torch.Tensor and is_fake(x)):  # a plain tensor is never fake
        # a graph cannot branch on the data: the check becomes an assertion op in it, raised
        # (as a RuntimeError) when the graph runs; fake tensors have no data to check
        ok = torch.isfinite(x) if mask is None else torch.isfinite(x).all(1) | ~mask
        torch._assert_async(ok.all(), message)
        return
    # cut along the rows of each leading slice (an unbatched map is one slice of all its rows)
    blocks = list(x.unbind(0)) if x.dim() >= 3 else [x]
    per_slice = max(1, blocks[0].numel() // blocks[0].shape[0])
    step = max(1, _FINITE_CHUNK // per_slice)
    workers = workers_for(x.device)
    if workers > 1:
        step = min(step, max(_FINITE_SHARE // per_slice, share_size(len(blocks) * blocks[0].shape[0], workers)))

    def check(item: tuple[torch.Tensor, int]) -> None:
        block, start = item
        chunk = block[start : start + step]
        if mask is None:
            # NaN propagates through both extremes and Inf is one: one fused pass, 10x faster
            # than isfinite(...).all() here, with no boolean temporary
            low, high = torch.aminmax(chunk)
            if chunk.device.type == "cpu":  # two numbers read where three more operations would run
                finite = math.isfinite(low.item()) and math.isfinite(high.item())
            else:  # one read of the device
                finite = bool((torch.isfinite(low) & torch.isfinite(high)).all())
        else:
            finite = bool((torch.isfinite(chunk).all(1) | ~mask[start : start + step]).all())
        if not finite:
            raise ValueError(message)

    # on worker threads, not the caller's OpenMP team: woken here, its threads would spin on the
    # cores a threaded search takes next (threads.own_thread)
    items = [(block, start) for block in blocks for start in range(0, block.shape[0], step)]
    share_out(items, check, workers, name="densematch-check")


def check_features(
    x: Any, name: str, layout: str, *, finite: bool = True, empty: bool = False
) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """Validate a feature map and view it as flat rows (``finite=False``: the caller checks
    finiteness itself, where its mask allows; ``empty``: a map without pixels is allowed, as
    the band of a sharded search may be).

    Returns
    -------
    rows : Tensor of shape (B, N, C)
        A view of ``x`` where the layout allows (chw gives a transposed view, not a copy).
    grid : tuple of int
        The spatial shape: (H, W) for hwc and chw, (N,) for flat.
    batched : bool
        Whether ``x`` had a leading batch dimension.
    """
    x = as_tensor(x, name)
    one, many = _SHAPES[layout]
    nd = 2 if layout == "flat" else 3
    if x.ndim not in (nd, nd + 1):
        raise ValueError(f"{name} must have shape {one} or {many} for layout={layout!r}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must hold floats (float16, bfloat16, float32 or float64), got {x.dtype}; convert with .float()"
        )
    batched = x.ndim == nd + 1
    channels = x.shape[-1] if layout != "chw" else x.shape[-3]
    if x.numel() == 0 and not (empty and channels > 0 and (not batched or x.shape[0] > 0)):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    xb = x if batched else x.unsqueeze(0)
    if layout == "hwc":
        grid = tuple(xb.shape[1:3])
        rows = xb.reshape(xb.shape[0], -1, xb.shape[3])
    elif layout == "chw":
        grid = tuple(xb.shape[2:4])
        rows = xb.reshape(xb.shape[0], xb.shape[1], -1).transpose(1, 2)
    else:
        grid = (xb.shape[1],)
        rows = xb
    if finite:
        check_finite(x, name)
    return rows, grid, batched


def check_mask(mask: Any, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A boolean mask of exactly ``shape``, on ``device``."""
    mask = as_tensor(mask, name)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean mask, got dtype {mask.dtype}; use mask > 0")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, the map's pixels, got {tuple(mask.shape)}")
    return mask.to(device)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a call computes in: float64 when any input is float64, else float32 (half and
    integer inputs are computed in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_pair(ra: torch.Tensor, rb: torch.Tensor, batched: bool, batched_b: bool) -> None:
    """Rows of a and b (from :func:`check_features`) that can be compared: one batch size, one
    number of channels, one device."""
    if batched != batched_b or ra.shape[0] != rb.shape[0]:
        raise ValueError(f"a and b must have the same batch size, got {tuple(ra.shape)} and {tuple(rb.shape)}")
    if ra.shape[2] != rb.shape[2]:
        raise ValueError(f"a and b must have the same number of channels C, got {ra.shape[2]} and {rb.shape[2]}")
    if ra.device != rb.device:
        raise ValueError(f"a and b must be on one device, got {ra.device} and {rb.device}")


def check_batch_mask(
    mask: Any, name: str, nbatch: int, grid: tuple[int, ...], batched: bool, device: torch.device
) -> torch.Tensor | None:
    """A mask of shape (B, *grid): batched masks as given, a (*grid) mask repeated."""
    if mask is None:
        return None
    shape = tuple(getattr(mask, "shape", ()))
    if batched and shape == grid:
        return check_mask(mask, name, grid, device).expand(nbatch, *grid)
    full = (nbatch, *grid) if batched else grid
    return check_mask(mask, name, full, device).reshape(nbatch, *grid)


def options_by_keyword(inputs: int) -> Callable[[_F], _F]:
    """Make the options after a function's first ``inputs`` arguments (``self`` counted)
    keyword-only, as its signature declares them, while calls that still pass them by position
    keep working for now with a FutureWarning that names the keywords (scikit-learn's way out
    of positional options). The function's own signature, read through ``__wrapped__``, is the
    keyword-only one."""

    def decorate(fn: _F) -> _F:
        names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > inputs:
                extra = args[inputs:]
                if len(extra) > len(names):
                    raise TypeError(f"{fn.__qualname__} takes {inputs} positional arguments, got {len(args)}")
                given = names[: len(extra)]
                twice = [name for name in given if name in kwargs]
                if twice:
                    raise TypeError(f"{fn.__qualname__} got {twice[0]!r} both by position and by keyword")
                keywords = ", ".join(f"{name}=" for name in given)
                warnings.warn(
                    f"{fn.__qualname__}: pass {keywords} by keyword; by position it will be an error in a later"
                    " release",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs.update(zip(given, extra, strict=True))
                args = args[:inputs]
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate
