"""The windows of local matching: which pixels of b each pixel of a meets, and how they are read.

Without a flow, one offset moves every pixel by the same amount, so one offset is one elementwise
pass over a rectangle of a and the matching rectangle of b (views, no copies). With a flow, every
pixel's window sits elsewhere, so each offset gathers its candidates from b (and, for bilinear
sampling, blends four neighbours). Offsets that reach no pixel of b cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..checks import (
    as_tensor,
    check_batch_mask,
    check_features,
    check_finite,
    check_int,
    check_pair,
    compute_dtype,
)
from ..kernels import native, ops_for
from ..metrics import Metric, get_metric, unit_rows

__all__ = ["SAMPLINGS", "Offsets", "Read", "Window", "pair_int", "prepare"]

SAMPLINGS = ("nearest", "bilinear")

Pair = tuple[int, int]
Region = tuple[slice, slice, slice]
# the offsets of a band of rows: ints (a window's offset) or per-pixel (B, rows, W) int64 tensors
Offsets = Callable[[int, int], Sequence[tuple[Any, Any]]]


@dataclass
class Read:
    """Where the candidates of one offset for rows y0:y1 of a come from, and which exist.

    A shifted window reads the region ``b`` of b for the region ``a`` of a; a gathered one reads
    the rows ``index`` of b (four corners, blended with weights from the flow plus ``frac``, for
    bilinear sampling) for the whole band. ``out`` is the region of the band's (B, rows, W)
    values that ``a`` covers (None: no pixel of the band has a candidate)."""

    rows: Pair
    a: Region | None
    out: Region | None
    b: Region | None
    index: list[torch.Tensor]
    frac: tuple[torch.Tensor, torch.Tensor] | None
    valid: torch.Tensor


@dataclass
class Window:
    """A validated call: the grid, the offsets, how b is read and how a pair is valued.

    The tensors themselves (rows of a and b as (B, H, W, C), the flow) travel separately, so
    that autograd sees them as the inputs of :class:`_Values`."""

    shape: tuple[int, int, int, int]
    offsets: list[Pair]  # the window's offsets that can reach b from some pixel, row-major
    window: Pair  # the whole window's (rows, cols): (2 ry + 1, 2 rx + 1)
    slots: list[int] | None  # where each offset sits in the whole window (None: all of it)
    flow_kind: str | None  # None, "nearest" (int64 flow) or "bilinear"
    mask_a: torch.Tensor | None  # (B, H, W)
    mask_b: torch.Tensor | None  # (B, H, W)
    pairing: Metric  # how a pair is valued: the metric, or dot for cosine of unit rows
    device: torch.device
    linear: bool = False  # the pair's value is a plain dot product (dot, and cosine of unit rows)
    # the C kernel's reduction of a pair where it runs (shifted windows of float rows on a
    # CPU: :func:`densematch.kernels.native.local_values`), and how its value is finished
    kernel: str | None = None
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None

    def read(self, y0: int, y1: int, oy: Any, ox: Any, flow: torch.Tensor | None) -> Read:
        """Where the candidates at offset (oy, ox) of rows y0:y1 come from."""
        if flow is None and isinstance(oy, int):
            read = self._shifted(y0, y1, oy, int(ox))
        else:
            read = self._gathered(y0, y1, oy, ox, flow)
        if self.mask_a is not None:
            read.valid &= self.mask_a[:, y0:y1]
        return read

    def _shifted(self, y0: int, y1: int, oy: int, ox: int) -> Read:
        nb, h, w, _ = self.shape
        ys, ye = max(y0, -oy), min(y1, h - oy)
        xs, xe = max(0, -ox), min(w, w - ox)
        valid = torch.zeros((nb, y1 - y0, w), dtype=torch.bool, device=self.device)
        if ys >= ye or xs >= xe:
            return Read((y0, y1), None, None, None, [], None, valid)
        out = (slice(None), slice(ys - y0, ye - y0), slice(xs, xe))
        b = (slice(None), slice(ys + oy, ye + oy), slice(xs + ox, xe + ox))
        valid[out] = True if self.mask_b is None else self.mask_b[b]
        return Read((y0, y1), (slice(None), slice(ys, ye), slice(xs, xe)), out, b, [], None, valid)

    def _gathered(self, y0: int, y1: int, oy: Any, ox: Any, flow: torch.Tensor | None) -> Read:
        nb, h, w, _ = self.shape
        dev = self.device
        py: torch.Tensor = torch.arange(y0, y1, device=dev)[None, :, None] + oy
        px: torch.Tensor = torch.arange(w, device=dev)[None, None, :] + ox
        py, px = py.expand(nb, y1 - y0, w), px.expand(nb, y1 - y0, w)
        frac = None
        corners: tuple[Pair, ...] = ((0, 0),)
        if flow is not None:
            fy, fx = flow[:, y0:y1, :, 0].detach(), flow[:, y0:y1, :, 1].detach()
            if self.flow_kind == "bilinear":
                # the window moves rigidly: every offset shares the fractions of y + fy and
                # x + fx (as the C kernel computes them); a corner's weight is flow + frac,
                # recomputed from the flow in the backward
                y, x = (torch.arange(n, device=dev, dtype=fy.dtype) for n in (h, w))
                y, x = y[y0:y1][None, :, None], x[None, None, :]
                top, left = (y + fy).floor(), (x + fx).floor()
                frac = ((y - top).expand(nb, y1 - y0, w), (x - left).expand(nb, y1 - y0, w))
                py, px = top.long() + oy, left.long() + ox
                corners = ((0, 0), (0, 1), (1, 0), (1, 1))
            else:
                py, px = py + fy, px + fx
        base = (torch.arange(nb, device=dev) * (h * w))[:, None, None]
        band = (slice(None), slice(y0, y1), slice(None))
        whole = (slice(None), slice(None), slice(None))
        index, valid = [], None
        for dy, dx in corners:
            qy, qx = py + dy, px + dx
            inside = (qy >= 0) & (qy < h) & (qx >= 0) & (qx < w)
            q = (base + qy.clamp(0, h - 1) * w + qx.clamp(0, w - 1)).reshape(-1)
            if self.mask_b is not None:
                inside &= self.mask_b.reshape(-1)[q].view_as(inside)
            if frac is not None:  # a missing corner is harmless where its weight is 0
                wy = frac[0] + fy if dy else 1 - frac[0] - fy
                wx = frac[1] + fx if dx else 1 - frac[1] - fx
                inside |= (wy == 0) | (wx == 0)
            valid = inside if valid is None else valid & inside
            index.append(q)
        assert valid is not None
        return Read((y0, y1), band, whole, None, index, frac, valid)

    def sources(
        self, read: Read, ra: torch.Tensor, rb: torch.Tensor, flow: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """What the values of the region ``read.out`` come from: the part of a, the candidates
        read from b (one, or four corners) and, for bilinear sampling, the flow's band."""
        assert read.a is not None
        c = ra.shape[3]
        xa = ra[read.a]
        if read.b is not None:
            parts = [rb[read.b]]
        else:
            flat = rb.reshape(-1, c)
            parts = [F.embedding(q, flat).view(*read.valid.shape, c) for q in read.index]
        fl = None
        if read.frac is not None:
            assert flow is not None
            fl = flow[:, read.rows[0] : read.rows[1]]
        return xa, parts, fl

    def value(
        self, read: Read, xa: torch.Tensor, parts: Sequence[torch.Tensor], fl: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The values of the region ``read.out`` from its :meth:`sources`."""
        pair = self.pairing.pair_value
        if fl is None:
            return pair(xa, parts[0])
        _, weights = _corner_weights(read, fl)
        pairs = list(zip(weights, parts, strict=True))
        if self.linear:  # a dot product of the blend is the blend of the dot products
            return torch.stack([wt * pair(xa, part) for wt, part in pairs]).sum(0)
        return pair(xa, torch.stack([wt[..., None] * part for wt, part in pairs]).sum(0))

    def value_grads(
        self, read: Read, xa: torch.Tensor, parts: Sequence[torch.Tensor], fl: torch.Tensor | None, g: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """The gradients at :meth:`value`'s inputs given ``g`` at its values, in closed form
        (:meth:`densematch.metrics.Metric.pair_grads` and the blend's own rule), so that they
        need no autograd: the backward operator runs them under any dispatch mode."""
        if fl is None:
            ga, gb = self.pairing.pair_grads(xa, parts[0], g)
            return ga, [gb], None
        (wy, wx), weights = _corner_weights(read, fl)
        # a blend's derivative, the same for a blend of dot products (linear in the corners)
        blend = torch.stack([wt[..., None] * part for wt, part in zip(weights, parts, strict=True)]).sum(0)
        ga, g_blend = self.pairing.pair_grads(xa, blend, g)
        at = [(g_blend * part).sum(-1) for part in parts]  # at each corner's weight
        g_wy = (at[2] - at[0]) * (1 - wx) + (at[3] - at[1]) * wx
        g_wx = (at[1] - at[0]) * (1 - wy) + (at[3] - at[2]) * wy
        return ga, [wt[..., None] * g_blend for wt in weights], torch.stack((g_wy, g_wx), -1)


def _corner_weights(read: Read, fl: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """The blend's fractions (row, col) at the band's positions (their own plus the flow) and
    the four corners' weights (top-left, top-right, bottom-left, bottom-right)."""
    assert read.frac is not None
    wy, wx = read.frac[0] + fl[..., 0], read.frac[1] + fl[..., 1]
    return (wy, wx), ((1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx)


def pair_int(value: Any, name: str, low: int) -> Pair:
    values = value if isinstance(value, (tuple, list)) else (value, value)
    if len(values) != 2:
        raise ValueError(f"{name} must be an int or a (row, col) pair of ints, got {value!r}")
    return check_int(values[0], name, low), check_int(values[1], name, low)


def check_maps(
    a: Any, b: Any, layout: str, mask_a: Any, mask_b: Any
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], bool, list[torch.Tensor | None]]:
    """a and b as rows (B, N, C) of one 2-D grid (finiteness left to the caller, where the masks
    allow), the grid, whether they came batched, and the masks as (B, H, W) (None: no mask)."""
    if layout not in ("hwc", "chw"):
        raise ValueError(f"layout must be 'hwc' or 'chw' (windows need a 2-D grid), got {layout!r}")
    ra, grid, batched = check_features(a, "a", layout, finite=False)
    rb, grid_b, batched_b = check_features(b, "b", layout, finite=False)
    if grid != grid_b:
        raise ValueError(f"a and b must share one grid (windows sit at a's own positions), got {grid} and {grid_b}")
    check_pair(ra, rb, batched, batched_b)
    masks = [
        check_batch_mask(mk, name, ra.shape[0], grid, batched, ra.device)
        for mk, name in ((mask_a, "mask_a"), (mask_b, "mask_b"))
    ]
    return ra, rb, grid, batched, masks


def prepare(
    a: Any,
    b: Any,
    *,
    radius: Any,
    dilation: Any,
    flow: Any,
    sampling: str,
    metric: Metric,
    layout: str,
    mask_a: Any,
    mask_b: Any,
    use_c: bool = False,
) -> tuple[Window, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], bool]:
    """The validated call, and its inputs as (B, H, W, C) rows in the compute dtype (unit rows for cosine,
    masked-out pixels zeroed, so they pass no NaN into values or gradients). ``use_c``: whether
    the C kernels may value shifted windows (read from the config by the public call); the
    window's ``kernel`` is set only where they also can (:func:`densematch.kernels.ops_for`),
    so that the steps after this one never ask again."""
    ra, rb, grid, batched, masks = check_maps(a, b, layout, mask_a, mask_b)
    ry, rx = pair_int(radius, "radius", 0)
    dy, dx = pair_int(dilation, "dilation", 1)
    nb, (h, w) = ra.shape[0], grid
    for rows, mk, name in ((ra, masks[0], "a"), (rb, masks[1], "b")):
        check_finite(rows.detach(), name, mask=None if mk is None else mk.reshape(nb, -1))
    dtype = compute_dtype(ra, rb)
    moved = check_flow(flow, sampling, nb, grid, batched, ra.device, dtype)
    # cosine reads unit rows with a dot product, except where b is interpolated: the cosine of
    # the blended feature, not the blend of unit features
    blended = moved is not None and moved.is_floating_point()
    linear = metric.name == "dot" or (metric.name == "cosine" and not blended)
    kernel = None
    c = ops_for(use_c, ra.device, dtype).c
    if c and not (metric.name == "cosine" and blended):  # the cosine of a blend: torch's
        kernel = "dot" if linear else metric.pair_kind
    prepared = []
    for rows, mk, unit in ((ra, masks[0], True), (rb, masks[1], not blended)):
        x = rows.to(dtype)
        if mk is not None:
            x = torch.where(mk.reshape(nb, -1, 1), x, 0.0)
        if metric.name == "cosine" and unit:
            x = unit_rows(x)
        prepared.append(x.reshape(nb, h, w, -1))
    # channels-first maps stay where they lie for the C kernels of shifted windows, which read
    # them in place; every other path reads channels-last rows, a pixel's feature one run
    in_place = kernel is not None and moved is None
    if not (in_place and nb and all(native.planar(x[0]) for x in prepared)):
        prepared = [x.contiguous() for x in prepared]
    pairing = get_metric("dot") if metric.name == "cosine" and not blended else metric
    rows_i, cols_j = (_reachable(r, d, size, moved, axis) for r, d, size, axis in ((ry, dy, h, 0), (rx, dx, w, 1)))
    offsets = [(i * dy, j * dx) for i in rows_i for j in cols_j]
    slots = None
    if len(offsets) < (2 * ry + 1) * (2 * rx + 1):
        slots = [(i + ry) * (2 * rx + 1) + (j + rx) for i in rows_i for j in cols_j]
    window = Window(
        shape=(nb, h, w, ra.shape[2]),
        offsets=offsets,
        window=(2 * ry + 1, 2 * rx + 1),
        slots=slots,
        flow_kind=None if moved is None else sampling,
        mask_a=masks[0],
        mask_b=masks[1],
        pairing=pairing,
        device=ra.device,
        linear=linear,
    )
    if kernel is not None:
        window.kernel = kernel
        window.finish = None if linear else metric.kernel_value
    return window, (prepared[0], prepared[1], moved), batched


def _reachable(radius: int, step: int, size: int, moved: torch.Tensor | None, axis: int) -> range:
    """The window steps i in [-radius, radius] along ``axis`` whose offset i * step can reach
    b's grid (of ``size`` pixels) from some pixel: |offset| <= size - 1, widened by the flow's
    extremes (and a pixel for bilinear sampling). A radius beyond the maps costs nothing."""
    lo, hi = -(size - 1), size - 1
    if moved is not None:
        f = moved.detach()[..., axis]
        lo, hi = lo - math.ceil(float(f.max())) - 1, hi - math.floor(float(f.min())) + 1
    return range(max(-radius, -((-lo) // step)), min(radius, hi // step) + 1)


def check_flow(
    flow: Any, sampling: str, nb: int, grid: tuple[int, ...], batched: bool, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """The flow as (B, H, W, 2): rounded to int64 for nearest sampling, float for bilinear."""
    if flow is None:
        return None
    f = as_tensor(flow, "flow")
    one, full = (*grid, 2), (nb, *grid, 2)
    if tuple(f.shape) not in (one, full) or (not batched and f.ndim == 4):
        want = f"{full} or {one}" if batched else f"{one}"
        raise ValueError(f"flow must have shape {want}, a (d_row, d_col) per pixel of a, got {tuple(f.shape)}")
    if f.dtype == torch.bool or f.is_complex():
        raise TypeError(f"flow must hold real numbers, got {f.dtype}")
    f = f.to(device).expand(full)
    if f.is_floating_point():
        check_finite(f.detach(), "flow")
    if sampling == "nearest":
        return (f.detach() + 0.5).floor().long() if f.is_floating_point() else f.long()
    return f.to(dtype)
