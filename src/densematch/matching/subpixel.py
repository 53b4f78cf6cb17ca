"""Sub-pixel positions of matches: each match refined around its integer position in b, with
bounded work per match (a few feature reads), never another search.

- "parabola": per axis, the vertex of the parabola through the best score and its two
  neighbours' (scores by the metric's direct form).
- "soft": the soft-argmax of the 3x3 window around the best match, weights
  exp(-(s_best - s) / t) with t the window's mean drop from the best (scale-free).
- "features": Gauss-Newton in feature space: the offset whose bilinearly interpolated feature
  of b best fits a's feature (least squares; unit features for cosine), three steps from the
  integer position, kept within one pixel of it. A match whose 5x5 window (what the fit may
  read) leaves b's grid or its allowed pixels is refined by the parabola instead.

Whatever the mode, a match gets finite coordinates within one pixel of its integer position,
and pixels of b that ``allowed`` leaves out are never read: a neighbour outside the grid or
the mask counts as absent (an axis without both neighbours is not moved). Features are read
at a common power-of-two scale (that of the search), so magnitudes near float32's limits
neither overflow nor underflow.
"""

from __future__ import annotations

import torch

from ..budget import chunk_rows
from ..checks import compute_dtype
from ..engine.driver import common_scale, peak
from ..metrics import Metric

__all__ = ["REFINES", "refine_positions"]

REFINES = ("parabola", "soft", "features")
_STEPS = 3


def refine_positions(
    a: torch.Tensor,
    b: torch.Tensor,
    grid_b: tuple[int, int],
    index: torch.Tensor,
    metric: Metric,
    mode: str,
    budget: int,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float (row, col) positions in b's grid of the matches ``index``.

    Parameters
    ----------
    a : Tensor of shape (Na, C)
        Query rows.
    b : Tensor of shape (Nb, C)
        Reference rows, b's grid (Hb, Wb) flattened.
    index : Tensor of int64, shape (Na, k)
        Matches (flat indices into b); -1 for none.
    mode : {"parabola", "soft", "features"}
    allowed : Tensor of bool, shape (Nb,), optional
        The pixels of b that may be read (b's mask); all when None.

    Returns
    -------
    Tensor of float32 (float64 for float64 inputs), shape (Na, k, 2); NaN where index is -1.
    """
    hb, wb = grid_b
    dtype = compute_dtype(a, b)
    na, k = index.shape
    out = torch.full((na, k, 2), float("nan"), dtype=dtype, device=a.device)
    c = a.shape[1]
    # per match: its query row, up to 9 reference rows (or 4 corners at 5 points), in dtype
    per_match = (1 + 20) * c * (torch.finfo(dtype).bits // 8) * 3 + 256
    step = chunk_rows(budget, per_match, "the refinement of one match")
    # the search's common scale: features near float32's limits square without overflow
    scale = common_scale(max(peak(a, None, step), peak(b, None, step)))
    flat_a = torch.arange(na, device=a.device).repeat_interleave(k)
    flat_i = index.reshape(-1)
    result = out.view(-1, 2)
    for s in range(0, flat_i.numel(), step):
        i = flat_i[s : s + step]
        found = (i >= 0).nonzero().squeeze(1)
        if found.numel() == 0:
            continue
        rows_a = a.index_select(0, flat_a[s : s + step][found]).to(dtype) * scale
        best = i[found]
        r0, c0 = best.div(wb, rounding_mode="floor"), best.remainder(wb)
        grid = _Grid(b, (hb, wb), allowed, dtype, scale)
        if mode == "features":
            pos = _from_scores(rows_a, grid, r0, c0, metric, "parabola")
            fit = grid.window_allowed(r0, c0, 2).nonzero().squeeze(1)
            if fit.numel():
                pos[fit] = _gauss_newton(rows_a[fit], grid, r0[fit], c0[fit], metric)
        else:
            pos = _from_scores(rows_a, grid, r0, c0, metric, mode)
        result[s + found] = pos
    return out


class _Grid:
    """b's rows on its (hb, wb) grid, read in ``dtype`` at ``scale``, with the pixels that may
    be read (``allowed``, flat; all when None)."""

    def __init__(
        self, b: torch.Tensor, grid: tuple[int, int], allowed: torch.Tensor | None, dtype: torch.dtype, scale: float
    ) -> None:
        self.b, (self.hb, self.wb), self.allowed, self.dtype, self.scale = b, grid, allowed, dtype, scale

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        r = self.b.index_select(0, flat).to(self.dtype)
        return r if self.scale == 1.0 else r * self.scale

    def readable(self, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Whether (r, c) lies on the grid and may be read."""
        inside = (r >= 0) & (r < self.hb) & (c >= 0) & (c < self.wb)
        if self.allowed is None:
            return inside
        return inside & self.allowed[(r.clamp(0, self.hb - 1) * self.wb + c.clamp(0, self.wb - 1))]

    def window_allowed(self, r0: torch.Tensor, c0: torch.Tensor, radius: int) -> torch.Tensor:
        """Whether the whole (2 radius + 1)^2 window around each (r0, c0), clamped to the grid,
        may be read (the Gauss-Newton fit reads within two pixels)."""
        ok = torch.ones_like(r0, dtype=torch.bool)
        for oy in range(-radius, radius + 1):
            for ox in range(-radius, radius + 1):
                r, c = (r0 + oy).clamp(0, self.hb - 1), (c0 + ox).clamp(0, self.wb - 1)
                ok &= self.readable(r, c)
        return ok


def _from_scores(
    rows_a: torch.Tensor, grid: _Grid, r0: torch.Tensor, c0: torch.Tensor, metric: Metric, mode: str
) -> torch.Tensor:
    """Parabola or soft-argmax from the direct scores of the 3x3 window; a neighbour off the
    grid or outside the allowed pixels is absent (never read: the centre is read in its place
    and its weight is zero), and an axis without both neighbours is not moved."""
    window, present = {}, {}
    for oy in (-1, 0, 1):
        for ox in (-1, 0, 1):
            if mode == "parabola" and oy and ox:
                continue
            r, c = r0 + oy, c0 + ox
            ok = grid.readable(r, c)
            at = torch.where(ok, r * grid.wb + c, r0 * grid.wb + c0)
            window[oy, ox] = metric.direct_score(rows_a, grid.rows(at))
            present[oy, ox] = ok
    s0 = window[0, 0]
    if mode == "parabola":
        offsets = []
        for lo, hi in (((-1, 0), (1, 0)), ((0, -1), (0, 1))):
            curve = window[lo] - 2 * s0 + window[hi]
            # a maximum only where the curve bends down; at most half a pixel from the best
            d = torch.where(curve < 0, (window[lo] - window[hi]) / (2 * curve).clamp(max=-1e-30), 0.0)
            keep = present[lo] & present[hi] & torch.isfinite(d)
            offsets.append(torch.where(keep, d.clamp(-0.5, 0.5), 0.0))
        dy, dx = offsets
    else:
        keys = list(window)
        scores = torch.stack([window[key] for key in keys], 1)  # (m, 9)
        valid = torch.stack([present[key] for key in keys], 1)
        drop = torch.where(valid, (s0[:, None] - scores).clamp_min(0), 0.0)
        # the mean drop over the neighbours present (scale-free); where none is present or none
        # drops, the match stays where it is
        t = drop.sum(1, keepdim=True) / (valid.sum(1, keepdim=True) - 1).clamp_min(1)
        weight = torch.where(valid, torch.exp(-drop / t.clamp_min(torch.finfo(s0.dtype).tiny)), 0.0)
        centre = torch.tensor([key == (0, 0) for key in keys], dtype=s0.dtype, device=s0.device)
        weight = torch.where((t > 0) & torch.isfinite(t), weight, centre)
        weight = weight / weight.sum(1, keepdim=True)
        ky = torch.tensor([key[0] for key in keys], dtype=s0.dtype, device=s0.device)
        kx = torch.tensor([key[1] for key in keys], dtype=s0.dtype, device=s0.device)
        dy, dx = weight @ ky, weight @ kx
    return torch.stack((r0.to(s0.dtype) + dy, c0.to(s0.dtype) + dx), 1)


def _bilinear(grid: _Grid, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rows of b's grid sampled at float (y, x), bilinear, clamped to the grid: (m, C)."""
    hb, wb = grid.hb, grid.wb
    y = y.clamp(0, hb - 1)
    x = x.clamp(0, wb - 1)
    y0 = y.floor().long().clamp(0, max(hb - 2, 0))
    x0 = x.floor().long().clamp(0, max(wb - 2, 0))
    fy, fx = (y - y0).unsqueeze(1), (x - x0).unsqueeze(1)
    y1, x1 = (y0 + 1).clamp(max=hb - 1), (x0 + 1).clamp(max=wb - 1)

    def at(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return grid.rows(r * wb + c)

    top = at(y0, x0) * (1 - fx) + at(y0, x1) * fx
    bottom = at(y1, x0) * (1 - fx) + at(y1, x1) * fx
    return top * (1 - fy) + bottom * fy


def _gauss_newton(
    rows_a: torch.Tensor, grid: _Grid, r0: torch.Tensor, c0: torch.Tensor, metric: Metric
) -> torch.Tensor:
    """Least-squares sub-pixel fit of a's feature to b's bilinear features around (r0, c0). A
    step the 2x2 normal equations cannot give (flat features, a one-pixel axis) is no step."""
    unit = metric.name == "cosine"

    def normed(f: torch.Tensor) -> torch.Tensor:
        return f / f.norm(dim=1, keepdim=True).clamp_min(1e-12) if unit else f

    target = normed(rows_a)
    dtype = rows_a.dtype
    y0, x0 = r0.to(dtype), c0.to(dtype)
    y, x = y0.clone(), x0.clone()
    for _ in range(_STEPS):
        here = normed(_bilinear(grid, y, x))
        gy = normed(_bilinear(grid, y + 0.5, x)) - normed(_bilinear(grid, y - 0.5, x))
        gx = normed(_bilinear(grid, y, x + 0.5)) - normed(_bilinear(grid, y, x - 0.5))
        jac = torch.stack((gy, gx), 2)  # (m, C, 2)
        n = jac.transpose(1, 2) @ jac  # (m, 2, 2)
        rhs = (jac.transpose(1, 2) @ (target - here).unsqueeze(2)).squeeze(2)  # (m, 2)
        damp = 1e-9 * (n[:, 0, 0] + n[:, 1, 1])
        a, d, off = n[:, 0, 0] + damp, n[:, 1, 1] + damp, n[:, 0, 1]
        det = a * d - off * off
        dy = (d * rhs[:, 0] - off * rhs[:, 1]) / det
        dx = (a * rhs[:, 1] - off * rhs[:, 0]) / det
        ok = (det > 0) & torch.isfinite(dy) & torch.isfinite(dx)
        y = torch.minimum(torch.maximum(y + torch.where(ok, dy, 0.0), y0 - 1), y0 + 1)
        x = torch.minimum(torch.maximum(x + torch.where(ok, dx, 0.0), x0 - 1), x0 + 1)
    return torch.stack((y.clamp(0, grid.hb - 1), x.clamp(0, grid.wb - 1)), 1)
