"""Local-window matching: every pixel of a against the pixels of b in a window around its own
position (moved by a flow), exactly, as the best k or as a differentiable cost volume.

Two ways to read a window. Without a flow, one offset moves every pixel by the same amount, so
one offset is one elementwise pass over a rectangle of a and the matching rectangle of b (views,
no copies). With a flow, every pixel's window sits elsewhere, so each offset gathers its
candidates from b (and, for bilinear sampling, blends four neighbours). Work runs one offset and
one band of rows at a time. The backward recomputes each (band, offset) and differentiates it
alone, its inputs cut loose as leaves: memory never holds a copy of a per offset, as the unfold
recipe does, and no slice's gradient is spread over a zero tensor of the whole input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from ._match import Matches
from .budget import chunk_rows, parse_memory
from .checks import (
    as_tensor,
    check_batch_mask,
    check_choice,
    check_features,
    check_finite,
    check_int,
    check_pair,
    check_real,
    compute_dtype,
)
from .config import resolve_memory
from .metrics import Metric, get_metric, unit_rows

__all__ = ["LOCAL_OUTPUTS", "SAMPLINGS", "LocalMatcher", "local_match"]

LOCAL_OUTPUTS = ("topk", "volume")
SAMPLINGS = ("nearest", "bilinear")
# bytes per (pixel, offset) of the ranking's bookkeeping: value, score, validity, index
_BOOK_BYTES = 24

Pair = tuple[int, int]
Region = tuple[slice, slice, slice]
# the offsets of a band of rows: ints (a window's offset) or per-pixel (B, rows, W) int64 tensors
Offsets = Callable[[int, int], Sequence[tuple[Any, Any]]]


@dataclass
class _Read:
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
class _Window:
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
    pair: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    linear: bool = False  # the pair's value is a plain dot product (dot, and cosine of unit rows)

    def read(self, y0: int, y1: int, oy: Any, ox: Any, flow: torch.Tensor | None) -> _Read:
        """Where the candidates at offset (oy, ox) of rows y0:y1 come from."""
        if flow is None and isinstance(oy, int):
            read = self._shifted(y0, y1, oy, int(ox))
        else:
            read = self._gathered(y0, y1, oy, ox, flow)
        if self.mask_a is not None:
            read.valid &= self.mask_a[:, y0:y1]
        return read

    def _shifted(self, y0: int, y1: int, oy: int, ox: int) -> _Read:
        nb, h, w, _ = self.shape
        ys, ye = max(y0, -oy), min(y1, h - oy)
        xs, xe = max(0, -ox), min(w, w - ox)
        valid = torch.zeros((nb, y1 - y0, w), dtype=torch.bool, device=self.device)
        if ys >= ye or xs >= xe:
            return _Read((y0, y1), None, None, None, [], None, valid)
        out = (slice(None), slice(ys - y0, ye - y0), slice(xs, xe))
        b = (slice(None), slice(ys + oy, ye + oy), slice(xs + ox, xe + ox))
        valid[out] = True if self.mask_b is None else self.mask_b[b]
        return _Read((y0, y1), (slice(None), slice(ys, ye), slice(xs, xe)), out, b, [], None, valid)

    def _gathered(self, y0: int, y1: int, oy: Any, ox: Any, flow: torch.Tensor | None) -> _Read:
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
                top, left = (py + fy).floor(), (px + fx).floor()
                # a corner's weight is flow + frac: recomputed from the flow in the backward
                frac = (py - top, px - left)
                py, px = top.long(), left.long()
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
        return _Read((y0, y1), band, whole, None, index, frac, valid)

    def evaluate(
        self, read: _Read, ra: torch.Tensor, rb: torch.Tensor, flow: torch.Tensor | None, track: Sequence[bool] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Values of the region ``read.out`` and the tensors they came from: the part of a, the
        candidates read from b (one, or four corners), and the flow's band. ``track`` (for a,
        b, flow): cut those loose as leaves that require gradients, for the backward."""
        assert read.a is not None
        c = ra.shape[3]
        want = (*track, False, False, False)[:3]
        xa = _leaf(ra[read.a], want[0])
        if read.b is not None:
            parts = [_leaf(rb[read.b], want[1])]
        else:
            flat = rb.reshape(-1, c)
            parts = [_leaf(F.embedding(q, flat).view(*read.valid.shape, c), want[1]) for q in read.index]
        fl = None
        if read.frac is not None:
            assert flow is not None
            fl = _leaf(flow[:, read.rows[0] : read.rows[1]], want[2])
            wy, wx = read.frac[0] + fl[..., 0], read.frac[1] + fl[..., 1]
            weights = ((1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx)
            pairs = list(zip(weights, parts, strict=True))
            if self.linear:  # a dot product of the blend is the blend of the dot products
                v = torch.stack([wt * self.pair(xa, part) for wt, part in pairs]).sum(0)
            else:
                v = self.pair(xa, torch.stack([wt[..., None] * part for wt, part in pairs]).sum(0))
        else:
            v = self.pair(xa, parts[0])
        return v, [xa, *parts, fl]


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_() if grad else x


@overload
def local_match(
    a: Any,
    b: Any,
    radius: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = ...,
    flow: Any = ...,
    sampling: str = ...,
    metric: str = ...,
    k: int = ...,
    output: Literal["topk"] = ...,
    layout: str = ...,
    mask_a: Any = ...,
    mask_b: Any = ...,
    fill: float | None = ...,
    memory: int | str | None = ...,
) -> Matches: ...


@overload
def local_match(
    a: Any,
    b: Any,
    radius: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = ...,
    flow: Any = ...,
    sampling: str = ...,
    metric: str = ...,
    k: int = ...,
    output: Literal["volume"],
    layout: str = ...,
    mask_a: Any = ...,
    mask_b: Any = ...,
    fill: float | None = ...,
    memory: int | str | None = ...,
) -> torch.Tensor: ...


@overload
def local_match(
    a: Any,
    b: Any,
    radius: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = ...,
    flow: Any = ...,
    sampling: str = ...,
    metric: str = ...,
    k: int = ...,
    output: str = ...,
    layout: str = ...,
    mask_a: Any = ...,
    mask_b: Any = ...,
    fill: float | None = ...,
    memory: int | str | None = ...,
) -> Matches | torch.Tensor: ...


def local_match(
    a: Any,
    b: Any,
    radius: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = 1,
    flow: Any = None,
    sampling: str = "nearest",
    metric: str = "cosine",
    k: int = 1,
    output: str = "topk",
    layout: str = "hwc",
    mask_a: Any = None,
    mask_b: Any = None,
    fill: float | None = None,
    memory: int | str | None = None,
) -> Matches | torch.Tensor:
    """Match every pixel of ``a`` against the pixels of ``b`` in a window around its own
    position, exactly: pixel (y, x) against b at (y + fy + i * dy, x + fx + j * dx) for
    i in -ry..ry, j in -rx..rx, where (fy, fx) is the flow at (y, x) and (dy, dx) the dilation.
    Positions outside b (or masked out) are no candidates.

    Parameters
    ----------
    a, b : Tensor or ndarray
        Features of one grid, (H, W, C) or (B, H, W, C) for layout="hwc", (C, H, W) or
        (B, C, H, W) for "chw"; any float dtype (computed in float32, float64 for float64 inputs).
    radius : int or (int, int)
        The window's half size per (row, col) axis, >= 0: (2 ry + 1) x (2 rx + 1) candidates.
        (0, r) searches along rows only, as rectified stereo does. Offsets that reach no pixel
        of b (beyond the maps, the flow included) cost nothing: they are missing everywhere.
    dilation : int or (int, int), default=1
        Step between candidates per axis (spatial-correlation-sampler's ``dilation_patch``).
    flow : Tensor or ndarray of shape (B, H, W, 2) or (H, W, 2), optional
        A displacement (d_row, d_col) per pixel of a that moves its window's centre. Note the
        order: flow from RAFT or OpenCV is (dx, dy); pass ``flow.flip(-1)``.
    sampling : {"nearest", "bilinear"}, default="nearest"
        How a fractional flow places the window: rounded to the nearest pixel (halves up), or
        b bilinearly interpolated at the exact positions (differentiable in the flow too); a
        position counts as inside b while it lies within [0, H - 1] x [0, W - 1].
    metric : {"cosine", "dot", "l2", "sqeuclidean", "l1", "linf"}, default="cosine"
        As in :func:`densematch.match`; every value is computed directly from the two features.
    k : int, default=1
        With output="topk": how many best candidates per pixel, best first, ties to the lower
        offset (row-major over the window); 1 <= k <= (2 ry + 1) (2 rx + 1).
    output : {"topk", "volume"}, default="topk"
        "topk": :class:`densematch.Matches`. "volume": the whole cost volume.
    layout : {"hwc", "chw"}, default="hwc"
    mask_a, mask_b : bool Tensor or ndarray of shape (B, H, W) or (H, W), optional
        Pixels of a to match, pixels of b that may be chosen (masked-out pixels may hold NaN).
    fill : float, optional
        With output="volume": the value where a candidate is missing (outside b, masked out,
        or a masked-out pixel of a). Default 0 for cosine and dot (the zero padding of
        spatial-correlation-sampler), inf for the distances.
    memory : int or str, optional
        Cap on the working memory, as in :func:`densematch.match`.

    Returns
    -------
    Matches, for output="topk"
        ``index`` (flat index in b's grid), ``coords`` ((row, col) in b; int64, float for
        bilinear sampling, where ``index`` is the nearest pixel), ``score`` (float32, float64
        for float64 inputs) and ``valid``, of shape (*batch, H, W[, k]) (coords: a further 2);
        -1 / NaN / False where a pixel has fewer candidates than k. ``score`` carries gradients
        to a, b and a bilinear flow when they require them.
    Tensor of shape (*batch, 2 ry + 1, 2 rx + 1, H, W), for output="volume"
        ``volume[..., i, j, y, x]`` = the metric's value of a at (y, x) and b at offset
        (i - ry, j - rx) times the dilation: spatial-correlation-sampler's layout, equal to its
        ``spatial_correlation_sample(a, b, patch_size=(2ry+1, 2rx+1), dilation_patch=d)`` for
        metric="dot" and layout="chw". Differentiable with respect to a, b and a bilinear flow.

    Raises
    ------
    ValueError
        Grids, channels, batch sizes or devices that differ, a bad radius, dilation, k, flow
        shape, metric, output, sampling or layout, NaN or Inf, masks of the wrong shape, or a
        budget that cannot hold one row of windows.
    TypeError
        Integer features, non-boolean masks, inputs of another type.

    Examples
    --------
    >>> f = torch.randn(20, 24, 8)
    >>> moved = torch.roll(f, shifts=(1, -2), dims=(0, 1))      # b[y, x] = a[y - 1, x + 2]
    >>> m = local_match(f, moved, 3)
    >>> bool((m.coords[5:-5, 5:-5] - torch.tensor([1, -2]) == torch.stack(torch.meshgrid(
    ...     torch.arange(5, 15), torch.arange(5, 19), indexing="ij"), -1)).all())
    True
    >>> local_match(f, moved, (1, 2), output="volume").shape
    torch.Size([3, 5, 20, 24])
    """
    output = check_choice(output, "output", LOCAL_OUTPUTS)
    sampling = check_choice(sampling, "sampling", SAMPLINGS)
    m = get_metric(metric)
    win, (ra, rb, moved), batched = _prepare(a, b, radius, dilation, flow, sampling, m, layout, mask_a, mask_b)
    if output == "volume":
        if k != 1:
            raise ValueError(f"k applies to output='topk'; output='volume' returns every candidate, got k={k}")
        missing = (0.0 if m.higher_is_better else math.inf) if fill is None else _check_fill(fill)
    elif fill is not None:
        raise ValueError("fill applies to output='volume'; output='topk' marks missing matches with valid=False")
    else:
        k = check_int(k, "k", 1, win.window[0] * win.window[1])
    budget = resolve_memory(memory, ra.device)
    nb, h, w, _ = win.shape
    if output == "topk":
        return _topk(win, ra, rb, moved, k, m, budget, batched)
    rows = _band_rows(win, ra, budget)
    vol = _values(win, ra, rb, moved, lambda y0, y1: win.offsets, rows, missing)
    shape = (*win.window, h, w)
    if win.slots is not None:  # offsets that no pixel can reach: missing everywhere
        whole = vol.new_full((nb, win.window[0] * win.window[1], h, w), missing)
        vol = whole.index_copy(1, torch.tensor(win.slots, dtype=torch.long, device=vol.device), vol)
    return vol.reshape(nb, *shape) if batched else vol.reshape(shape)


def _check_fill(fill: Any) -> float:
    """Any real number, NaN and infinities included (a fill marks, it is never computed with)."""
    if isinstance(fill, float) and math.isnan(fill):
        return fill
    return check_real(fill, "fill", -math.inf, math.inf, finite=False)


def _pair_int(value: Any, name: str, low: int) -> Pair:
    values = value if isinstance(value, (tuple, list)) else (value, value)
    if len(values) != 2:
        raise ValueError(f"{name} must be an int or a (row, col) pair of ints, got {value!r}")
    return check_int(values[0], name, low), check_int(values[1], name, low)


def _prepare(
    a: Any,
    b: Any,
    radius: Any,
    dilation: Any,
    flow: Any,
    sampling: str,
    metric: Metric,
    layout: str,
    mask_a: Any,
    mask_b: Any,
) -> tuple[_Window, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], bool]:
    """The validated call, and its inputs as (B, H, W, C) rows in the compute dtype (unit rows for cosine,
    masked-out pixels zeroed, so they pass no NaN into values or gradients)."""
    if layout not in ("hwc", "chw"):
        raise ValueError(f"layout must be 'hwc' or 'chw' (windows need a 2-D grid), got {layout!r}")
    ra, grid, batched = check_features(a, "a", layout, finite=False)
    rb, grid_b, batched_b = check_features(b, "b", layout, finite=False)
    if grid != grid_b:
        raise ValueError(f"a and b must share one grid (windows sit at a's own positions), got {grid} and {grid_b}")
    check_pair(ra, rb, batched, batched_b)
    ry, rx = _pair_int(radius, "radius", 0)
    dy, dx = _pair_int(dilation, "dilation", 1)
    nb, (h, w) = ra.shape[0], grid
    masks = [
        check_batch_mask(mk, name, nb, grid, batched, ra.device)
        for mk, name in ((mask_a, "mask_a"), (mask_b, "mask_b"))
    ]
    for rows, mk, name in ((ra, masks[0], "a"), (rb, masks[1], "b")):
        check_finite(rows.detach(), name, mask=None if mk is None else mk.reshape(nb, -1))
    dtype = compute_dtype(ra, rb)
    moved = _check_flow(flow, sampling, nb, grid, batched, ra.device, dtype)
    # cosine reads unit rows with a dot product, except where b is interpolated: the cosine of
    # the blended feature, not the blend of unit features
    blended = moved is not None and moved.is_floating_point()
    prepared = []
    for rows, mk, unit in ((ra, masks[0], True), (rb, masks[1], not blended)):
        x = rows.to(dtype).contiguous()  # channels last: each pixel's feature one run of memory
        if mk is not None:
            x = torch.where(mk.reshape(nb, -1, 1), x, 0.0)
        if metric.name == "cosine" and unit:
            x = unit_rows(x)
        prepared.append(x.reshape(nb, h, w, -1))
    pair = get_metric("dot").pair_value if metric.name == "cosine" and not blended else metric.pair_value
    rows_i, cols_j = (_reachable(r, d, size, moved, axis) for r, d, size, axis in ((ry, dy, h, 0), (rx, dx, w, 1)))
    offsets = [(i * dy, j * dx) for i in rows_i for j in cols_j]
    slots = None
    if len(offsets) < (2 * ry + 1) * (2 * rx + 1):
        slots = [(i + ry) * (2 * rx + 1) + (j + rx) for i in rows_i for j in cols_j]
    window = _Window(
        shape=(nb, h, w, ra.shape[2]),
        offsets=offsets,
        window=(2 * ry + 1, 2 * rx + 1),
        slots=slots,
        flow_kind=None if moved is None else sampling,
        mask_a=masks[0],
        mask_b=masks[1],
        pair=pair,
        device=ra.device,
        linear=metric.name == "dot" or (metric.name == "cosine" and not blended),
    )
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


def _check_flow(
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


def _band_rows(win: _Window, ra: torch.Tensor, budget: int) -> int:
    """Rows of a per band: one offset's working copies (the candidates read, the metric's
    temporary and its gradient; for a flow the gathered copies, four and their blend for
    bilinear sampling) plus the band's values and validity at every offset."""
    nb, h, w, c = win.shape
    copies = {None: 3, "nearest": 4, "bilinear": 9}[win.flow_kind]
    per_pixel = copies * c * ra.element_size() + _BOOK_BYTES * len(win.offsets)
    return min(h, chunk_rows(budget, nb * w * per_pixel, "one row of windows"))


class _Values(torch.autograd.Function):
    """(B, m, H, W) values of m offsets per pixel, ``fill`` where a pixel has no candidate. The
    backward recomputes each (band, offset) and differentiates it alone."""

    @staticmethod
    def forward(
        ctx: Any,
        ra: torch.Tensor,
        rb: torch.Tensor,
        flow: torch.Tensor | None,
        win: _Window,
        offsets: Offsets,
        rows: int,
        fill: float,
    ) -> torch.Tensor:
        nb, h, w, _ = win.shape
        out: torch.Tensor | None = None
        for y0 in range(0, h, rows):
            y1 = min(h, y0 + rows)
            v, ok = _band(win, ra, rb, flow, y0, y1, offsets(y0, y1))
            if out is None:
                out = ra.new_empty((nb, v.shape[1], h, w))
            out[:, :, y0:y1] = v.masked_fill_(~ok, fill)
        assert out is not None
        ctx.save_for_backward(ra, rb, flow)
        ctx.win, ctx.offsets, ctx.rows = win, offsets, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ra, rb, flow = ctx.saved_tensors
        win: _Window = ctx.win
        track = tuple(ctx.needs_input_grad[:3])
        grads = [torch.zeros_like(t) if need else None for t, need in zip((ra, rb, flow), track, strict=True)]
        h, c = win.shape[1], win.shape[3]
        for y0 in range(0, h, ctx.rows):
            y1 = min(h, y0 + ctx.rows)
            for j, (oy, ox) in enumerate(ctx.offsets(y0, y1)):
                read = win.read(y0, y1, oy, ox, flow)
                if read.out is None:
                    continue
                g = grad[:, j, y0:y1][read.out] * read.valid[read.out]
                if win.linear and read.b is not None and read.a is not None:
                    # a shifted dot product: its gradients directly, with no recomputation
                    if grads[0] is not None:
                        grads[0][read.a].addcmul_(g[..., None], rb[read.b])
                    if grads[1] is not None:
                        grads[1][read.b].addcmul_(g[..., None], ra[read.a])
                    continue
                with torch.enable_grad():
                    v, sources = win.evaluate(read, ra, rb, flow, track)
                    leaves = [x for x in sources if x is not None and x.requires_grad]
                    found = iter(torch.autograd.grad(v, leaves, g))
                _, *parts, fl = sources
                if grads[0] is not None and read.a is not None:
                    grads[0][read.a] += next(found)
                if grads[1] is not None:
                    for k in range(len(parts)):
                        got = next(found)
                        if read.b is not None:
                            grads[1][read.b] += got
                        else:
                            grads[1].view(-1, c).index_add_(0, read.index[k], got.reshape(-1, c))
                if grads[2] is not None and fl is not None:
                    grads[2][:, y0:y1] += next(found)
        return (*grads, None, None, None, None)


def _values(
    win: _Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    offsets: Offsets,
    rows: int,
    fill: float,
) -> torch.Tensor:
    out = _Values.apply(ra, rb, flow, win, offsets, rows, fill)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def _topk(
    win: _Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    k: int,
    metric: Metric,
    budget: int,
    batched: bool,
) -> Matches:
    """The k best candidates of every pixel, ranked without gradients, ties to the lower
    offset; their values recomputed through :class:`_Values` where the inputs need gradients."""
    nb, h, w, _ = win.shape
    rows = _band_rows(win, ra, budget)
    dev = ra.device
    k_all, k = k, min(k, len(win.offsets))  # slots past the reachable offsets stay empty
    best = torch.empty((nb, h, w, k), dtype=torch.int64, device=dev)
    score = torch.empty((nb, h, w, k), dtype=ra.dtype, device=dev)
    valid = torch.empty((nb, h, w, k), dtype=torch.bool, device=dev)
    sign = 1.0 if metric.higher_is_better else -1.0
    with torch.no_grad():
        for y0 in range(0, h, rows):
            y1 = min(h, y0 + rows)
            v, ok = _band(win, ra, rb, flow, y0, y1, win.offsets)
            ranked = torch.where(ok, v * sign, -math.inf)
            if k == 1:  # argmax takes the first of equal maxima: ties to the lower offset
                order = ranked.argmax(1, keepdim=True)
            else:
                order = ranked.sort(dim=1, descending=True, stable=True).indices[:, :k]
            best[:, y0:y1] = order.permute(0, 2, 3, 1)
            score[:, y0:y1] = v.gather(1, order).permute(0, 2, 3, 1)
            valid[:, y0:y1] = ok.gather(1, order).permute(0, 2, 3, 1)
    offsets = torch.tensor(win.offsets, dtype=torch.int64, device=dev).reshape(-1, 2)[best]  # (B, H, W, k, 2)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (ra, rb, flow)):

        def picks(y0: int, y1: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(offsets[:, y0:y1, :, j, 0], offsets[:, y0:y1, :, j, 1]) for j in range(k)]

        score = _values(win, ra, rb, flow, picks, rows, math.nan).permute(0, 2, 3, 1)
    centre = torch.stack(torch.meshgrid(torch.arange(h, device=dev), torch.arange(w, device=dev), indexing="ij"), -1)
    coords = centre[None, :, :, None] + offsets
    if flow is not None:
        coords = coords + flow[:, :, :, None]
    near = (coords + 0.5).floor().long() if coords.is_floating_point() else coords
    index = torch.where(valid, near[..., 0] * w + near[..., 1], -1)
    score = torch.where(valid, score, math.nan)
    coords = torch.where(valid[..., None], coords, math.nan if coords.is_floating_point() else -1)
    if k_all > k:
        extra = k_all - k
        index = F.pad(index, (0, extra), value=-1)
        score = F.pad(score, (0, extra), value=math.nan)
        valid = F.pad(valid, (0, extra), value=False)
        coords = F.pad(coords, (0, 0, 0, extra), value=math.nan if coords.is_floating_point() else -1)
        k = k_all
    shape = (*((nb,) if batched else ()), h, w, *((k,) if k > 1 else ()))
    return Matches(
        index=index.reshape(shape),
        coords=coords.reshape(*shape, 2),
        score=score.reshape(shape),
        valid=valid.reshape(shape),
    )


def _band(
    win: _Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    y0: int,
    y1: int,
    offsets: Sequence[tuple[Any, Any]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, m, y1 - y0, W) values of rows y0:y1 of a at each of m offsets, NaN where a pixel has
    no candidate, and where it has one."""
    nb, _, w, _ = win.shape
    vals = ra.new_full((nb, len(offsets), y1 - y0, w), math.nan)
    valid = torch.zeros(vals.shape, dtype=torch.bool, device=vals.device)
    for j, (oy, ox) in enumerate(offsets):
        read = win.read(y0, y1, oy, ox, flow)
        if read.out is not None:
            vals[:, j][read.out] = win.evaluate(read, ra, rb, flow)[0]
            valid[:, j] = read.valid
    return vals, valid


class LocalMatcher(nn.Module):
    """:func:`local_match` as a module (a drop-in for spatial-correlation-sampler's
    ``SpatialCorrelationSampler`` with ``metric="dot"``, ``layout="chw"``, ``output="volume"``).

    Parameters
    ----------
    radius, dilation, sampling, metric, k, output, layout, fill, memory
        As in :func:`local_match`, checked here.

    Examples
    --------
    >>> corr = LocalMatcher(4, metric="dot", layout="chw", output="volume")
    >>> corr(torch.randn(2, 16, 12, 10), torch.randn(2, 16, 12, 10)).shape
    torch.Size([2, 9, 9, 12, 10])
    """

    def __init__(
        self,
        radius: int | tuple[int, int],
        *,
        dilation: int | tuple[int, int] = 1,
        sampling: str = "nearest",
        metric: str = "cosine",
        k: int = 1,
        output: str = "topk",
        layout: str = "hwc",
        fill: float | None = None,
        memory: int | str | None = None,
    ) -> None:
        super().__init__()
        self.radius = _pair_int(radius, "radius", 0)
        self.dilation = _pair_int(dilation, "dilation", 1)
        self.sampling = check_choice(sampling, "sampling", SAMPLINGS)
        self.metric = get_metric(metric).name
        self.output = check_choice(output, "output", LOCAL_OUTPUTS)
        self.k = check_int(k, "k", 1, (2 * self.radius[0] + 1) * (2 * self.radius[1] + 1))
        self.layout = check_choice(layout, "layout", ("hwc", "chw"))
        self.fill = fill
        if memory is not None:
            parse_memory(memory)
        self.memory = memory

    def forward(self, a: Any, b: Any, *, flow: Any = None, mask_a: Any = None, mask_b: Any = None) -> Any:
        return local_match(
            a,
            b,
            self.radius,
            dilation=self.dilation,
            flow=flow,
            sampling=self.sampling,
            metric=self.metric,
            k=self.k,
            output=self.output,
            layout=self.layout,
            mask_a=mask_a,
            mask_b=mask_b,
            fill=self.fill,
            memory=self.memory,
        )

    def extra_repr(self) -> str:
        shown = [f"radius={self.radius}", f"metric={self.metric!r}", f"output={self.output!r}"]
        shown += [f"dilation={self.dilation}"] if self.dilation != (1, 1) else []
        shown += [f"k={self.k}"] if self.k != 1 else []
        shown += [f"sampling={self.sampling!r}"] if self.sampling != "nearest" else []
        shown += [f"layout={self.layout!r}"]
        return ", ".join(shown)
