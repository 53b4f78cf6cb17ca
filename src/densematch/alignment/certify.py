"""A certificate for :func:`densematch.align`'s answer: a branch and bound over the whole search
space showing that no fit better than the answer lies outside its neighbourhood.

A cell holds two scales and, per axis, the position where the template's middle pixel lands (its
"centre"), each within a half width of the cell's own: in that frame a scale's spread moves a pixel
by its distance from the middle, at most half the template's side, where in (scale, shift) it
moved it by its distance from the image's corner (3-7x fewer cells, a fifth of the median time:
benchmarks/history/2026-12-05-issue-41-a-pivoted-certificate.md). Every template pixel samples
the image from a box of positions: the warp is separable and monotone in each parameter, so two
corners of the cell give the box. The mean over pixels of the distance from
the template's value to the range the image's bilinear interpolant takes over its box is a lower
bound on the error of every fit in the cell; a cell whose bound exceeds the answer's error holds
no better fit. The range is the one of every whole pixel the box touches while the boxes span
pixels (cheap and wide), and the interpolant's own range once they span less (exact: on each unit
square the interpolant is bilinear, so its extremes over the box lie among the box's corners, the
grid lines' crossings of its edges and the grid points inside). A sum over some of the rows is
already a lower bound, so the rows most varied are summed first and most cells stop early (in C,
kernels/certify.c, row by row; torch's path sums a quarter of them first). Cells left are split in
16 until none is left outside the answer's neighbourhood, or they are too small.

A tenth of a second to seconds per pair on one CPU thread (BENCHMARKS.md, ``certify_alignment``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_choice, check_finite, check_real
from ..config import kernel_setting
from ..kernels import native, ops_for
from ..threads import share_out, workers_for
from .api import Alignment, _check_range, checked_images
from .warp import taps_at, warp

__all__ = ["Certificate", "bilinear_range", "certify_alignment", "pixel_range", "sample_spans"]

_ROOT = 2.0  # the first cells' half width in the centres (px)
# the first scale half width: _LEVER times the centres' over the template's half side, so that a
# scale's spread moves the pixels at its edges _LEVER times as far as the centre's spread (2: the
# fewest seconds of 0.5-4, benchmarks/history/2026-12-05-issue-41-a-pivoted-certificate.md)
_LEVER = 2.0
# cells whose centres' half width is at most this (px) take the interpolant's exact range; wider
# ones, every whole pixel their boxes touch (cheaper per cell, looser). 1, not 0.5 or 2, since the
# children start from their parents' sums: the fewest seconds over bench_align_global's 48
# photographs (benchmarks/history/2026-12-07-issue-41-align-s-python-and-the-certificate-s-floors.md)
_EXACT = 1.0
# the survivors' sums per row kept as their children's floors up to this size (most certificates
# keep well under a megabyte: a few thousand cells of a hundred rows)
_FLOOR_BYTES = 256 * 2**20
Span = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Certificate:
    """The result of :func:`certify_alignment`.

    Attributes
    ----------
    certified : bool
        No fit better than the answer (by ``objective``) lies outside ``near`` of it.
    error : float
        The answer's error, the line every cell had to clear.
    reason : str
        Why not, where not certified: cells left at the finest size, or out of time.
    cells_examined : int
        Cells whose bound was computed, over all sizes.
    cells_left : Tensor of shape (n, 4)
        Centres (scale_h, scale_w, shift_y, shift_x) of the cells the bound could not rule out
        at the size the search stopped at (``cell_size``); empty where certified.
    cell_size : tuple of float
        That size: half widths in scale and in the position of the template's middle pixel (px).
    within : tuple of float
        What was shown either way: every fit better than the answer lies within this distance of
        it in (scale_h, scale_w, shift_y, shift_x): ``near`` where certified, else the reach of the
        cells left (a basin wider than ``near`` along a valley of near-equal fits, say).
    better_fit : tuple of float or None
        A fit (scale_h, scale_w, shift_y, shift_x) shown better than the answer, outside ``near``:
        the centre of a cell left whose error is lower. It ends the search (the answer is not
        the global minimum); None where none was met.
    seconds : float
    """

    certified: bool
    error: float
    reason: str
    cells_examined: int
    cells_left: torch.Tensor
    cell_size: tuple[float, float]
    within: tuple[float, ...]
    better_fit: tuple[float, ...] | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The verdict as plain Python values (the cells left out)."""
        better = None if self.better_fit is None else list(self.better_fit)
        return {"certified": self.certified, "reason": self.reason, "error": self.error, "within": list(self.within),
                "cells_examined": self.cells_examined, "better_fit": better, "seconds": self.seconds}  # fmt: skip


def sample_spans(
    idx: torch.Tensor, n_in: int, scale: torch.Tensor, centre: torch.Tensor, ds: float, dc: float, *, pivot: float
) -> Span:
    """Per cell (centres ``scale``, ``centre``: (M,)) and output pixel c in ``idx`` (n,): the
    interval [lo, hi] (M, n) of input coordinates its bilinear sample takes over scales
    scale +- ds and positions centre +- dc of the output pixel ``pivot`` (align's convention:
    ``(c - pivot) / scale + centre``, clamped to the input). The coordinate is monotone in each
    parameter, so the cell's corners bound it."""
    c = idx.to(scale.dtype) - pivot
    corners = torch.stack([c / (scale + es)[:, None] + (centre + ec)[:, None] for es in (-ds, ds) for ec in (-dc, dc)])
    return corners.amin(0).clamp(0, n_in - 1), corners.amax(0).clamp(0, n_in - 1)


def pixel_range(image: torch.Tensor, ys: Span, xs: Span) -> Span:
    """(M, h, w) minimum and maximum of ``image`` (H, W) over every whole pixel the boxes
    ``ys`` x ``xs`` (each (M, h) and (M, w) intervals) can touch: a bilinear sample is a convex
    combination of those, so its value lies within."""
    big_h, big_w = image.shape

    def reach(span: Span, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = span[0].floor()
        return first.long(), (span[1].ceil().clamp(max=n_in - 1) - first).long() + 1

    (r0, rn), (c0, cn) = reach(ys, big_h), reach(xs, big_w)
    lo1 = hi1 = None
    for k in range(int(cn.max())):  # over the columns of each box, for every row
        v = image[:, (c0 + k).clamp(max=big_w - 1)].permute(1, 0, 2)  # (M, H, w)
        use = (k < cn)[:, None, :]
        lo1 = v if lo1 is None else torch.where(use, torch.minimum(lo1, v), lo1)
        hi1 = v if hi1 is None else torch.where(use, torch.maximum(hi1, v), hi1)
    assert lo1 is not None and hi1 is not None
    lo = hi = None
    for k in range(int(rn.max())):  # then over its rows
        at = (r0 + k).clamp(max=big_h - 1)[:, :, None].expand(-1, -1, lo1.shape[2])
        vl, vh = lo1.gather(1, at), hi1.gather(1, at)
        use = (k < rn)[:, :, None]
        lo = vl if lo is None else torch.where(use, torch.minimum(lo, vl), lo)
        hi = vh if hi is None else torch.where(use, torch.maximum(hi, vh), hi)
    assert lo is not None and hi is not None
    return lo, hi


def bilinear_range(image: torch.Tensor, ys: Span, xs: Span) -> Span:
    """(M, h, w) minimum and maximum of the bilinear interpolant of ``image`` (H, W) over each
    box ``ys`` x ``xs``, exactly: its extremes lie among the products of {lo, the integers
    between, hi} on each axis (the corners of the box's pieces on the unit squares)."""

    def points(span: Span) -> torch.Tensor:  # (K, M, n)
        lo, hi = span
        base = lo.floor()
        k = int((hi.ceil() - base).max()) + 1
        return torch.stack([torch.minimum(torch.maximum(base + i, lo), hi) for i in range(k)])

    big_h, big_w = image.shape
    py, px = points(ys), points(xs)
    y0, y1, gy0, gy1 = taps_at(py, big_h)  # sampling_matrix's rule
    x0, x1, gx0, gx1 = taps_at(px, big_w)
    lo = hi = None
    for a in range(px.shape[0]):
        along = (image[:, x0[a]] * gx0[a] + image[:, x1[a]] * gx1[a]).permute(1, 0, 2)  # (M, H, w)
        for b in range(py.shape[0]):
            g0 = along.gather(1, y0[b][:, :, None].expand(-1, -1, along.shape[2]))
            g1 = along.gather(1, y1[b][:, :, None].expand(-1, -1, along.shape[2]))
            v = g0 * gy0[b][:, :, None] + g1 * gy1[b][:, :, None]
            lo = v if lo is None else torch.minimum(lo, v)
            hi = v if hi is None else torch.maximum(hi, v)
    assert lo is not None and hi is not None
    return lo, hi


def certify_alignment(
    template: Any,
    image: Any,
    alignment: Alignment | Mapping[str, Any],
    *,
    scale_h: tuple[float, float] = (0.8, 1.2),
    scale_w: tuple[float, float] = (0.8, 1.2),
    objective: str = "l1",
    near: tuple[float, float] = (0.015, 1.5),
    finest: tuple[float, float] = (0.00004, 0.004),
    time_limit: float | None = None,
) -> Certificate:
    """Show that no fit better than ``alignment``'s lies farther than ``near`` from it.

    Parameters
    ----------
    template : Tensor or ndarray of shape (h, w), (1, h, w) or (1, C, h, w)
    image : Tensor or ndarray of shape (H, W), (1, H, W) or (1, C, H, W)
        The pair ``alignment`` was found for: one pair, in :func:`densematch.align`'s layout.
    alignment : Alignment or dict
        :func:`densematch.align`'s answer for the pair (of a single pair, or a batch of one), or
        its ``as_dict()``, searched over ``scale_h`` and ``scale_w``.
    scale_h, scale_w : (float, float), default=(0.8, 1.2)
        The ranges searched: the space certified.
    objective : {"l1", "l2"}, default="l1"
        The error compared: mean absolute or squared difference, per pixel and channel.
    near : (float, float), default=(0.015, 1.5)
        The answer's neighbourhood, in scale and in shift (px): cells inside it are not examined.
        Much tighter than this, the rim of the answer's own basin (where the error rises only as
        fast as the noise lets it) can stay within the bound.
    finest : (float, float), default=(0.00004, 0.004)
        The smallest cells' half widths: below them, cells left are reported, not split.
    time_limit : float, optional
        Seconds; past them the search stops, uncertified.

    Returns
    -------
    Certificate

    Notes
    -----
    The branch and bound runs on the CPU whatever the pair's device (a GPU's pair is copied there
    once, in float64): its cells are many and small, each summed row by row and stopped at the
    answer's error, which the C kernels do on the CPU's threads; ``cells_left`` comes back on the
    CPU.

    References
    ----------
    - A. H. Land and A. G. Doig, "An automatic method of solving discrete programming problems",
      Econometrica 28(3), 497-520, 1960: branch and bound.
    """
    objective = check_choice(objective, "objective", ("l1", "l2"))
    for name, pair in (("near", near), ("finest", finest)):
        if len(pair) != 2 or not all(math.isfinite(v) and v > 0 for v in pair):
            raise ValueError(f"{name} must be a pair (scale, shift in px) of positive numbers, got {pair!r}")
    range_h, range_w = _check_range(scale_h, "scale_h"), _check_range(scale_w, "scale_w")
    if time_limit is not None:
        time_limit = check_real(time_limit, "time_limit", 0.0, math.inf, finite=False)
    answer = _one_answer(alignment)
    t, x = checked_images(template, image, range_h, range_w)
    check_finite(t, "template")
    t, x = t.to("cpu", torch.float64), x.to("cpu", torch.float64)
    if t.ndim > 2 and t.shape[0] != 1:
        raise ValueError(f"template and image must be one pair (a batch of 1), got a batch of {t.shape[0]}")
    t, x = t.reshape(-1, *t.shape[-2:]).contiguous(), x.reshape(-1, *x.shape[-2:]).contiguous()  # (C, h, w), (C, H, W)
    (n_c, h, w), (big_h, big_w) = t.shape, x.shape[-2:]
    residual = warp(x[None], *answer, (h, w))[0] - t  # (C, h, w)
    error = float(residual.abs().mean() if objective == "l1" else residual.square().mean())
    line = error * (1 + 1e-9)  # a bound must clear the error by more than float64 rounding
    started = time.perf_counter()
    a = torch.tensor(answer, dtype=torch.float64)
    # cells hold (scale_h, scale_w, centre_y, centre_x): where the template's middle pixel lands
    # (certify.c), so that a scale's spread moves no pixel by more than half a side per unit
    axes = _Axes(((h - 1) / 2, (w - 1) / 2), (h, w), (big_h, big_w), (range_h, range_w))
    # half widths per parameter, the scales' tiling their ranges; a range of one value stays
    # that value (no width to split)
    ds = min(_LEVER * _ROOT / max(*axes.pivot, 1.0), range_h[0] / 4, range_w[0] / 4)  # scales stay positive
    widths = [(hi - lo) / (2 * max(1, math.ceil((hi - lo) / (2 * ds) - 1e-9))) for lo, hi in (range_h, range_w)]
    half = torch.tensor([*widths, _ROOT, _ROOT], dtype=torch.float64)
    rows = _row_order(t)
    in_c = ops_for(kernel_setting() != "torch", x.device, x.dtype).c
    bound = _bound_in_c(t, x, rows, objective, line, axes.pivot, workers_for(x.device)) if in_c else None
    examined = 0

    def reach(cells: torch.Tensor) -> torch.Tensor:
        """How far (M, 4) each cell's fits lie from the answer at most, in (scales, shifts)."""
        lo, hi = axes.shift_extent(cells, half)
        scales = (cells[:, :2] - a[:2]).abs() + half[:2]
        return torch.cat([scales, torch.maximum((lo - a[2:]).abs(), (hi - a[2:]).abs())], dim=1)

    def prune(cells: torch.Tensor, floors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cells of ``cells`` (at the current size) that hold a valid fit outside the answer's
        neighbourhood and whose bound does not exceed the line, with their sums per row in C
        (the floors of their children's; ``floors``: their parents', one row per cell)."""
        nonlocal examined
        gap = reach(cells)
        inside = (gap[:, :2] <= near[0]).all(1) & (gap[:, 2:] <= near[1]).all(1)
        chosen = (axes.valid(cells, half) & ~inside).nonzero()[:, 0]
        # cells with one scale_w and centre_x in a row share their columns' work in C
        chosen = chosen[_lexsort(cells[chosen, 3], cells[chosen, 1])]
        cells = cells[chosen]
        examined += len(cells)
        exact = bool(half[2] <= _EXACT)
        if bound is not None:
            low, sums = bound(cells, tuple(half.tolist()), exact, None if floors is None else floors[chosen])
            ok = low <= line
            return cells[ok], sums[ok]
        kept = [
            _pruned_in_torch(part, t, x, rows, half, exact, objective, line, axes.pivot)
            for part in _parts(cells, exact, n_c)
        ]
        return (torch.cat(kept) if kept else cells), None

    def centre_errors(cells: torch.Tensor) -> torch.Tensor:
        """The error at each cell's centre (a cell of no width: its range is its warp), exact
        where it is no more than the line (C stops the others' sums past it)."""
        if bound is not None:
            return bound(cells, (0.0,) * 4, True, None)[0]
        point = torch.zeros(4, dtype=torch.float64)
        errors = [
            _bound_in_torch(part, t, x, rows, point, True, objective, axes.pivot) for part in _parts(cells, True, n_c)
        ]
        return torch.cat(errors)

    def result(left: torch.Tensor, reason: str = "", better: tuple[float, ...] | None = None) -> Certificate:
        seconds = time.perf_counter() - started
        size = (float(half[:2].max()), float(half[2]))
        far = reach(left).amax(0).tolist() if len(left) else [0.0] * 4
        box = tuple(max(r, n) for r, n in zip(far, (near[0], near[0], near[1], near[1]), strict=True))
        return Certificate(not reason, error, reason, examined, axes.fits(left), size, box, better, seconds)

    # each size's cells are the children of the last size's survivors, made a group at a time,
    # each child's sums per row starting from its parent's (in C, where they fit _FLOOR_BYTES)
    parents, offsets = axes.first_cells(half), torch.zeros(1, 4, dtype=torch.float64)
    floors: torch.Tensor | None = None
    while True:
        kept, kept_sums, group = [], [], max(1, (4096 if bound is not None else 1024) // len(offsets))
        for start in range(0, len(parents), group):
            children = (parents[start : start + group, None, :] + offsets).reshape(-1, 4)
            inherited = None if floors is None else floors[start : start + group].repeat_interleave(len(offsets), 0)
            cells, sums = prune(children, inherited)
            kept.append(cells)
            kept_sums.append(sums)
            if time_limit is not None and time.perf_counter() - started > time_limit:
                rest = (parents[start + group :, None, :] + offsets).reshape(-1, 4)  # the cells not reached
                return result(torch.cat([*kept, rest]), f"out of time after {time_limit:g} s")
        left = torch.cat(kept)
        if not len(left):
            return result(left)
        room = bound is not None and len(left) * len(rows) * 8 <= _FLOOR_BYTES  # torch's path gives none
        floors = torch.cat([v for v in kept_sums if v is not None]) if room else None
        # a cell whose very centre is a fit of the space searched and beats the answer settles it
        placed = axes.fits(left)  # the cells' centres as (scale, shift) fits
        sh, sw, ty, tx = placed.unbind(1)
        fits = (sh >= range_h[0]) & (sh <= range_h[1]) & (sw >= range_w[0]) & (sw <= range_w[1])
        fits &= (ty >= 0) & (ty <= big_h * sh - h) & (tx >= 0) & (tx <= big_w * sw - w)
        better = torch.full((len(left),), math.inf, dtype=torch.float64)
        if bool(fits.any()):
            better[fits] = centre_errors(left[fits])
        if bool((better < error * (1 - 1e-9)).any()):
            i = int(better.argmin())
            fit = placed[i].tolist()
            at = ", ".join(f"{v:.6g}" for v in fit)
            reason = f"a better fit lies at ({at}): error {float(better[i]):.6g} against the answer's {error:.6g}"
            return result(left, reason, tuple(fit))
        scales_done = bool(((half[:2] > 0) & (half[:2] / 2 < finest[0])).any())
        if scales_done or half[2] / 2 < finest[1]:
            far = ", ".join(f"{v:.3g}" for v in (placed - a).abs().amax(0).tolist())
            return result(left, f"{len(left)} cells left at the finest size, up to ({far}) from the answer")
        half = half / 2
        signs = [torch.tensor([-1.0, 1.0] if v > 0 else [0.0], dtype=torch.float64) for v in half]
        parents, offsets = left, torch.cartesian_prod(*signs) * half


def _lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """The order that sorts by the last key, then the one before, and so on (stable)."""
    order = torch.arange(len(keys[0]))
    for key in keys:
        order = order[key[order].argsort(stable=True)]
    return order


def _parts(cells: torch.Tensor, exact: bool, channels: int) -> list[torch.Tensor]:
    """``cells`` in the pieces torch's bound takes at a time: its (cells, h, w) temporaries grow
    with the points of each range and the channels."""
    step = max(1, (40 if exact else 200) // channels)
    return [cells[i : i + step] for i in range(0, len(cells), step)]


def _pruned_in_torch(
    cells: torch.Tensor,
    t: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    half: torch.Tensor,
    exact: bool,
    objective: str,
    line: float,
    pivot: tuple[float, float],
) -> torch.Tensor:
    """The cells whose bound (torch's ranges) does not exceed ``line``: the first quarter of
    ``rows`` (the most varied) first, the others for the cells those did not rule out."""
    quarter = (t.shape[1] + 3) // 4
    sparse, dense = rows[:quarter], rows[quarter:]
    low = _bound_in_torch(cells, t, x, sparse, half, exact, objective, pivot)
    maybe, low = cells[low <= line], low[low <= line]
    if len(maybe) and len(dense):
        maybe = maybe[low + _bound_in_torch(maybe, t, x, dense, half, exact, objective, pivot) <= line]
    return maybe


def _bound_in_torch(
    cells: torch.Tensor,
    t: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    half: torch.Tensor,
    exact: bool,
    objective: str,
    pivot: tuple[float, float],
) -> torch.Tensor:
    """Per cell (M,) (centres scale_h, scale_w, centre_y, centre_x: where the template pixel
    ``pivot`` lands), the sum over ``rows`` of the template ``t`` (C, h, w) of each pixel's term
    against ``x``'s (C, H, W) range over its box, divided by every pixel's count."""
    (n_c, h, w), big_h, big_w = t.shape, *x.shape[-2:]
    sh, sw, cy, cx = cells.unbind(1)
    ys = sample_spans(rows, big_h, sh, cy, float(half[0]), float(half[2]), pivot=pivot[0])
    xs = sample_spans(torch.arange(w), big_w, sw, cx, float(half[1]), float(half[3]), pivot=pivot[1])
    total = torch.zeros(len(cells), dtype=torch.float64)
    for ch in range(n_c):
        lo, hi = (bilinear_range if exact else pixel_range)(x[ch], ys, xs)
        tc = t[ch, rows]
        gap = (lo - tc).clamp_min(0) + (tc - hi).clamp_min(0)
        total += (gap if objective == "l1" else gap.square()).sum((1, 2))
    return total / (n_c * h * w)


def _bound_in_c(
    t: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    objective: str,
    line: float,
    pivot: tuple[float, float],
    share_out_to: int,
) -> Callable[[torch.Tensor, tuple[float, ...], bool, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]:
    """The bound per cell in C (:func:`densematch.kernels.native.certify_bound`), over
    ``share_out_to`` threads, each cell's sum stopped once it passes the line: the bounds (M,)
    and each cell's sums per row (M, rows), from its ``floors`` (M, rows) where given."""
    n = t.numel()
    stop = line * n

    def bound(
        cells: torch.Tensor, half: tuple[float, ...], exact: bool, floors: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(len(cells), dtype=torch.float64)
        sums = torch.empty(len(cells), len(rows), dtype=torch.float64)
        step = max(1, -(-len(cells) // share_out_to))

        def run(start: int) -> None:
            part = slice(start, start + step)
            out[part] = native.certify_bound(
                x, t, cells[part].contiguous(), half, rows, pivot=pivot, exact=exact, squared=objective == "l2",
                stop=stop, floors=None if floors is None else floors[part].contiguous(), row_sums=sums[part],
            )  # fmt: skip

        share_out(range(0, len(cells), step), run, share_out_to, name="densematch-certify")
        return out / n, sums

    return bound


def _row_order(t: torch.Tensor) -> torch.Tensor:
    """The template's rows (of ``t`` (C, h, w)), most varied first: a false fit's bound grows
    where the template has structure the image's box does not, so those rows end it soonest."""
    across = (t[:, :, 1:] - t[:, :, :-1]).abs().sum((0, 2))
    down = (t[:, 1:] - t[:, :-1]).abs().sum((0, 2))
    varied = across + torch.cat([down, down.new_zeros(1)]) + torch.cat([down.new_zeros(1), down])
    return varied.argsort(descending=True, stable=True)


def _one_answer(alignment: Any) -> tuple[float, float, float, float]:
    """The warp of one pair's Alignment (floats, or a batch of one's tensors), or of its
    :meth:`~densematch.alignment.api.Alignment.as_dict`."""
    keys = ("scale_h", "scale_w", "shift_y", "shift_x")
    if isinstance(alignment, Alignment):
        values = tuple(getattr(alignment, key) for key in keys)
    elif isinstance(alignment, Mapping) and all(key in alignment for key in keys):
        values = tuple(alignment[key] for key in keys)
    else:
        got = type(alignment).__name__
        raise TypeError(f"alignment must be the Alignment densematch.align returned (or its as_dict()), got {got}")
    numbers = [torch.as_tensor(v, dtype=torch.float64) for v in values]  # a batch's lists or tensors too
    if any(v.numel() != 1 for v in numbers):
        raise TypeError("alignment must be one pair's (certify each pair of a batch on its own)")
    sh, sw, sy, sx = (float(v) for v in numbers)
    if not all(math.isfinite(v) for v in (sh, sw, sy, sx)) or min(sh, sw) <= 0:
        raise ValueError(f"alignment must hold positive finite scales and finite shifts, got {(sh, sw, sy, sx)}")
    return sh, sw, sy, sx


@dataclass(frozen=True)
class _Axes:
    """The certificate's parameters on both axes (y, x): cells hold (scale_h, scale_w, centre_y,
    centre_x), a centre being where the template pixel ``pivot`` lands, ``(pivot + shift + 0.5) /
    scale - 0.5`` in align's convention; ``sides`` the template's, ``image`` the image's, ``ranges``
    the scale ranges searched."""

    pivot: tuple[float, float]
    sides: tuple[int, int]
    image: tuple[int, int]
    ranges: tuple[tuple[float, float], tuple[float, float]]

    def _pivots(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.pivot, dtype=like.dtype)

    def fits(self, cells: torch.Tensor) -> torch.Tensor:
        """The fits (M, 4) (scale_h, scale_w, shift_y, shift_x) at the cells' centres."""
        scales, centres = cells[:, :2], cells[:, 2:]
        return torch.cat([scales, (centres + 0.5) * scales - self._pivots(cells) - 0.5], dim=1)

    def shift_extent(self, cells: torch.Tensor, half: torch.Tensor) -> Span:
        """The least and greatest shifts (M, 2) of each cell's fits: a shift is bilinear in the
        scale and the centre, so the cell's corners hold them."""
        corners = torch.stack(
            [
                (cells[:, 2:] + dc + 0.5) * (cells[:, :2] + ds) - self._pivots(cells) - 0.5
                for ds in (-half[:2], half[:2])
                for dc in (-half[2:], half[2:])
            ]
        )
        return corners.amin(0), corners.amax(0)

    def _centre_bounds(self, scale: torch.Tensor | float, axis: int) -> tuple[torch.Tensor | float, ...]:
        """The centres of the fits at ``scale`` that keep the template inside the image on an
        axis: from shift 0 to shift ``image * scale - side``."""
        p, side, n_in = self.pivot[axis], self.sides[axis], self.image[axis]
        return (p + 0.5) / scale - 0.5, n_in - 0.5 - (side - p - 0.5) / scale

    def valid(self, cells: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
        """Which cells may hold a fit of the space searched: within the scale ranges and with a
        centre the template fits the image at, taken at the cell's largest scale in range (the
        widest span of centres)."""
        ok = torch.ones(len(cells), dtype=torch.bool)
        for axis, (_, top) in enumerate(self.ranges):
            scale, centre = cells[:, axis], cells[:, 2 + axis]
            ok &= scale - half[axis] <= top
            least, most = self._centre_bounds((scale + half[axis]).clamp(max=top), axis)
            ok &= (centre + half[2 + axis] >= least) & (centre - half[2 + axis] <= most)
        return ok

    def first_cells(self, half: torch.Tensor) -> torch.Tensor:
        """Centres (M, 4) of cells of half widths ``half`` (4,) covering the scale ranges and the
        centres every fit in them can have."""

        def axis(lo: float, hi: float, width: float) -> torch.Tensor:
            if width == 0:
                return torch.tensor([lo], dtype=torch.float64)
            n = max(1, math.ceil((hi - lo) / (2 * width) - 1e-9))  # not one more for a rounding
            return lo + width * (2 * torch.arange(n, dtype=torch.float64) + 1)

        hs = half.tolist()
        scales = [axis(*r, hs[i]) for i, r in enumerate(self.ranges)]
        centres = []
        for i, (_, top) in enumerate(self.ranges):
            least, most = self._centre_bounds(top, i)
            centres.append(axis(float(least), max(float(most), float(least)), hs[2 + i]))
        return torch.cartesian_prod(*scales, *centres)
