"""Stretch-and-shift alignment of a template into an image, found globally: the public call.

Convention (docs/align.md): template pixel (r, c) looks at image coordinate
((r + shift_y + 0.5) / scale_h - 0.5, (c + shift_x + 0.5) / scale_w - 0.5), sampled bilinearly:
the image resized by (scale_h, scale_w) as ``torch.nn.functional.interpolate`` does with
``scale_factor`` and ``align_corners=False``, then cropped at (shift_y, shift_x).

Because that warp is separable, a warped image is two small matrix products,
``Ry @ image @ Rx.T``, with Ry (h, H) and Rx (w, W) bilinear weights. The search, on a pyramid
whose coarsest level has a template of 20 to 39 pixels on its shorter side:

1. Exhaustive search on a grid at the coarsest level: for every scale pair, the squared error (or
   the NCC) at every integer shift at once (search.py).
2. Distinct candidates: per scale pair the best few shifts, of those the best few far apart.
3. Each candidate is refined continuously (Levenberg-Marquardt on the four parameters, with
   gain and bias for NCC) level by level, the best few going on to the next, and at full
   resolution the best by the requested objective wins (refine.py).

On a CPU with the C kernels, steps 1-3 from the pyramid to the answer's warp are one call of C
(:func:`_search_c`); the torch path takes them one at a time (:func:`_search_steps`).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from ..budget import chunk_rows
from ..checks import as_tensor, check_bool, check_choice, check_finite, check_real, compute_dtype
from ..choices import ObjectiveName
from ..config import kernel_setting, resolve_memory
from ..kernels import native, ops_for
from ..threads import share_out, share_size, workers_for
from .refine import _ITERATIONS, objective_at, refine
from .search import (
    _Plan,
    _plan,
    candidate_rule,
    downsample,
    grid_minima,
    grid_search,
    scale_grid,
    shift_errors,
)
from .warp import as_image, warp_batch

__all__ = ["OBJECTIVES", "Alignment", "align", "shift_landscape"]

OBJECTIVES = ("l1", "l2", "ncc")
_COARSE_SIDE = 20  # the grid's template side, at least: coarser levels lose the photographs' detail
_KEEP = (4, 2)  # candidates each pair keeps after the grid's level, then after each finer one
# of those, one this close to a better one in both scales and both shifts (full-resolution
# pixels) is the same candidate again (most pairs hand two identical ones on): refined once, and
# not replaced. Near ones stay: two starts pinned 0.002 and 0.3 px apart at a coarse scale bound
# parted at the next level (a rocket case of benchmarks/suites/bench_align.py)
_SAME = (1e-3, 0.1)
# refinement done once a step moves no template pixel this far (in the level's pixels): coarse
# levels only hand a start to the next
_TOLERANCE, _COARSE_TOLERANCE = 1e-3, 0.05
# a candidate that full resolution moved this far (pixels at the template's far edge) came from a
# coarse start that was off, and crossed fine texture on the way, whose small basins can hold it
# short of the truth: it is refined again from where it stopped, first on both images blurred
# (a 3x3 binomial filter), then sharp, and the better of the two stays
_FAR = 1.0
# the least share of the template's energy the coarsest level must hold below _BAND_EDGE cycles
# per level pixel (:func:`_low_band`): photographs keep 0.07-0.95 at the level they search,
# masks 0.79 and more, while a periodic texture finer than the level keeps none (benchmarks/
# history/2026-12-05-align-on-fine-textures-again-the-level-rule.md). Not the level's Nyquist frequency (0.5): a
# texture just under it has about two samples a period there, so a one-pixel step of the
# grid's shifts moves it by half a period, and warping one adds beats of lower frequency,
# which alone passed the rule (periods 3-4 at a factor of 2)
_LOW_BAND = 0.02
_BAND_EDGE = 0.35


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
    landscape_shifts : Tensor of shape (B, n_h, n_w, 2)
        The best integer shift (shift_y, shift_x) of each scale pair of the landscape, in the
        image's pixels (the search resolution's, times its factor); NaN where none is valid.
    scales_h, scales_w : Tensor of shape (n_h,) and (n_w,)
        The grid's scales.
    at_bound : tuple of str, or list of them for batches
        The scales found at an end of their range ("scale_h", "scale_w"): the truth may lie
        beyond it (:func:`align` warns, naming the range to widen).
    relative_error : float, or Tensor of shape (B,)
        ``error`` against the template's own spread (by the same objective, the error of the
        best flat fit: its weighted mean absolute or squared deviation; 1 for "ncc", whose error
        is relative already): near 0 for a good fit, 1 for a fit no better than a constant.
        The command line warns above 0.5.
    certificate : Certificate, or list of them for batches, or None
        With ``certify=True``: the last certificate of each pair's answer. An answer not
        certified says why (``reason``) and how far a better fit can lie (``within``).
    """

    scale_h: float | torch.Tensor
    scale_w: float | torch.Tensor
    shift_y: float | torch.Tensor
    shift_x: float | torch.Tensor
    error: float | torch.Tensor
    warped: torch.Tensor
    landscape: torch.Tensor
    landscape_shifts: torch.Tensor
    scales_h: torch.Tensor
    scales_w: torch.Tensor
    at_bound: tuple[str, ...] | list[tuple[str, ...]] = ()
    certificate: Any = None
    relative_error: float | torch.Tensor = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The warp and error as plain Python numbers (lists for batches), ``at_bound``, and
        with ``certify=True`` each certificate's verdict (:meth:`Certificate.as_dict`)."""
        out: dict[str, Any] = {
            k: (v.tolist() if isinstance(v, torch.Tensor) else v)
            for k, v in (
                ("scale_h", self.scale_h),
                ("scale_w", self.scale_w),
                ("shift_y", self.shift_y),
                ("shift_x", self.shift_x),
                ("error", self.error),
                ("relative_error", self.relative_error),
            )
        }
        bound = self.at_bound
        out["at_bound"] = [list(b) for b in bound] if isinstance(bound, list) else list(bound)
        cert = self.certificate
        if cert is not None:
            out["certificate"] = [c.as_dict() for c in cert] if isinstance(cert, list) else cert.as_dict()
        return out


def _check_range(value: Any, name: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair (low, high) of positive floats, got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi < lo:
        raise ValueError(f"{name} must be a pair (low, high) with 0 < low <= high, got {value!r}")
    return lo, hi


def checked_images(
    template: Any, image: Any, range_h: tuple[float, float], range_w: tuple[float, float], *, finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``template`` and ``image`` as tensors in one of align's layouts, with the same batch and
    channels, on one device, not empty, the image finite (unless not ``finite``: the caller's to
    check), and the template fitting inside the image at the scales searched. The template's
    values are the caller's to check: a mask may hide some of them."""
    t = as_image(template, "template")
    x = as_image(image, "image")
    if t.ndim not in (2, 3, 4):
        raise ValueError(f"template must have shape (h, w), (B, h, w) or (B, C, h, w), got {tuple(t.shape)}")
    if x.ndim != t.ndim:
        raise ValueError(
            f"image must have the template's layout ({t.ndim} dims, as {tuple(t.shape)}), got {tuple(x.shape)}"
        )
    if t.ndim == 3 and t.shape[-1] == x.shape[-1] in (3, 4):
        # (h, w, 3) would be read as a batch of h templates 3 pixels wide: say how colour is given
        raise ValueError(
            f"template {tuple(t.shape)} and image {tuple(x.shape)} read as batches of {t.shape[-1]}-pixel-wide "
            "images (B, h, w); colour images go as (1, C, h, w): pass x.permute(2, 0, 1)[None] (torch) or "
            "np.moveaxis(x, -1, 0)[None] (numpy), or grey images; a batch of narrow templates as (B, 1, h, w)"
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
    if finite:
        check_finite(x, "image")
    (h, w), (hh, ww) = t.shape[-2:], x.shape[-2:]
    _check_fits((h, w), (hh, ww), range_h, range_w)
    return t, x


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


def _inputs(
    template: Any,
    image: Any,
    range_h: tuple[float, float],
    range_w: tuple[float, float],
    objective: str,
    template_mask: Any,
    *,
    finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """align's inputs checked: ``template`` and ``image`` as tensors (:func:`checked_images`),
    both as (B, C, h, w) and (B, C, H, W) in the compute dtype, and the weights (B, 1, h, w);
    the template finite where its weight is not 0, and 0 where it is. Not ``finite``: without a
    mask, the caller checks that both are finite (C's search does, first thing)."""
    check_choice(objective, "objective", OBJECTIVES)
    t, x = checked_images(template, image, range_h, range_w, finite=finite)
    h, w = t.shape[-2:]
    hh, ww = x.shape[-2:]
    dtype = compute_dtype(t, x)
    t4 = t.to(dtype).reshape(-1, *t.shape[-3:]) if t.ndim == 4 else t.to(dtype).reshape(-1, 1, h, w)
    x4 = x.to(dtype).reshape(-1, *x.shape[-3:]) if x.ndim == 4 else x.to(dtype).reshape(-1, 1, hh, ww)
    mask = _check_template_mask(template_mask, t4, t.shape, dtype)
    if template_mask is None:
        if finite:
            check_finite(t4, "template")
    else:  # a pixel of weight 0 is never read: NaN or Inf there is allowed, and set to 0 here
        read = mask[:, 0] > 0
        check_finite(t4.permute(0, 2, 3, 1), "template", mask=read)
        t4 = t4.masked_fill(~read[:, None], 0.0)
    return t, x, t4, x4, mask


def _check_pair_finite(t: torch.Tensor, x: torch.Tensor, *, template: bool = True) -> None:
    """The image, then the template (unless not ``template``: its mask's check is the caller's),
    finite, as C's search checks them first where it runs."""
    check_finite(x, "image")
    if template:
        check_finite(t, "template")


def _centred(
    t4: torch.Tensor, x4: torch.Tensor, unit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``t4`` and ``x4`` less the image's mean level (B, C, 1, 1), both at unit amplitude, with
    that level and the unit. Every objective is blind to a level both share (a bilinear sample
    of a constant is that constant), and the grid's expanded sums (T^2 - 2 T S + S^2, window
    sums of S and S^2) would lose a texture of 0.01 on a level of 500 to float32's rounding.
    The unit is a power of two, so exact: the search's and the refinement's fixed epsilons then
    mean the same for images of any amplitude or dtype. ``unit``: the one to use (a whole batch's)."""
    level = x4.mean((2, 3), keepdim=True)
    t4, x4 = t4 - level, x4 - level
    if unit is None:
        unit = _unit_scale(t4, x4)
    return t4 * unit, x4 * unit, level, unit


def align(
    template: Any,
    image: Any,
    *,
    scale_h: tuple[float, float] = (0.8, 1.2),
    scale_w: tuple[float, float] = (0.8, 1.2),
    objective: ObjectiveName = "l1",
    template_mask: Any = None,
    memory: int | str | None = None,
    certify: bool = False,
    time_limit: float | None = None,
) -> Alignment:
    """Find the stretch and shift that fit `template` into `image`, globally, to sub-pixel precision.

    Which options fit which job, and what each costs: docs/choosing.md.

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
    certify : bool, default=False
        After the search, :func:`densematch.certify_alignment` each pair's answer. Where the
        certificate finds a better fit, the answer is refined from it and certified again, until
        it is certified or ``time_limit`` runs out: no silent miss. "l1" and "l2" only, without
        ``template_mask``. The certificates come back as ``certificate``.
    time_limit : float, optional
        Seconds per pair for ``certify`` (None: until certified or no better fit is found).

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

    References
    ----------
    - K. Levenberg, "A method for the solution of certain non-linear problems in least
      squares", Quarterly of Applied Mathematics 2(2), 164-168, 1944, and D. W. Marquardt, "An
      algorithm for least-squares estimation of nonlinear parameters", Journal of the SIAM 11(2),
      431-441, 1963: the refinement.
    - J. P. Lewis, "Fast normalized cross-correlation", Vision Interface, 1995: the "ncc"
      objective's window sums.
    - A. H. Land and A. G. Doig, "An automatic method of solving discrete programming problems",
      Econometrica 28(3), 497-520, 1960: the branch and bound of ``certify``.
    - G. D. Evangelidis and E. Z. Psarakis, "Parametric image alignment using enhanced
      correlation coefficient maximization", IEEE TPAMI 30(10), 1858-1865, 2008: OpenCV's ECC,
      the local method of the same speed class (BENCHMARKS.md).

    Examples
    --------
    >>> from densematch import warp
    >>> img = torch.rand(60, 60)
    >>> tpl = warp(img, 1.1, 0.9, 4.25, 3.5, (48, 40))
    >>> a = align(tpl, img)
    >>> round(a.scale_h, 3), round(a.scale_w, 3), round(a.shift_y, 2), round(a.shift_x, 2)
    (1.1, 0.9, 4.25, 3.5)
    """
    (lo_h, hi_h), (lo_w, hi_w) = _check_range(scale_h, "scale_h"), _check_range(scale_w, "scale_w")
    # C's search checks that both are finite itself, before anything else: the checks here are
    # for torch's path
    t, x, t4, x4, mask = _inputs(template, image, (lo_h, hi_h), (lo_w, hi_w), objective, template_mask, finite=False)
    in_c = ops_for(kernel_setting() != "torch", x4.device, x4.dtype).c
    if not in_c:
        _check_pair_finite(t4, x4, template=template_mask is None)
    budget = resolve_memory(memory, x.device)
    if check_bool(certify, "certify"):
        if objective == "ncc":
            raise ValueError("certify=True needs objective 'l1' or 'l2' (its bound is on differences), got 'ncc'")
        if template_mask is not None:
            raise ValueError("certify=True does not take template_mask (its bound weighs every template pixel alike)")
    if time_limit is not None:
        time_limit = check_real(time_limit, "time_limit", 0.0, math.inf, finite=False)

    with torch.inference_mode():
        settings = _Settings((lo_h, hi_h), (lo_w, hi_w), objective, budget, template_mask is None, in_c)
        found = _search_pairs(t4, x4, mask, settings)
        certificates = None
        if certify:
            certificates = _certify_pairs((t4, x4), mask, found, settings, time_limit)
    warped, err, landscape = found.warped.reshape(t.shape), found.error, found.landscape
    warp_params = (found.scale_h, found.scale_w, found.shift_y, found.shift_x)
    bounds = _at_bound(found.scale_h, found.scale_w, (lo_h, hi_h), (lo_w, hi_w))
    grids = (found.grid_h, found.grid_w)
    relative = found.relative
    if relative is None or certify:  # C's search gives it; a certified answer may have moved
        relative = err / _spread(t4, mask, objective, template_mask is None).to(err.dtype)
    if t.ndim == 2:
        sh, sw, sy, sx = (float(v.item()) for v in warp_params)
        one = certificates[0] if certificates else None
        return Alignment(
            sh, sw, sy, sx, err.item(), warped, landscape, found.shifts, *grids, bounds[0], one, relative.item()
        )
    return Alignment(*warp_params, err, warped, landscape, found.shifts, *grids, bounds, certificates, relative)


def _spread(t: torch.Tensor, mask: torch.Tensor, objective: str, uniform: bool) -> torch.Tensor:
    """(B,) the error of the best flat fit to each template ``t`` (B, C, h, w) under the weights
    ``mask`` (B, 1, h, w): the weighted mean absolute ("l1") or squared ("l2") deviation from
    each channel's mean; 1 for "ncc". The smallest normal float where the template is flat.
    ``uniform``: every weight is 1 (plain means)."""
    if objective == "ncc":
        return torch.ones(t.shape[0], dtype=t.dtype, device=t.device)
    if uniform:  # plain means
        dev = t - t.mean((2, 3), keepdim=True)
        dev = dev.abs() if objective == "l1" else dev.square()
        return dev.mean((1, 2, 3)).clamp_min(torch.finfo(t.dtype).tiny)
    total = mask.sum((2, 3), keepdim=True)
    dev = t - (t * mask).sum((2, 3), keepdim=True) / total
    dev = dev.abs() if objective == "l1" else dev.square()
    spread = (dev * mask).sum((2, 3)).mean(1) / total.reshape(-1)
    return spread.clamp_min(torch.finfo(t.dtype).tiny)


_ROUNDS = 20  # certify-and-refine rounds per pair at most: each round's answer is strictly better


def shift_landscape(
    template: Any,
    image: Any,
    scale_h: float,
    scale_w: float,
    *,
    objective: ObjectiveName = "l1",
    template_mask: Any = None,
    memory: int | str | None = None,
) -> torch.Tensor:
    """The grid search's error at every integer shift of one scale pair, at full resolution.

    The landscape over the shifts where :attr:`Alignment.landscape` is the one over the scales
    (each of its cells the best of such a landscape, at the search resolution): for pictures,
    and to see how distinct the answer's basin is.

    Parameters
    ----------
    template, image : Tensor or ndarray
        As for :func:`align`: (h, w) and (H, W), (B, h, w) and (B, H, W), or (B, C, h, w) and
        (B, C, H, W).
    scale_h, scale_w : float
        The scale pair, positive; the template must fit in the image stretched by it.
    objective : {"l1", "l2", "ncc"}, default="l1"
        "ncc" gives 1 - NCC; "l1" and "l2" the weighted mean squared error, as the grid scores
        both.
    template_mask, memory
        As for :func:`align`.

    Returns
    -------
    Tensor of shape (n_y, n_x), or (B, n_y, n_x) for batched input
        At [y, x] the error at shift (y, x), for every shift with the template inside the
        stretched image: n_y = floor(H * scale_h - h) + 1, n_x = floor(W * scale_w - w) + 1.

    Examples
    --------
    >>> from densematch import warp
    >>> img = torch.rand(60, 60)
    >>> tpl = warp(img, 1.1, 0.9, 4.0, 3.0, (48, 40))
    >>> errors = shift_landscape(tpl, img, 1.1, 0.9)
    >>> errors.shape, divmod(int(errors.argmin()), errors.shape[1])
    (torch.Size([19, 15]), (4, 3))
    """
    sh = check_real(scale_h, "scale_h", 0.0, math.inf, low_open=True)
    sw = check_real(scale_w, "scale_w", 0.0, math.inf, low_open=True)
    t, x, t4, x4, mask = _inputs(template, image, (sh, sh), (sw, sw), objective, template_mask)
    budget = resolve_memory(memory, x.device)
    with torch.inference_mode():
        t4, x4, _level, unit = _centred(t4, x4)
        weights = None if template_mask is None else mask
        in_c = ops_for(kernel_setting() != "torch", x4.device, x4.dtype).c
        errors = shift_errors(t4, x4, weights, sh, sw, objective == "ncc", budget, in_c)
    if objective != "ncc":
        errors = errors / unit**2
    return errors[0] if t.ndim == 2 else errors


def _certify_pairs(
    pairs: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    found: _Found,
    settings: _Settings,
    time_limit: float | None,
) -> list[Any]:
    """Each pair's answer in ``found`` certified (the pairs ``pairs``, as given), refined from the
    better fit a certificate finds (on the pairs at unit amplitude) and certified again, until
    certified, out of time or out of better fits; ``found`` is updated in place, in the pairs'
    own units. The pairs' certificates, in order."""
    from .certify import certify_alignment  # certify.py imports this module

    keys = ("scale_h", "scale_w", "shift_y", "shift_x")
    objective = settings.objective
    t, x = pairs
    tu, xu, _level, unit = _centred(t, x)
    h, w = t.shape[-2:]
    certificates = []
    for i in range(t.shape[0]):
        started = time.perf_counter()
        answer = [float(getattr(found, key)[i]) for key in keys]
        for _ in range(_ROUNDS):
            left = None if time_limit is None else max(0.0, time_limit - (time.perf_counter() - started))
            cert = certify_alignment(
                t[i : i + 1], x[i : i + 1], dict(zip(keys, answer, strict=True)),
                scale_h=settings.range_h, scale_w=settings.range_w, objective=objective, time_limit=left,
            )  # fmt: skip
            out_of_time = time_limit is not None and time.perf_counter() - started >= time_limit
            if cert.certified or cert.better_fit is None or out_of_time:
                break
            start = torch.tensor([cert.better_fit], dtype=tu.dtype, device=tu.device)
            owner = torch.zeros(1, dtype=torch.long, device=tu.device)
            pair = (tu[i : i + 1], xu[i : i + 1], mask[i : i + 1])
            refined, sums = _refine_all(*pair, owner, start, settings, _TOLERANCE)
            answer = refined[0].tolist()
            at_unit = sums[0, 0 if objective == "l2" else 1] / (mask[i].sum() * tu.shape[1])
            found.error[i] = at_unit / (unit**2 if objective == "l2" else unit)
        for key, value in zip(keys, answer, strict=True):
            getattr(found, key)[i] = value
        sh, sw, sy, sx = torch.tensor(answer, dtype=x.dtype, device=x.device)[:, None]
        found.warped[i] = warp_batch(x[i : i + 1], sh, sw, sy, sx, (h, w))[0]
        certificates.append(cert)
    return certificates


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
    return _unit_of(max(abs(float(v)) for image in (t, x) for v in torch.aminmax(image)))  # no |image| temporary


def _unit_of(peak: float) -> float:
    """The power of two that brings ``peak`` (> 0) into [1, 2); 1 for 0."""
    return 1.0 if peak == 0 else 2.0 ** -math.floor(math.log2(peak))


def _batch_unit(t4: torch.Tensor, x4: torch.Tensor) -> float | None:
    """:func:`_centred`'s unit for these pairs without their centred copies (None where a value
    is not finite: the checks that follow say so). ``fl(v - level)`` never decreases with ``v``,
    so each pair's and channel's extremes less its level are those of its centred copy."""
    level = x4.mean((2, 3))
    peak = 0.0
    for v in (t4.flatten(2), x4.flatten(2)):  # (amin and amax: a seventh of aminmax's time along a dim)
        peak = max(peak, float((level - v.amin(2)).amax()), float((v.amax(2) - level).amax()))
    return _unit_of(peak) if math.isfinite(peak) else None


def _check_template_mask(mask: Any, t4: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Weights of shape (B, 1, h, w): ones when no mask is given. One (h, w) for every pair
    (ones, or a mask of that shape) stays one, broadcast over B (stride 0): nothing copies it
    per pair."""
    b, _, h, w = t4.shape
    if mask is None:
        return _ones(h, w, dtype, t4.device).expand(b, 1, h, w)
    m = as_tensor(mask, "template_mask").to(t4.device, dtype)
    allowed = [(h, w), (b, h, w)] if len(shape) >= 3 else [(h, w)]
    if tuple(m.shape) not in allowed:
        listed = " or ".join(str(a) for a in allowed)
        raise ValueError(f"template_mask must have shape {listed}, one weight per pixel, got {tuple(m.shape)}")
    check_finite(m, "template_mask")
    if (m < 0).any():
        raise ValueError("template_mask must hold non-negative weights, got negative values")
    peak = m.reshape(-1, h * w).amax(1)
    if (peak <= 0).any():
        raise ValueError("template_mask must keep some pixels: it is all zero (for at least one pair)")
    # only the weights' ratios matter: each pair's largest becomes 1, so that weights of 1e-20
    # or 1e20 leave the search's and the refinement's fixed epsilons meaning what they mean
    return (m / peak.reshape(-1, 1, 1)).contiguous().reshape(-1, 1, h, w).expand(b, 1, h, w)


def _distinct(mask: torch.Tensor) -> torch.Tensor:
    """The distinct maps of weights ``mask`` (B, 1, h, w): the one every pair shares (1, 1, h, w)
    where it is broadcast (stride 0, as :func:`_check_template_mask` makes it), else all B."""
    return mask[:1] if mask.stride(0) == 0 else mask


@functools.lru_cache(maxsize=8)
def _ones(h: int, w: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uniform weights (1, 1, h, w), kept (never written: every use takes a view or a copy)."""
    with torch.inference_mode(False):  # kept past the call: usable in and out of inference mode
        return torch.ones(1, 1, h, w, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Settings:
    """One align call's settings, as every step of its search and refinement reads them."""

    range_h: tuple[float, float]
    range_w: tuple[float, float]
    objective: str
    budget: int
    uniform: bool  # no template mask: uniform weights, and the grid's sums need none
    in_c: bool  # whether the C kernels run (:func:`densematch.kernels.ops_for`), resolved once

    @property
    def photometric(self) -> bool:
        """Whether the refinement fits a gain and a bias too (NCC's invariance)."""
        return self.objective == "ncc"


@dataclass
class _Found:
    """What the search found for each pair (B,), in the pair's own units, with the grid it
    searched; ``relative`` (B,) where the search gave it (:func:`_spread`)."""

    scale_h: torch.Tensor
    scale_w: torch.Tensor
    shift_y: torch.Tensor
    shift_x: torch.Tensor
    error: torch.Tensor
    warped: torch.Tensor
    landscape: torch.Tensor
    shifts: torch.Tensor  # each scale pair's best integer shift (B, nh, nw, 2), full resolution
    grid_h: torch.Tensor
    grid_w: torch.Tensor
    relative: torch.Tensor | None = None


def _search_pairs(t: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, settings: _Settings) -> _Found:
    """:func:`_search` over the pairs, a few at a time on each worker thread: one pair's search is
    a few milliseconds of small steps, which threads inside it would only slow down."""
    b = t.shape[0]
    workers = workers_for(x.device)
    step = share_size(b, workers) if workers > 1 else b
    starts = range(0, b, step)
    parts: dict[int, _Found] = {}
    # what the pairs share is the whole batch's, so that every share searches the same grids at
    # the same amplitude and no answer depends on the thread count: the pyramid (its coarsest
    # level suits every template: a share's own could be coarser, and its grid smaller) and the
    # unit that torch's steps search at (:func:`_centred`)
    levels = _levels(t, None if settings.uniform else mask, settings.in_c)
    unit = None if len(starts) == 1 else _batch_unit(t, x)

    def search(i: int) -> None:
        part = slice(starts[i], starts[i] + step)
        parts[i] = _search(t[part], x[part], mask[part], settings, levels, unit)

    share_out(range(len(starts)), search, workers, name="densematch-align")
    if len(starts) == 1:
        return parts[0]
    done = [parts[i] for i in range(len(starts))]
    shared = ("grid_h", "grid_w")  # the same for every pair

    def joined(name: str) -> Any:  # a tensor, or None where the search gave none
        parts = [getattr(d, name) for d in done]
        return parts[0] if name in shared or parts[0] is None else torch.cat(parts)

    return _Found(**{f.name: joined(f.name) for f in fields(_Found)})


def _levels(t: torch.Tensor, mask: torch.Tensor | None, in_c: bool = False) -> list[int]:
    """The pyramid's downsampling factors, coarsest first: the grid searches a template of
    _COARSE_SIDE pixels or more on its shorter side, and coarse enough to keep some of the
    template's own content (:func:`_low_band`; its sums in C with ``in_c``); each level halves the
    factor to 1."""
    h, w = t.shape[-2:]
    f = 1
    while min(h, w) // (2 * f) >= _COARSE_SIDE:
        f *= 2
    if f > 1:
        low = _low_band(t, mask, in_c)
        while f > 1 and low(f) < _LOW_BAND:
            f //= 2
    return [f >> i for i in range(f.bit_length())]


def _low_band(t: torch.Tensor, mask: torch.Tensor | None, in_c: bool = False) -> Callable[[int], float]:
    """For a factor f, the least over the pairs of ``t`` (B, C, h, w) of the share of the
    template's energy (weighted by ``mask`` (B or 1, 1, h, w), or uniformly where None, its mean
    off, under a Hann window against the crop's edges) at frequencies a level of factor f
    resolves: below _BAND_EDGE / f cycles per pixel on both axes (0.7 of its Nyquist frequency),
    less the window's main lobe. Above them, a block mean keeps only aliases, which stretch and
    shift differently from the template's texture: a fine periodic texture (period under 2 f) has
    none left, and its coarse grid finds the wrong phase. The energy is the windowed template's
    sum of squares (Parseval), the band's a DFT of its few frequencies only (:func:`_band_dft`):
    two small products instead of the whole spectrum, in float64 on the host: in C with ``in_c``
    (:func:`densematch.kernels.native.align_band`), else numpy's (a dozen small operations, which
    torch's per-operation cost would make most of the call)."""
    h, w = t.shape[-2:]
    if in_c:
        weights = _window(h, w)
        if mask is not None:
            weights = (_distinct(mask)[:, 0].to(torch.float64) * weights).contiguous()
        return lambda f: native.align_band(t, weights, *_band_dft(h, w, f))
    weight = _window(h, w).numpy()
    if mask is not None:
        weight = mask.detach().cpu().numpy() * weight
    v = t.detach().cpu().numpy().astype(np.float64)
    weight_sum = np.maximum(weight.sum((-2, -1), keepdims=True), 1e-30)
    v = (v - (v * weight).sum((-2, -1), keepdims=True) / weight_sum) * weight
    total = np.maximum(np.square(v).sum((1, 2, 3)) * (h * w), 1e-300)

    def share(f: int) -> float:
        rows, cols = (m.numpy() for m in _band_dft(h, w, f))
        n_y, n_x = rows.shape[0] // 2, cols.shape[1] // 2
        z = rows @ (v @ cols)  # (B, C, 2 n_y, 2 n_x): cos and sin along y, against cos and sin along x
        re = z[..., :n_y, :n_x] - z[..., n_y:, n_x:]
        im = z[..., n_y:, :n_x] + z[..., :n_y, n_x:]
        return float(((np.square(re) + np.square(im)).sum((1, 2, 3)) / total).min())

    return share


@functools.lru_cache(maxsize=8)
def _window(h: int, w: int) -> torch.Tensor:
    """:func:`_low_band`'s Hann window (1, h, w), float64, kept (never written)."""
    return torch.outer(*(torch.hann_window(n, periodic=False, dtype=torch.float64) for n in (h, w)))[None]


@functools.lru_cache(maxsize=16)
def _band_dft(h: int, w: int, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFT of an (h, w) image at the frequencies a level of factor f resolves (:func:`_low_band`):
    below _BAND_EDGE / f cycles per pixel on both axes, less the window's main lobe (2 / n),
    which smears a line over it. Rows (2 n_y, h): the cosines, then the sines, of the n_y
    frequencies along y (both signs); columns (w, 2 n_x): those of the n_x non-negative ones along
    x, each times the square root of 2 where it stands for its negative too (as rfft2's columns
    do), so that the squared sums are the band's power. float64, kept (never written)."""
    ky = np.flatnonzero(np.abs(np.fft.fftfreq(h)) < _BAND_EDGE / f - 2 / h)
    kx = np.flatnonzero(np.fft.rfftfreq(w) < _BAND_EDGE / f - 2 / w)
    along_y = 2 * np.pi * np.outer(ky, np.arange(h)) / h  # (n_y, h)
    along_x = 2 * np.pi * np.outer(np.arange(w), kx) / w  # (w, n_x)
    twice = ((kx > 0) & (kx < (w + 1) // 2)) + 1.0  # rfft2's doubled columns
    rows = np.concatenate((np.cos(along_y), np.sin(along_y)))
    cols = np.concatenate((np.cos(along_x), np.sin(along_x)), 1) * np.tile(np.sqrt(twice), 2)
    return torch.from_numpy(rows), torch.from_numpy(cols)


def _search(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    settings: _Settings,
    levels: list[int] | None = None,
    unit: float | None = None,
) -> _Found:
    """The pairs' search, in their own units: in C where it runs (:func:`_search_c`), else step by
    step in torch at unit amplitude (:func:`_centred`, :func:`_search_steps`). ``levels`` and
    ``unit``: the pyramid's and the amplitude's, where the pairs are a share of a batch's."""
    if settings.in_c:
        return _search_c(t, x, mask, settings, levels, unit)
    tu, xu, level, unit = _centred(t, x, unit)
    return _own_units(_search_steps(tu, xu, mask, settings, levels), level, unit, settings.objective)


def _own_units(found: _Found, level: torch.Tensor, unit: float, objective: str) -> _Found:
    """``found`` at unit amplitude (:func:`_centred`'s ``level`` and ``unit``) back in the pairs'
    own units: the warps, the errors and the landscape (squared errors; 1 - NCC as it is, at
    least 0: rounding may put a perfect fit a hair under)."""
    found.warped = found.warped / unit + level
    if objective == "ncc":
        found.error = found.error.clamp_min(0.0)
    else:
        found.error = found.error / (unit if objective == "l1" else unit**2)
        found.landscape = found.landscape / unit**2
    return found


def _search_steps(
    t: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, settings: _Settings, levels: list[int] | None = None
) -> _Found:
    """align's search step by step, in torch (``settings.in_c``: the grid and the refinements
    in C, each a call of its own, as :func:`_search_c` takes them in one); ``levels``: the
    pyramid's (:func:`_levels`, by default of these pairs)."""
    b, c, h, w = t.shape
    if levels is None:
        levels = _levels(t, None if settings.uniform else mask, settings.in_c)
    pyramid = {1: (t, x, mask)}
    for f in levels[-2::-1]:  # 2, 4, ...: each level halves the one below it
        tb, xb, mb = pyramid[f // 2]
        t_half, x_half = downsample(tb, 2), downsample(xb, 2)
        if settings.uniform:  # ones stay ones
            m_half = torch.ones(1, 1, *t_half.shape[-2:], dtype=mb.dtype, device=mb.device)
        else:
            m_half = downsample(_distinct(mb), 2)  # one mask for every pair stays one
        pyramid[f] = (t_half, x_half, m_half.expand(b, *m_half.shape[1:]))
    coarse = levels[0]
    tc, xc, mc = pyramid[coarse]
    grid_h = scale_grid(*settings.range_h, tc.shape[-2], x.device, x.dtype)
    grid_w = scale_grid(*settings.range_w, tc.shape[-1], x.device, x.dtype)
    weights = None if settings.uniform else mc
    args = (settings.photometric, settings.budget, settings.in_c)
    cand, landscape, shifts = grid_search(tc, xc, weights, grid_h, grid_w, *args)
    m = cand.shape[1]
    cand = cand.reshape(b * m, 4) * torch.tensor([1.0, 1.0, coarse, coarse], dtype=cand.dtype, device=cand.device)
    owner = torch.arange(b, device=x.device).repeat_interleave(m)
    for i, f in enumerate(levels):
        # each level refines what the coarser one kept, in its own pixels (shifts scale by 1 / f)
        tf, xf, mf = pyramid[f]
        scale = torch.tensor([1.0, 1.0, f, f], dtype=cand.dtype, device=cand.device)
        found, sums = _refine_all(tf, xf, mf, owner, cand / scale, settings, _tolerance(f))
        if f > 1:  # ranked by the squared error left (after gain and bias for NCC: the same order)
            cand = found * scale
            keep = _best_per_pair(cand, owner, sums[:, 0], _KEEP[min(i, len(_KEEP) - 1)])
            cand, owner = cand[keep], owner[keep]
    cand, owner, sums = _refine_far(t, x, mask, owner, cand, found, sums, settings)
    if settings.photometric:
        err = objective_at(t, x, mask, owner, (cand[:, 0], cand[:, 1], cand[:, 2], cand[:, 3]), "ncc")
    else:
        total = (mask.sum((1, 2, 3)) * c)[owner]
        err = sums[:, 0 if settings.objective == "l2" else 1] / total
    pick = _best_per_pair(cand, owner, err, 1)
    best = cand[pick]
    sh, sw, sy, sx = best.unbind(1)
    warped = warp_batch(x, sh, sw, sy, sx, (h, w))
    return _Found(sh, sw, sy, sx, err[pick], warped, landscape, shifts * coarse, grid_h, grid_w)


def _search_c(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    settings: _Settings,
    levels: list[int] | None = None,
    unit: float | None = None,
) -> _Found:
    """:func:`_search_steps` in one call of C (:func:`densematch.kernels.native.align_search`: the
    same steps from the pyramid to the warp, pair by pair, each at unit amplitude), in the pairs'
    own units; the grid too for uniform weights where its products cost less than transforms,
    else the minima of torch's chunks at unit amplitude (:func:`grid_minima`). ``levels`` and
    ``unit`` as :func:`_search` takes them."""
    b, c, h, w = t.shape
    if levels is None:  # (blind to a level and an amplitude)
        levels = _levels(t, None if settings.uniform else mask, True)
    coarse = levels[0]
    small = (b, c, h // coarse, w // coarse)  # the coarsest level: each halving floors
    small_x = (b, c, x.shape[-2] // coarse, x.shape[-1] // coarse)
    setup = _c_grid(settings.range_h, settings.range_w, small, small_x, settings.uniform, settings.budget, x.dtype)
    _refine_chunk(t, x, settings)  # the budget's rule, as in torch, at its largest level (C holds less)
    weights = None if settings.uniform else _distinct(mask)[:, 0]
    total = None if settings.uniform else mask.sum((1, 2, 3)) * c  # C counts uniform weights itself
    given, back = None, None
    if setup.grid.taps is None:  # the grid's minima from torch's chunks, at unit amplitude as C searches
        _check_pair_finite(t, x)  # before torch's steps, where C would have checked them first
        t, x, level, unit = _centred(t, x, unit)
        back = (level, unit)
        tc, xc = downsample(t, coarse), downsample(x, coarse)
        mc = None if weights is None else downsample(_distinct(mask), coarse)
        given = grid_minima(tc, xc, mc, settings.photometric, setup.plan, True)
    answer, error, warped, landscape, shifts, relative = native.align_search(
        t, x, weights, total, setup.grid, levels=len(levels), given=given, pick=setup.pick,
        candidates=setup.candidates, keep=(_KEEP[0], _KEEP[-1]), objective=OBJECTIVES.index(settings.objective),
        iterations=_ITERATIONS, ranges=(*settings.range_h, *settings.range_w), near=setup.near, same=_SAME,
        tolerance=(_COARSE_TOLERANCE, _TOLERANCE), far=_FAR,
    )  # fmt: skip
    sh, sw, sy, sx = answer.unbind(1)
    grids = (setup.grid_h.clone(), setup.grid_w.clone())  # the caller's own: the kept ones stay as made
    found = _Found(sh, sw, sy, sx, error, warped, landscape, shifts, *grids, relative)
    return found if back is None else _own_units(found, back[0], back[1], settings.objective)


@dataclass(frozen=True)
class _CGrid:
    """The coarsest level's grid as :func:`_search_c` hands it to C: its scales (in the search's
    dtype), its :func:`_plan`, the grid checked for C (:class:`densematch.kernels.native.AlignGrid`:
    with its taps where C searches it, its products costing less than transforms with uniform
    weights) and the candidate rule (:func:`candidate_rule`)."""

    grid_h: torch.Tensor
    grid_w: torch.Tensor
    plan: _Plan
    grid: native.AlignGrid
    pick: int
    candidates: int
    near: tuple[float, float, float, float]


@functools.lru_cache(maxsize=8)
def _c_grid(
    range_h: tuple[float, float],
    range_w: tuple[float, float],
    small: tuple[int, int, int, int],
    small_x: tuple[int, int, int, int],
    uniform: bool,
    budget: int,
    dtype: torch.dtype,
) -> _CGrid:
    """:class:`_CGrid` for a coarsest level of templates ``small`` (B, C, h, w) in images
    ``small_x`` on the CPU, kept (read-only, made outside inference mode): a loop over pairs of
    one size plans its grid once. A ValueError where ``budget`` cannot hold it, as :func:`_plan`."""
    cpu = torch.device("cpu")
    with torch.inference_mode(False):
        grid_h = scale_grid(*range_h, small[-2], cpu, dtype)
        grid_w = scale_grid(*range_w, small[-1], cpu, dtype)
        plan = _plan(small, small_x, not uniform, grid_h, grid_w, budget, True)
        kept = plan.minima  # as many as grid_minima's too
        grid = native.AlignGrid(grid_h, grid_w, plan.n_shift, small[-2:], small_x[-2:], dtype, plan.c_taps, kept)
        pick, candidates, near = candidate_rule(grid_h, grid_w, kept)
        return _CGrid(grid_h, grid_w, plan, grid, pick, candidates, near)


def _tolerance(f: int) -> float:
    """The refinement's stopping step at a level of factor f (pixels of that level)."""
    return _TOLERANCE if f == 1 else _COARSE_TOLERANCE


def _refine_far(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    start: torch.Tensor,
    found: torch.Tensor,
    sums: torch.Tensor,
    settings: _Settings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full-resolution candidates ``found`` (M, 4) from ``start``, with their ``sums`` and
    ``owner``, plus each one that moved over _FAR pixels refined again from where it stopped
    (blurred, then sharp): the two compete as candidates of their pair."""
    h, w = t.shape[-2:]
    if found.device.type == "cpu":  # a few rows: numpy's operations cost a fifth of torch's
        moved = np.abs(found.numpy() - start.numpy()) * np.array([h, w, 1.0, 1.0])
        far = torch.from_numpy(moved.max(1) > _FAR)
    else:
        edge = torch.tensor([h, w, 1.0, 1.0], dtype=found.dtype, device=found.device)
        far = ((found - start).abs() * edge).amax(1) > _FAR
    if not bool(far.any()):
        return found, owner, sums
    blurred, _ = _refine_all(_blur(t), _blur(x), mask, owner[far], found[far], settings, _COARSE_TOLERANCE)
    again, again_sums = _refine_all(t, x, mask, owner[far], blurred, settings, _TOLERANCE)
    return torch.cat((found, again)), torch.cat((owner, owner[far])), torch.cat((sums, again_sums))


def _blur(v: torch.Tensor) -> torch.Tensor:
    """v (B, C, H, W) filtered by [1, 2, 1] / 4 along each axis, edges replicated."""
    p = torch.nn.functional.pad(v, (1, 1, 1, 1), mode="replicate")
    rows = (p[..., :-2, :] + 2 * p[..., 1:-1, :] + p[..., 2:, :]) * 0.25
    return (rows[..., :-2] + 2 * rows[..., 1:-1] + rows[..., 2:]) * 0.25


def _best_per_pair(cand: torch.Tensor, owner: torch.Tensor, err: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of each pair's ``keep`` lowest-error candidates (M, 4), less any within _SAME of
    a better one of them; grouped by pair in order, best first (every pair keeps its best). A
    few candidates per pair: numpy on the host."""
    c, o, e = (v.detach().cpu().numpy() for v in (cand, owner, err))
    order = np.lexsort((e, o))  # by pair, then by error (NaN last)
    sorted_o = o[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_o[1:] != sorted_o[:-1])))
    if keep == 1:  # each pair's best: no twin to drop
        return torch.from_numpy(order[starts]).to(cand.device)
    near = np.array([_SAME[0], _SAME[0], _SAME[1], _SAME[1]])
    chosen: list[int] = []
    for s, end in zip(starts, [*starts[1:], len(order)], strict=True):
        kept: list[int] = []
        for i in order[s : min(end, s + keep)]:
            if not any((np.abs(c[i] - c[j]) <= near).all() for j in kept):
                kept.append(int(i))
        chosen += kept
    return torch.tensor(chosen, dtype=torch.long, device=cand.device)


def _refine_chunk(t: torch.Tensor, x: torch.Tensor, settings: _Settings) -> int:
    """How many candidates one refinement step holds within the budget (a ValueError where not one)."""
    c, h, w = t.shape[-3:]
    hh, ww = x.shape[-2:]
    n_par = 6 if settings.photometric else 4
    # one candidate's refinement: sampling matrices, its image, and (C, h, w) blocks per parameter
    per_cand = x.element_size() * (4 * (h * hh + w * ww) + c * (hh * ww + 3 * h * ww + (2 * n_par + 8) * h * w))
    return chunk_rows(settings.budget, per_cand, "the refinement of one candidate")


def _refine_all(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    cand: torch.Tensor,
    settings: _Settings,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every candidate refined (M, 4), with its residuals' sums (M, 2), in chunks that fit the budget."""
    n = cand.shape[0]
    step = _refine_chunk(t, x, settings)
    box = (settings.range_h, settings.range_w, settings.photometric)
    parts = []
    for s in range(0, n, step):
        part = slice(s, s + step)
        parts.append(refine(t, x, mask, owner[part], cand[part], *box, tolerance=tolerance, in_c=settings.in_c))
    return torch.cat([p for p, _ in parts]), torch.cat([e for _, e in parts])
