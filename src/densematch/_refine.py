"""Sub-pixel positions of matches: each match refined around its integer position in b, with
bounded work per match (a few feature reads), never another search.

- "parabola": per axis, the vertex of the parabola through the best score and its two
  neighbours' (scores by the metric's direct form).
- "soft": the soft-argmax of the 3x3 window around the best match, weights
  exp(-(s_best - s) / t) with t the window's mean drop from the best (scale-free).
- "features": Gauss-Newton in feature space: the offset whose bilinearly interpolated feature
  of b best fits a's feature (least squares; unit features for cosine), three steps from the
  integer position, kept within one pixel of it.
"""

from __future__ import annotations

import torch

from .budget import chunk_rows
from .metrics import Metric

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

    Returns
    -------
    Tensor of float32 (float64 for float64 inputs), shape (Na, k, 2); NaN where index is -1.
    """
    hb, wb = grid_b
    dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    na, k = index.shape
    out = torch.full((na, k, 2), float("nan"), dtype=dtype, device=a.device)
    c = a.shape[1]
    # per match: its query row, up to 9 reference rows (or 4 corners at 5 points), in dtype
    per_match = (1 + 20) * c * (torch.finfo(dtype).bits // 8) * 3 + 256
    step = chunk_rows(budget, per_match, "the refinement of one match")
    flat_a = torch.arange(na, device=a.device).repeat_interleave(k)
    flat_i = index.reshape(-1)
    result = out.view(-1, 2)
    for s in range(0, flat_i.numel(), step):
        i = flat_i[s : s + step]
        found = (i >= 0).nonzero().squeeze(1)
        if found.numel() == 0:
            continue
        rows_a = a.index_select(0, flat_a[s : s + step][found]).to(dtype)
        best = i[found]
        r0, c0 = best.div(wb, rounding_mode="floor"), best.remainder(wb)
        if mode == "features":
            pos = _gauss_newton(rows_a, b, (hb, wb), r0, c0, metric, dtype)
        else:
            pos = _from_scores(rows_a, b, (hb, wb), r0, c0, metric, dtype, mode)
        result[s + found] = pos
    return out


def _scores(
    rows_a: torch.Tensor, b: torch.Tensor, wb: int, r: torch.Tensor, c: torch.Tensor, metric: Metric, dtype: torch.dtype
) -> torch.Tensor:
    return metric.direct_score(rows_a, b.index_select(0, r * wb + c).to(dtype))


def _from_scores(
    rows_a: torch.Tensor,
    b: torch.Tensor,
    grid_b: tuple[int, int],
    r0: torch.Tensor,
    c0: torch.Tensor,
    metric: Metric,
    dtype: torch.dtype,
    mode: str,
) -> torch.Tensor:
    """Parabola or soft-argmax from the direct scores of the 3x3 window (clamped at b's edge:
    an axis without both neighbours is not moved)."""
    hb, wb = grid_b
    window = {}
    for oy in (-1, 0, 1):
        for ox in (-1, 0, 1):
            if mode == "parabola" and oy and ox:
                continue
            r, c = (r0 + oy).clamp(0, hb - 1), (c0 + ox).clamp(0, wb - 1)
            window[oy, ox] = _scores(rows_a, b, wb, r, c, metric, dtype)
    inside_y = (r0 > 0) & (r0 < hb - 1)
    inside_x = (c0 > 0) & (c0 < wb - 1)
    s0 = window[0, 0]
    if mode == "parabola":
        offsets = []
        for (lo, hi), inside in ((((-1, 0), (1, 0)), inside_y), (((0, -1), (0, 1)), inside_x)):
            curve = window[lo] - 2 * s0 + window[hi]
            # a maximum only where the curve bends down; at most half a pixel from the best
            d = torch.where(curve < 0, (window[lo] - window[hi]) / (2 * curve).clamp(max=-1e-30), 0.0)
            offsets.append(torch.where(inside, d.clamp(-0.5, 0.5), 0.0))
        dy, dx = offsets
    else:
        keys = list(window)
        scores = torch.stack([window[key] for key in keys], 1)  # (m, 9)
        drop = (s0[:, None] - scores).clamp_min(0)
        t = drop.sum(1, keepdim=True) / 8
        weight = torch.exp(-drop / t.clamp_min(torch.finfo(dtype).tiny))
        # neighbours past the edge get no weight
        valid = torch.stack([(inside_y | (oy == 0)) & (inside_x | (ox == 0)) for oy, ox in keys], 1)
        weight = weight * valid
        weight = weight / weight.sum(1, keepdim=True)
        ky = torch.tensor([key[0] for key in keys], dtype=dtype, device=s0.device)
        kx = torch.tensor([key[1] for key in keys], dtype=dtype, device=s0.device)
        dy, dx = weight @ ky, weight @ kx
    return torch.stack((r0.to(dtype) + dy, c0.to(dtype) + dx), 1)


def _bilinear(
    b: torch.Tensor, grid_b: tuple[int, int], y: torch.Tensor, x: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows of b's grid sampled at float (y, x), bilinear, clamped to the grid: (m, C)."""
    hb, wb = grid_b
    y = y.clamp(0, hb - 1)
    x = x.clamp(0, wb - 1)
    y0 = y.floor().long().clamp(0, max(hb - 2, 0))
    x0 = x.floor().long().clamp(0, max(wb - 2, 0))
    fy, fx = (y - y0).unsqueeze(1), (x - x0).unsqueeze(1)
    y1, x1 = (y0 + 1).clamp(max=hb - 1), (x0 + 1).clamp(max=wb - 1)

    def at(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return b.index_select(0, r * wb + c).to(dtype)

    top = at(y0, x0) * (1 - fx) + at(y0, x1) * fx
    bottom = at(y1, x0) * (1 - fx) + at(y1, x1) * fx
    return top * (1 - fy) + bottom * fy


def _gauss_newton(
    rows_a: torch.Tensor,
    b: torch.Tensor,
    grid_b: tuple[int, int],
    r0: torch.Tensor,
    c0: torch.Tensor,
    metric: Metric,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Least-squares sub-pixel fit of a's feature to b's bilinear features around (r0, c0)."""
    unit = metric.name == "cosine"

    def normed(f: torch.Tensor) -> torch.Tensor:
        return f / f.norm(dim=1, keepdim=True).clamp_min(1e-12) if unit else f

    target = normed(rows_a)
    y0, x0 = r0.to(dtype), c0.to(dtype)
    y, x = y0.clone(), x0.clone()
    eye = torch.eye(2, dtype=dtype, device=y.device)
    for _ in range(_STEPS):
        here = normed(_bilinear(b, grid_b, y, x, dtype))
        gy = normed(_bilinear(b, grid_b, y + 0.5, x, dtype)) - normed(_bilinear(b, grid_b, y - 0.5, x, dtype))
        gx = normed(_bilinear(b, grid_b, y, x + 0.5, dtype)) - normed(_bilinear(b, grid_b, y, x - 0.5, dtype))
        jac = torch.stack((gy, gx), 2)  # (m, C, 2)
        normal = jac.transpose(1, 2) @ jac  # (m, 2, 2)
        rhs = jac.transpose(1, 2) @ (target - here).unsqueeze(2)  # (m, 2, 1)
        damp = 1e-9 * normal.diagonal(dim1=1, dim2=2).sum(1).clamp_min(1e-30)
        step = torch.linalg.solve(normal + damp[:, None, None] * eye, rhs).squeeze(2)
        y = torch.minimum(torch.maximum(y + step[:, 0], y0 - 1), y0 + 1)
        x = torch.minimum(torch.maximum(x + step[:, 1], x0 - 1), x0 + 1)
    hb, wb = grid_b
    return torch.stack((y.clamp(0, hb - 1), x.clamp(0, wb - 1)), 1)
