"""Stretch-and-shift alignment of a template into an image, found globally.

Convention (docs/align.md): template pixel (r, c) looks at image coordinate
((r + shift_y + 0.5) / scale_h - 0.5, (c + shift_x + 0.5) / scale_w - 0.5), sampled bilinearly:
the image resized by (scale_h, scale_w) as ``torch.nn.functional.interpolate`` does with
``scale_factor`` and ``align_corners=False``, then cropped at (shift_y, shift_x).

Because that warp is separable, a warped image is two small matrix products,
``Ry @ image @ Rx.T``, with Ry (h, H) and Rx (w, W) bilinear weights. The search has three steps:

1. Exhaustive search on a grid: for every scale pair of a fine grid, the squared error (or the
   NCC) at every integer shift at once, as FFT correlations of the stretched image with the
   template; at half resolution for templates of 48 pixels and more.
2. The best local minima over the scale grid become candidates.
3. Each candidate is refined continuously (Levenberg-Marquardt on the four parameters, with
   gain and bias for NCC) at full resolution, and the best by the requested objective wins.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .budget import chunk_rows
from .checks import as_tensor, check_choice, check_finite, compute_dtype
from .config import resolve_memory
from .threads import share_out, share_size, workers_for

__all__ = ["Alignment", "align", "warp"]

OBJECTIVES = ("l1", "l2", "ncc")
_CANDIDATES = 4
_ITERATIONS = 25
_CPU_CHUNK = 64 * 2**20
_MAX_STEP = 0.02
_EDGE_STEP = 1.0


@dataclass
class Alignment:
    """The result of :func:`align`.

    Attributes
    ----------
    scale_h, scale_w, shift_y, shift_x : float, or Tensor of shape (B,) for batches
        The warp, in the convention of :func:`align`.
    error : float, or Tensor of shape (B,)
        The objective at the answer, a weighted mean per template pixel (and channel): mean
        absolute difference for "l1", mean squared difference for "l2", 1 - NCC for "ncc".
    warped : Tensor
        The stretched and cropped image, shaped like the template.
    landscape : Tensor of shape (B, n_h, n_w)
        The grid search's best error for each (scale_h, scale_w) of the grid (squared error,
        or 1 - NCC), at the search resolution: the error landscape, for pictures.
    scales_h, scales_w : Tensor of shape (n_h,) and (n_w,)
        The grid's scales.
    at_bound : tuple of str, or list of them for batches
        The scales found at an end of their range ("scale_h", "scale_w"): the truth may lie
        beyond it (:func:`align` warns, naming the range to widen).
    """

    scale_h: float | torch.Tensor
    scale_w: float | torch.Tensor
    shift_y: float | torch.Tensor
    shift_x: float | torch.Tensor
    error: float | torch.Tensor
    warped: torch.Tensor
    landscape: torch.Tensor
    scales_h: torch.Tensor
    scales_w: torch.Tensor
    at_bound: tuple[str, ...] | list[tuple[str, ...]] = ()

    def as_dict(self) -> dict[str, Any]:
        """The warp and error as plain Python numbers (lists for batches), and ``at_bound``."""
        out: dict[str, Any] = {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in (
                ("scale_h", self.scale_h),
                ("scale_w", self.scale_w),
                ("shift_y", self.shift_y),
                ("shift_x", self.shift_x),
                ("error", self.error),
            )
        }
        bound = self.at_bound
        out["at_bound"] = [list(b) for b in bound] if isinstance(bound, list) else list(bound)
        return out


def _sampling_matrix(
    n_out: int, n_in: int, scale: torch.Tensor, shift: torch.Tensor, derivative: bool = False
) -> torch.Tensor:
    """(M, n_out, n_in) bilinear weights of output pixels i at input coordinate
    (i + shift + 0.5) / scale - 0.5, clamped to the input like ``interpolate``; with
    ``derivative=True``, their derivative with respect to that coordinate."""
    i = torch.arange(n_out, dtype=scale.dtype, device=scale.device)
    y = ((i + shift[:, None] + 0.5) / scale[:, None] - 0.5).clamp(0, n_in - 1)
    i0 = y.floor().clamp(max=max(n_in - 2, 0))
    frac = y - i0
    i0 = i0.long()
    i1 = (i0 + 1).clamp(max=n_in - 1)
    out = torch.zeros(scale.shape[0], n_out, n_in, dtype=scale.dtype, device=scale.device)
    if derivative:
        w0, w1 = -torch.ones_like(frac), torch.ones_like(frac)
        w0 = torch.where(i1 == i0, 0.0, w0)
        w1 = torch.where(i1 == i0, 0.0, w1)
    else:
        w0, w1 = 1 - frac, frac
    out.scatter_add_(2, i0[..., None], w0[..., None])
    out.scatter_add_(2, i1[..., None], w1[..., None])
    return out


def warp(image: Any, scale_h: Any, scale_w: Any, shift_y: Any, shift_x: Any, size: tuple[int, int]) -> torch.Tensor:
    """The image stretched by (scale_h, scale_w) and cropped at (shift_y, shift_x).

    Parameters
    ----------
    image : Tensor or ndarray of shape (H, W), (B, H, W) or (B, C, H, W)
    scale_h, scale_w, shift_y, shift_x : float or Tensor of shape (B,)
    size : (int, int)
        The crop's (h, w).

    Returns
    -------
    Tensor of shape (h, w), (B, h, w) or (B, C, h, w), float32 (float64 for float64 images)

    Examples
    --------
    >>> img = torch.rand(20, 30)
    >>> ref = torch.nn.functional.interpolate(img[None, None], scale_factor=(1.5, 0.5), mode="bilinear")
    >>> out = warp(img, 1.5, 0.5, 3, 2, (10, 8))
    >>> bool(torch.allclose(out, ref[0, 0, 3:13, 2:10], atol=1e-6))
    True
    """
    x = _as_image(image, "image")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"image must have shape (H, W), (B, H, W) or (B, C, H, W), got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"image must not be empty, got shape {tuple(x.shape)}")
    size = _check_size(size)
    ndim = x.ndim
    x4 = x.reshape(-1, 1, *x.shape[-2:]) if ndim < 4 else x
    b = x4.shape[0]
    names = ("scale_h", "scale_w", "shift_y", "shift_x")
    sh, sw, sy, sx = (
        _warp_param(v, name, b, x4) for v, name in zip((scale_h, scale_w, shift_y, shift_x), names, strict=True)
    )
    out = _warp(x4, sh, sw, sy, sx, size)
    return out.reshape(*x.shape[:-2], *size)


def _check_size(size: Any) -> tuple[int, int]:
    rule = f"size must be a pair (h, w) of positive ints, got {size!r}"
    try:
        h, w = size
    except (TypeError, ValueError):
        raise TypeError(rule) from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (h, w)):
        raise TypeError(rule)
    if h < 1 or w < 1:
        raise ValueError(rule)
    return int(h), int(w)


def _warp_param(value: Any, name: str, b: int, x4: torch.Tensor) -> torch.Tensor:
    """One warp parameter as a (b,) tensor: a number, or one value per image of the batch."""
    wrong_type = TypeError(f"{name} must be a real number or a tensor of shape ({b},), got {type(value).__name__}")
    if isinstance(value, (bool, np.bool_)):
        raise wrong_type
    try:
        t = torch.as_tensor(value, device=x4.device)
    except (TypeError, ValueError, RuntimeError):
        raise wrong_type from None
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
    if t.numel() not in (1, b) or t.ndim > 1:
        raise ValueError(f"{name} must be one number or one per image (shape ({b},)), got shape {tuple(t.shape)}")
    t = t.to(x4.dtype).reshape(-1).expand(b)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if name.startswith("scale") and not bool((t > 0).all()):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return t


def _warp(
    x: torch.Tensor, sh: torch.Tensor, sw: torch.Tensor, sy: torch.Tensor, sx: torch.Tensor, size: tuple[int, int]
) -> torch.Tensor:
    """(M, C, h, w) from images x (M, C, H, W) and per-image parameters (M,)."""
    ry = _sampling_matrix(size[0], x.shape[-2], sh, sy)
    rx = _sampling_matrix(size[1], x.shape[-1], sw, sx)
    return ry[:, None] @ x @ rx[:, None].transpose(-1, -2)


def _as_image(x: Any, name: str) -> torch.Tensor:
    """Float images; integers scaled to [0, 1] by their type's maximum, booleans to 0 / 1."""
    t = as_tensor(x, name)
    if t.dtype == torch.bool:
        return t.float()
    if not t.is_floating_point():
        if t.is_complex():
            raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
        return t.float() / float(torch.iinfo(t.dtype).max)
    return t if t.dtype == torch.float64 else t.float()


def _check_range(value: Any, name: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair (low, high) of positive floats, got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi < lo:
        raise ValueError(f"{name} must be a pair (low, high) with 0 < low <= high, got {value!r}")
    return lo, hi


def _check_fits(
    tpl: tuple[int, int], img: tuple[int, int], range_h: tuple[float, float], range_w: tuple[float, float]
) -> None:
    """The template must lie inside the image stretched by every scale searched: h <= H * s_h
    and w <= W * s_w. Raises a ValueError giving the smallest scales that work, or saying that
    none in the range does (the template larger than the image at the largest scale: often
    template and image swapped)."""
    needs = []
    for axis, size, whole, (lo, hi) in (("h", tpl[0], img[0], range_h), ("w", tpl[1], img[1], range_w)):
        if size > whole * lo:
            needs.append((axis, size, whole, lo, hi, size / whole))
    if not needs:
        return
    if any(least > hi for *_, hi, least in needs):
        detail = "; ".join(
            f"{size} > {whole} x {hi} on {axis}" for axis, size, whole, _, hi, least in needs if least > hi
        )
        raise ValueError(
            f"template of {tpl[0]}x{tpl[1]} does not fit in the image of {img[0]}x{img[1]} even at the "
            f"largest scales ({detail}): the template must be a view inside the image (were template "
            "and image swapped?), or widen the scale range past those ratios"
        )
    fix = ", ".join(
        f"scale_{axis} from at least {least:.4g} ({size} / {whole})" for axis, size, whole, *_, least in needs
    )
    raise ValueError(
        f"template of {tpl[0]}x{tpl[1]} does not fit in the image of {img[0]}x{img[1]} stretched by the "
        f"smallest scales ({range_h[0]:g}, {range_w[0]:g}): it needs h <= H x scale_h and w <= W x scale_w; "
        f"raise the smallest scales: {fix} (scale_h=, scale_w=; on the command line --scale-h, --scale-w)"
    )


def align(
    template: Any,
    image: Any,
    *,
    scale_h: tuple[float, float] = (0.8, 1.2),
    scale_w: tuple[float, float] = (0.8, 1.2),
    objective: str = "l1",
    template_mask: Any = None,
    memory: int | str | None = None,
) -> Alignment:
    """Find the stretch and shift that fit `template` into `image`, globally, to sub-pixel precision.

    Parameters
    ----------
    template : Tensor or ndarray of shape (h, w), (B, h, w) or (B, C, h, w)
        Float, or integer (scaled to [0, 1] by the type's maximum), or bool.
    image : Tensor or ndarray of shape (H, W), (B, H, W) or (B, C, H, W)
        The same layout, B and C as `template`.
    scale_h, scale_w : (float, float), default=(0.8, 1.2)
        The ranges searched, inclusive.
    objective : {"l1", "l2", "ncc"}, default="l1"
        Mean absolute or squared difference, or zero-mean normalised cross-correlation (robust to
        brightness and contrast).
    template_mask : Tensor or ndarray of shape (h, w), or (B, h, w) for batches, optional
        Non-negative weights of template pixels (shared by the channels); 0 ignores a pixel.
    memory : int or str, optional
        Cap on the grid search's working memory; batches are searched in chunks that fit.

    Returns
    -------
    Alignment
        ``scale_h``, ``scale_w``, ``shift_y``, ``shift_x`` and ``error`` (floats, or (B,) tensors
        for batched input), ``warped`` shaped like the template, and the search's landscape.

    Notes
    -----
    Convention: template pixel (r, c) looks at image coordinate ((r + shift_y + 0.5) / scale_h - 0.5,
    (c + shift_x + 0.5) / scale_w - 0.5), bilinear; only placements with the template wholly inside
    the stretched image count: 0 <= shift_y <= H * scale_h - h, and likewise for x.

    The grid search is exhaustive over shifts and dense in scale (steps of at most one pixel of
    stretch across the template at the search resolution), so it finds the basin of the global
    optimum; refinement then reaches sub-pixel precision. For "l1" the refinement minimises the
    squared error and the candidates are ranked by the absolute error.

    Examples
    --------
    >>> img = torch.rand(60, 60)
    >>> tpl = warp(img, 1.1, 0.9, 4.25, 3.5, (48, 40))
    >>> a = align(tpl, img)
    >>> round(a.scale_h, 3), round(a.scale_w, 3), round(a.shift_y, 2), round(a.shift_x, 2)
    (1.1, 0.9, 4.25, 3.5)
    """
    objective = check_choice(objective, "objective", OBJECTIVES)
    lo_h, hi_h = _check_range(scale_h, "scale_h")
    lo_w, hi_w = _check_range(scale_w, "scale_w")
    t = _as_image(template, "template")
    x = _as_image(image, "image")
    if t.ndim not in (2, 3, 4):
        raise ValueError(f"template must have shape (h, w), (B, h, w) or (B, C, h, w), got {tuple(t.shape)}")
    if x.ndim != t.ndim:
        raise ValueError(
            f"image must have the template's layout ({t.ndim} dims, as {tuple(t.shape)}), got {tuple(x.shape)}"
        )
    if t.shape[: t.ndim - 2] != x.shape[: x.ndim - 2]:
        raise ValueError(
            f"template and image must have the same batch and channels, got {tuple(t.shape[:-2])} "
            f"and {tuple(x.shape[:-2])}"
        )
    if t.numel() == 0 or x.numel() == 0:
        raise ValueError(f"template and image must not be empty, got {tuple(t.shape)} and {tuple(x.shape)}")
    if t.device != x.device:
        raise ValueError(f"template and image must be on one device, got {t.device} and {x.device}")
    check_finite(t, "template")
    check_finite(x, "image")
    h, w = t.shape[-2:]
    hh, ww = x.shape[-2:]
    _check_fits((h, w), (hh, ww), (lo_h, hi_h), (lo_w, hi_w))
    dtype = compute_dtype(t, x)
    t4 = t.to(dtype).reshape(-1, *t.shape[-3:]) if t.ndim == 4 else t.to(dtype).reshape(-1, 1, h, w)
    x4 = x.to(dtype).reshape(-1, *x.shape[-3:]) if x.ndim == 4 else x.to(dtype).reshape(-1, 1, hh, ww)
    mask = _check_template_mask(template_mask, t4, t.shape, dtype)
    budget = resolve_memory(memory, x.device)

    with torch.inference_mode():
        # one power of two brings both to unit amplitude, exactly: the search's and the
        # refinement's fixed epsilons then mean the same for images of any amplitude or dtype
        unit = _unit_scale(t4, x4)
        result = _align(
            t4 * unit, x4 * unit, mask, (lo_h, hi_h), (lo_w, hi_w), objective, budget, template_mask is None
        )
    sh, sw, sy, sx, err, warped, landscape, grid_h, grid_w = result
    warped = (warped / unit).reshape(t.shape)
    # 1 - NCC is never below 0; rounding of a perfect fit may put it a hair under
    err = {"l1": err / unit, "l2": err / unit**2, "ncc": err.clamp_min(0.0)}[objective]
    if objective != "ncc":  # the grid search's squared error
        landscape = landscape / unit**2
    bounds = _at_bound(sh, sw, (lo_h, hi_h), (lo_w, hi_w))
    if t.ndim == 2:
        return Alignment(
            sh.item(), sw.item(), sy.item(), sx.item(), err.item(), warped, landscape, grid_h, grid_w, bounds[0]
        )
    return Alignment(sh, sw, sy, sx, err, warped, landscape, grid_h, grid_w, bounds)


def _at_bound(
    sh: torch.Tensor, sw: torch.Tensor, range_h: tuple[float, float], range_w: tuple[float, float]
) -> list[tuple[str, ...]]:
    """Per item, the scales found at an end of their range (within 1e-4 of it: the refinement
    stops on the boundary), with one warning for the call naming the ranges to widen."""
    found = []
    for h, w in zip(sh.tolist(), sw.tolist(), strict=True):
        found.append(
            tuple(
                name
                for name, value, (lo, hi) in (("scale_h", h, range_h), ("scale_w", w, range_w))
                if lo < hi and min(value - lo, hi - value) <= 1e-4 * hi
            )
        )
    hit = sorted({name for names in found for name in names})
    if hit:
        ranges = ", ".join(f"{n}={range_h if n == 'scale_h' else range_w}" for n in hit)
        verb = "lies" if len(hit) == 1 else "lie"
        warnings.warn(
            f"the best {' and '.join(hit)} {verb} at an end of the range searched ({ranges}): the truth may lie "
            f"beyond it; widen {', '.join(n + '=' for n in hit)} (on the command line "
            f"{', '.join('--' + n.replace('_', '-') for n in hit)})",
            stacklevel=3,
        )
    return found


def _unit_scale(t: torch.Tensor, x: torch.Tensor) -> float:
    """The power of two that brings the larger of the two images' peak amplitudes into [1, 2)."""
    peak = max(float(t.abs().amax()), float(x.abs().amax()))
    return 1.0 if peak == 0 else 2.0 ** -math.floor(math.log2(peak))


def _check_template_mask(mask: Any, t4: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Weights of shape (B, 1, h, w): ones when no mask is given."""
    b, _, h, w = t4.shape
    if mask is None:
        return torch.ones(b, 1, h, w, dtype=dtype, device=t4.device)
    m = as_tensor(mask, "template_mask").to(t4.device, dtype)
    allowed = [(h, w), (b, h, w)] if len(shape) >= 3 else [(h, w)]
    if tuple(m.shape) not in allowed:
        listed = " or ".join(str(a) for a in allowed)
        raise ValueError(f"template_mask must have shape {listed}, one weight per pixel, got {tuple(m.shape)}")
    m = m.expand(b, h, w)
    check_finite(m, "template_mask")
    if (m < 0).any():
        raise ValueError("template_mask must hold non-negative weights, got negative values")
    if (m.reshape(b, -1).sum(1) <= 0).any():
        raise ValueError("template_mask must keep some pixels: it is all zero (for at least one pair)")
    return m.reshape(b, 1, h, w).contiguous()


def _scale_grid(lo: float, hi: float, n_pixels: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Scales from lo to hi, so that neighbours move the template's far edge by <= 1 pixel."""
    if hi == lo:
        return torch.tensor([lo], dtype=dtype, device=device)
    step = min(_MAX_STEP, _EDGE_STEP / max(n_pixels, 1))
    n = math.ceil((hi - lo) / step) + 1
    return torch.linspace(lo, hi, n, dtype=dtype, device=device)


def _align(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    range_h: tuple[float, float],
    range_w: tuple[float, float],
    objective: str,
    budget: int,
    uniform: bool,
) -> tuple[torch.Tensor, ...]:
    b, c, h, w = t.shape
    factor = 2 if min(h, w) >= 48 else 1
    tc, xc = _downsample(t, factor), _downsample(x, factor)
    mc = None if uniform else _downsample(mask, factor)
    grid_h = _scale_grid(*range_h, tc.shape[-2], x.device, x.dtype)
    grid_w = _scale_grid(*range_w, tc.shape[-1], x.device, x.dtype)
    cand, landscape = _grid_search(tc, xc, mc, grid_h, grid_w, objective == "ncc", budget)
    # candidates at full resolution: scales carry over, shifts scale with the factor
    m = cand.shape[1]
    cand = cand.reshape(b * m, 4) * torch.tensor([1.0, 1.0, factor, factor], dtype=cand.dtype, device=cand.device)
    owner = torch.arange(b, device=x.device).repeat_interleave(m)
    n_par = 6 if objective == "ncc" else 4
    hh, ww = x.shape[-2:]
    # one candidate's refinement: sampling matrices, its image, and (C, h, w) blocks per parameter
    per_cand = x.element_size() * (4 * (h * hh + w * ww) + c * (hh * ww + 3 * h * ww + (2 * n_par + 8) * h * w))
    step = chunk_rows(budget, per_cand, "the refinement of one candidate")
    workers = workers_for(x.device)
    if workers > 1 and b > 1:
        # shared out by whole pairs, a few chunks per worker: every chunk pays the refinement's
        # per-iteration overhead once, so a pair's candidates stay together
        step = min(step, m * share_size(b, workers))
    starts = range(0, b * m, step)
    params: list[torch.Tensor] = [cand] * len(starts)
    errs: list[torch.Tensor] = [cand] * len(starts)

    def refine(n: int) -> None:
        part = slice(starts[n], starts[n] + step)
        p = _refine(t, x, mask, owner[part], cand[part], range_h, range_w, objective == "ncc")
        params[n] = torch.stack(p, 1)
        errs[n] = _objective(t, x, mask, owner[part], p, objective)

    share_out(range(len(starts)), refine, workers, name="densematch-align")
    err = torch.cat(errs)
    pick = torch.arange(b, device=x.device) * m + err.view(b, m).argmin(1)
    sh, sw, sy, sx = torch.cat(params)[pick].unbind(1)
    warped = _warp(x, sh, sw, sy, sx, (h, w))
    return sh, sw, sy, sx, err[pick], warped, landscape, grid_h, grid_w


def _downsample(v: torch.Tensor, factor: int) -> torch.Tensor:
    if factor == 1:
        return v
    hh, ww = (v.shape[-2] // factor) * factor, (v.shape[-1] // factor) * factor
    return F.avg_pool2d(v[..., :hh, :ww], factor)


def _grid_search(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    grid_h: torch.Tensor,
    grid_w: torch.Tensor,
    ncc: bool,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates (B, M, 4) as (scale_h, scale_w, shift_y, shift_x) and the landscape (B, nh, nw)."""
    b, c, h, w = t.shape
    hh, ww = x.shape[-2:]
    nh, nw = grid_h.numel(), grid_w.numel()
    uniform = mask is None
    if mask is None:
        mask = torch.ones(b, 1, h, w, dtype=t.dtype, device=t.device)
    # rows and columns of the stretched image that any valid crop can touch
    rows = math.floor(hh * grid_h.max().item())
    cols = math.floor(ww * grid_w.max().item())
    zeros_h, zeros_w = torch.zeros_like(grid_h), torch.zeros_like(grid_w)
    ry = _sampling_matrix(rows, hh, grid_h, zeros_h)  # (nh, rows, H)
    rx = _sampling_matrix(cols, ww, grid_w, zeros_w)  # (nw, cols, W)
    # valid integer shifts: 0 <= s <= H * scale - h
    max_y = torch.floor(hh * grid_h - h + 1e-6).long()
    max_x = torch.floor(ww * grid_w - w + 1e-6).long()
    n_y, n_x = int(max_y.max().item()) + 1, int(max_x.max().item()) + 1
    ok_y = torch.arange(n_y, device=x.device) <= max_y[:, None]  # (nh, n_y)
    ok_x = torch.arange(n_x, device=x.device) <= max_x[:, None]  # (nw, n_x)
    valid = ok_y[:, None, :, None] & ok_x[None, :, None, :]  # (nh, nw, n_y, n_x)
    # FFT size covering every crop without wrap-around, rounded up to a fast length
    fh, fw = _fast_length(rows), _fast_length(cols)
    item = x.element_size()
    per_pair = fh * fw * item * (6 * c + 8)  # one pair, one scale pair: images, squares, spectra
    stretch = f"({grid_h.max().item():g}, {grid_w.max().item():g})"
    what = f"the search of one scale pair of a {hh}x{ww} image stretched up to {stretch}"
    chunk_rows(budget, per_pair, what, fix="raise memory or narrow the scale ranges")
    # on a CPU, chunks past a few tens of MiB fall out of cache and run slower per pair
    cap = budget if x.device.type == "cuda" else max(per_pair, min(budget, _CPU_CHUNK))
    pairs = chunk_rows(cap, per_pair, what)
    workers = workers_for(x.device)
    if workers > 1:  # a few chunks per worker, so that a slowed one leaves little behind
        pairs = min(pairs, share_size(b * nh * nw, workers))
    step_w = min(nw, pairs)
    step_h = min(nh, max(1, pairs // step_w))
    step_b = max(1, min(b, pairs // (nh * nw)))
    chunks = [(s, r, col) for s in range(0, b, step_b) for r in range(0, nh, step_h) for col in range(0, nw, step_w)]
    found: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def search(chunk: tuple[int, int, int]) -> None:
        s, r, col = chunk
        e, q, v = min(b, s + step_b), slice(r, r + step_h), slice(col, col + step_w)
        args = (t[s:e], x[s:e], mask[s:e], ry[q], rx[v], (fh, fw), (n_y, n_x), ncc, uniform)
        score = _shift_scores(*args).masked_fill(~valid[q, v], math.inf)
        found[chunk] = score.flatten(3).min(3)  # best and where, (bc, rows, cols of the scale grid)

    share_out(chunks, search, workers, name="densematch-align")
    land, cands = [], []
    for s in range(0, b, step_b):
        rows_of = [[found[(s, r, col)] for col in range(0, nw, step_w)] for r in range(0, nh, step_h)]
        best = torch.cat([torch.cat([bw[0] for bw in row], 2) for row in rows_of], 1)
        where = torch.cat([torch.cat([bw[1] for bw in row], 2) for row in rows_of], 1)
        land.append(best)
        cands.append(_pick_candidates(best, where, grid_h, grid_w, n_x))
    return torch.cat(cands), torch.cat(land)


def _fast_length(n: int) -> int:
    """The smallest length >= n whose only prime factors are 2, 3 and 5 (fast FFT sizes)."""
    while True:
        m = n
        for f in (2, 3, 5):
            while m % f == 0:
                m //= f
        if m == 1:
            return n
        n += 1


def _window_sums(v: torch.Tensor, size: tuple[int, int], n_shift: tuple[int, int]) -> torch.Tensor:
    """Sums of v over every (h, w) window at shifts [0, n_y) x [0, n_x), from an integral image."""
    ii = F.pad(v.cumsum(-1).cumsum(-2), (1, 0, 1, 0))
    (h, w), (ny, nx) = size, n_shift
    return ii[..., h : h + ny, w : w + nx] - ii[..., :ny, w : w + nx] - ii[..., h : h + ny, :nx] + ii[..., :ny, :nx]


def _shift_scores(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    ry: torch.Tensor,
    rx: torch.Tensor,
    fft_size: tuple[int, int],
    n_shift: tuple[int, int],
    ncc: bool,
    uniform: bool,
) -> torch.Tensor:
    """(B, nh, nw, n_y, n_x): weighted squared error, or 1 - NCC, at every integer shift.

    sum_w (T - S)^2 = sum_w T^2 - 2 sum_w T S + sum_w S^2: the cross term is an FFT correlation;
    the last is a window sum of S^2 when the weights are uniform, another correlation if not.
    """
    _b, c, h, w = t.shape
    # stretched images (B, C, nh, nw, rows, cols), by two batched matrix products
    s = torch.einsum("hrH,bcHW->bchrW", ry, x)
    s = torch.einsum("bchrW,wkW->bchwrk", s, rx)

    def spec(v: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft2(v, s=fft_size)

    def corr(img_spec: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        # circular cross-correlation, valid for shifts that keep the kernel inside the image
        k = spec(kernel)[:, :, None, None].conj()
        out = torch.fft.irfft2(img_spec * k, s=fft_size)
        return out[..., : n_shift[0], : n_shift[1]]

    def weighted_sum(v: torch.Tensor) -> torch.Tensor:  # sum_w v over the window at each shift
        if uniform:
            return _window_sums(v, (h, w), n_shift).sum(1)
        return corr(spec(v), mask.expand_as(t)).sum(1)

    s_spec = spec(s)
    wt = mask * t
    cross = corr(s_spec, wt).sum(1)  # sum_w T S
    energy = weighted_sum(s * s)  # sum_w S^2
    total = mask.sum((1, 2, 3)) * c  # sum of weights over pixels and channels
    if not ncc:
        tt = (wt * t).sum((1, 2, 3))
        return (tt[:, None, None, None, None] - 2 * cross + energy).clamp_min(0) / total[:, None, None, None, None]
    mean_s = weighted_sum(s) / total[:, None, None, None, None]
    mean_t = wt.sum((1, 2, 3)) / total
    var_t = (wt * t).sum((1, 2, 3)) / total - mean_t**2
    cov = cross / total[:, None, None, None, None] - mean_s * mean_t[:, None, None, None, None]
    var_s = (energy / total[:, None, None, None, None] - mean_s**2).clamp_min(0)
    denom = (var_s * var_t[:, None, None, None, None]).sqrt().clamp_min(1e-12)
    return 1 - cov / denom


def _pick_candidates(
    best: torch.Tensor, where: torch.Tensor, grid_h: torch.Tensor, grid_w: torch.Tensor, n_x: int
) -> torch.Tensor:
    """The best local minima of the (scale_h, scale_w) landscape, as (B, M, 4) parameters."""
    _b, nh, nw = best.shape
    pooled = -F.max_pool2d(-best[:, None], 3, stride=1, padding=1)[:, 0]
    minima = best <= pooled
    ranked = torch.where(minima, best, math.inf).flatten(1)
    m = min(_CANDIDATES, nh * nw)
    _, idx = ranked.topk(m, dim=1, largest=False)
    # where a landscape has fewer minima than M, fill from the plain ranking
    fallback = best.flatten(1).topk(m, dim=1, largest=False).indices
    idx = torch.where(torch.isfinite(ranked.gather(1, idx)), idx, fallback)
    ih, iw = idx // nw, idx % nw
    shift = where.flatten(1).gather(1, idx)
    sy, sx = (shift // n_x).to(grid_h.dtype), (shift % n_x).to(grid_h.dtype)
    return torch.stack((grid_h[ih], grid_w[iw], sy, sx), dim=-1)


def _refine(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    start: torch.Tensor,
    range_h: tuple[float, float],
    range_w: tuple[float, float],
    photometric: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt on (scale_h, scale_w, shift_y, shift_x) [+ gain, bias], batched.

    Candidate i starts at ``start[i]`` (M, 4) and fits template ``owner[i]`` into its image."""
    m = owner.numel()
    h, w = t.shape[-2:]
    hh, ww = x.shape[-2:]
    r_idx = torch.arange(h, dtype=x.dtype, device=x.device)
    c_idx = torch.arange(w, dtype=x.dtype, device=x.device)
    n_par = 6 if photometric else 4
    p = torch.zeros(m, n_par, dtype=x.dtype, device=x.device)
    p[:, :4] = start
    if photometric:
        p[:, 4] = 1.0
    lam = torch.full((m,), 1e-3, dtype=x.dtype, device=x.device)
    sqrt_w = mask.sqrt()

    def project(q: torch.Tensor) -> torch.Tensor:
        q = q.clone()
        q[:, 0] = q[:, 0].clamp(*range_h)
        q[:, 1] = q[:, 1].clamp(*range_w)
        q[:, 2] = torch.minimum(q[:, 2].clamp_min(0), hh * q[:, 0] - h)
        q[:, 3] = torch.minimum(q[:, 3].clamp_min(0), ww * q[:, 1] - w)
        return q

    def residual(q: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cost (n,), J^T J (n, P, P) and J^T r (n, P) of the candidates ``sel`` at ``q``."""
        pair = owner[sel]
        xs, ts, ws = x[pair], t[pair], sqrt_w[pair]
        n = q.shape[0]
        ry = _sampling_matrix(h, hh, q[:, 0], q[:, 2])
        rx = _sampling_matrix(w, ww, q[:, 1], q[:, 3])
        dry = _sampling_matrix(h, hh, q[:, 0], q[:, 2], derivative=True)
        drx = _sampling_matrix(w, ww, q[:, 1], q[:, 3], derivative=True)
        a = ry[:, None] @ xs  # (n, c, h, W)
        warped = a @ rx[:, None].transpose(-1, -2)
        gy = (dry[:, None] @ xs) @ rx[:, None].transpose(-1, -2)  # d warped / d row coordinate
        gx = a @ drx[:, None].transpose(-1, -2)  # d warped / d column coordinate
        if photometric:
            gain, bias = q[:, 4, None, None, None], q[:, 5, None, None, None]
            model, gy, gx = warped * gain + bias, gy * gain, gx * gain
        else:
            model = warped
        res = (ws * (model - ts)).reshape(n, -1)
        dy_dsh = -(r_idx + q[:, 2, None] + 0.5) / q[:, 0, None] ** 2  # (n, h)
        dx_dsw = -(c_idx + q[:, 3, None] + 0.5) / q[:, 1, None] ** 2
        cols = [
            gy * dy_dsh[:, None, :, None],
            gx * dx_dsw[:, None, None, :],
            gy / q[:, 0, None, None, None],
            gx / q[:, 1, None, None, None],
        ]
        if photometric:
            cols += [warped, torch.ones_like(warped)]
        j = torch.stack([(ws * col).reshape(n, -1) for col in cols], dim=-1)
        return res.square().sum(1), j.transpose(1, 2) @ j, (j.transpose(1, 2) @ res[..., None])[..., 0]

    every = torch.arange(m, device=x.device)
    p = project(p)
    cost, jtj, jtr = residual(p, every)
    eye = torch.eye(n_par, dtype=x.dtype, device=x.device)
    scale = torch.tensor([h, w, 1.0, 1.0], dtype=x.dtype, device=x.device)
    active = every
    for _ in range(_ITERATIONS):
        # only candidates still moving are computed: batches stop paying for the slowest
        lam_a = lam[active]
        system = jtj[active] + (jtj[active] * eye) * lam_a[:, None, None] + eye * 1e-12
        step = torch.linalg.solve(system, -jtr[active][..., None])[..., 0]
        trial = project(p[active] + step)
        cost_t, jtj_t, jtr_t = residual(trial, active)
        old = cost[active]
        better = cost_t < old
        gain = torch.where(better, (old - cost_t) / old.clamp_min(1e-30), 0.0)
        keep = better[:, None]
        p[active] = torch.where(keep, trial, p[active])
        jtj[active] = torch.where(keep[..., None], jtj_t, jtj[active])
        jtr[active] = torch.where(keep, jtr_t, jtr[active])
        cost[active] = torch.where(better, cost_t, old)
        lam[active] = torch.where(better, lam_a * 0.3, lam_a * 10).clamp(1e-9, 1e9)
        # done: moved by under a thousandth of a pixel, stopped improving, or gave up
        moved = (step[:, :4].abs() * scale).amax(1)
        done = (better & ((moved < 1e-3) | (gain < 1e-9))) | (~better & (lam_a * 10 >= 1e6))
        active = active[~done]
        if active.numel() == 0:
            break
    return p[:, 0], p[:, 1], p[:, 2], p[:, 3]


def _objective(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    objective: str,
) -> torch.Tensor:
    """The objective (M,) of candidates (template ``owner[i]``) at the parameters."""
    t, x, mask = t[owner], x[owner], mask[owner]
    warped = _warp(x, *params, (t.shape[-2], t.shape[-1]))
    total = mask.sum((1, 2, 3)) * t.shape[1]
    diff = warped - t
    if objective == "l1":
        return (mask * diff.abs()).sum((1, 2, 3)) / total
    if objective == "l2":
        return (mask * diff.square()).sum((1, 2, 3)) / total
    mw = (mask * warped).sum((1, 2, 3)) / total
    mt = (mask * t).sum((1, 2, 3)) / total
    dw = warped - mw[:, None, None, None]
    dt = t - mt[:, None, None, None]
    cov = (mask * dw * dt).sum((1, 2, 3))
    var = ((mask * dw * dw).sum((1, 2, 3)) * (mask * dt * dt).sum((1, 2, 3))).sqrt().clamp_min(1e-12)
    return 1 - cov / var
