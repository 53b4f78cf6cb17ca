"""Bindings of native.c's local-window kernels (:mod:`densematch.kernels.native` holds them all):
the values of every offset of a window, by whole offsets or through a flow with bilinear
sampling, and their gradients."""

from __future__ import annotations

import torch

from .c_engine import PAIR_KINDS
from .loader import _SUFFIX, _loaded, _require

__all__ = ["local_flow_grad", "local_flow_values", "local_values", "planar"]


def _grid_columns(oy: torch.Tensor, ox: torch.Tensor) -> int:
    """The columns of the offsets where they are a whole row-major grid of unit steps (the
    moved window's dot products can then be shared), else 0."""
    if oy.numel() == 0:
        return 0
    rows = torch.arange(int(oy[0]), int(oy[-1]) + 1)
    cols = torch.arange(int(ox[0]), int(ox[-1]) + 1)
    if rows.numel() * cols.numel() != oy.numel():
        return 0
    grid = torch.cartesian_prod(rows, cols)
    return cols.numel() if torch.equal(grid[:, 0], oy) and torch.equal(grid[:, 1], ox) else 0


def local_values(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    kind: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(m, y1 - y0, W) values of rows y0:y1 of a (H, W, C) against b (H, W, C) at the m offsets
    (m, 2) int64 (row, col), NaN where an offset leaves the grid: "dot", "sqdiff", "absdiff" or
    "maxabs", each pair as :func:`pair_values` reduces it; into ``out`` (contiguous) when given.
    a and b are both contiguous, or both views of channels-first storage (:func:`planar`), read
    in place: each row a window reaches turned channels last once, into a ring of rows, for the
    same values to the bit. On this thread."""
    lib = _loaded("local_values", a, b, offsets, out)
    flat = planar(a) and planar(b)
    oy, ox, out = _window_args(a, b, offsets, y0, y1, kind, out, flat)
    h, w, c = a.shape
    args = (a.data_ptr(), b.data_ptr(), h, w, c, oy.data_ptr(), ox.data_ptr(), len(offsets), y0, y1, PAIR_KINDS[kind])
    if not flat:
        getattr(lib, f"dm_local_values_{_SUFFIX[a.dtype]}")(*args, out.data_ptr())
    elif getattr(lib, f"dm_local_planar_{_SUFFIX[a.dtype]}")(*args, out.data_ptr()):
        rows = int(oy.max() - oy.min()) + 2
        raise MemoryError(f"native.local_values: no memory for a ring of {rows} rows of {w} x {c}")
    return out


def planar(x: torch.Tensor) -> bool:
    """Whether (H, W, C) ``x`` is a view of contiguous channels-first (C, H, W) storage, which
    :func:`local_values` reads in place (and a contiguous map is not, unless C is 1)."""
    return x.ndim == 3 and x.shape[2] > 1 and x.permute(2, 0, 1).is_contiguous()


def _window_args(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    kind: str,
    out: torch.Tensor | None,
    flat: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local kernels' checked arguments: the offsets' rows and columns (int64) and the
    output (m, y1 - y0, W), made where not given. ``flat``: a and b are channels-first views."""
    laid_out = flat or (a.is_contiguous() and b.is_contiguous())
    _require(
        a.dtype == b.dtype and a.shape == b.shape and a.ndim == 3 and laid_out,
        "a and b must be contiguous (H, W, C) maps of one dtype and shape (or both channels-first views)",
    )
    _require(kind in PAIR_KINDS and kind != "cosine", f"kind must be dot, sqdiff, absdiff or maxabs, got {kind!r}")
    _require(0 <= y0 <= y1 <= a.shape[0], f"rows {y0}:{y1} must lie in 0:{a.shape[0]}")
    shape = (len(offsets), y1 - y0, a.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=a.dtype)
    _require(out.shape == shape and out.dtype == a.dtype and out.is_contiguous(), f"out must be contiguous {shape}")
    oy, ox = (offsets[:, i].to(torch.int64).contiguous() for i in (0, 1))
    return oy, ox, out


def local_flow_values(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    kind: str,
    *,
    bilinear: bool,
    linear: bool,
    mask_b: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`local_values` of windows moved by ``flow`` (H, W, 2) (row, col), each pixel's
    window rigidly: at (floor(y + fy) + oy, floor(x + fx) + ox), whole numbers unless
    ``bilinear``: then b's four neighbours of each position are blended with the fractions of
    y + fy and x + fx (``linear``: the blend of their dot products, shared between the offsets
    where they are a whole grid of unit steps; else the pair of a and the blended feature).
    ``mask_b`` (H, W) bool: pixels of b that may be read. Returns the values (m, y1 - y0, W), NaN
    where a window's position needs a pixel outside b, and that validity (bool). On this thread."""
    lib = _loaded("local_flow_values", a, b, flow, offsets, mask_b, out)
    oy, ox, out = _window_args(a, b, offsets, y0, y1, kind, out)
    h, w, c = a.shape
    _require(flow.shape == (h, w, 2), f"flow must have shape {(h, w, 2)}")
    flow = flow.to(a.dtype).contiguous()
    mask = None if mask_b is None else mask_b.to(torch.uint8).contiguous()
    valid = torch.empty(out.shape, dtype=torch.uint8)
    code = getattr(lib, f"dm_local_flow_{_SUFFIX[a.dtype]}")(
        a.data_ptr(), b.data_ptr(), h, w, c, flow.data_ptr(), int(bilinear),
        None if mask is None else mask.data_ptr(), oy.data_ptr(), ox.data_ptr(), len(offsets),
        _grid_columns(oy, ox), y0, y1, PAIR_KINDS[kind], int(linear), out.data_ptr(), valid.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise MemoryError("the local window kernel could not allocate its scratch")
    return out, valid.bool()


def local_flow_grad(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    grad: torch.Tensor,
    *,
    bilinear: bool,
    mask_b: torch.Tensor | None = None,
    ga: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    gf: torch.Tensor | None = None,
) -> None:
    """Accumulate into ``ga``, ``gb`` (H, W, C) and ``gf`` (H, W, 2) (contiguous, a's dtype;
    any may be None) the gradients of :func:`local_flow_values`' dot products (``linear``) from
    ``grad`` (m, y1 - y0, W), with b's corners read where the torch path reads them. On this
    thread."""
    lib = _loaded("local_flow_grad", a, b, flow, offsets, grad, mask_b, ga, gb, gf)
    oy, ox, grad = _window_args(a, b, offsets, y0, y1, "dot", grad.to(a.dtype).contiguous())
    h, w, c = a.shape
    _require(flow.shape == (h, w, 2), f"flow must have shape {(h, w, 2)}")
    for t, want in ((ga, a.shape), (gb, a.shape), (gf, (h, w, 2))):
        _require(t is None or (t.shape == want and t.dtype == a.dtype and t.is_contiguous()), "contiguous outputs")
    flow = flow.to(a.dtype).contiguous()
    mask = None if mask_b is None else mask_b.to(torch.uint8).contiguous()
    getattr(lib, f"dm_local_flow_grad_{_SUFFIX[a.dtype]}")(
        a.data_ptr(), b.data_ptr(), h, w, c, flow.data_ptr(), int(bilinear),
        None if mask is None else mask.data_ptr(), oy.data_ptr(), ox.data_ptr(), len(offsets), y0, y1,
        grad.data_ptr(), *(None if t is None else t.data_ptr() for t in (ga, gb, gf)),
    )  # fmt: skip
