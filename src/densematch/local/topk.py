"""The best k candidates of every pixel's window, exactly, ties to the lower offset."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..matching.dense import Matches
from ..metrics import Metric
from .volume import band, band_rows, values
from .windows import Window

__all__ = ["matches", "rank", "topk"]


def rank(
    win: Window, ra: torch.Tensor, rb: torch.Tensor, flow: torch.Tensor | None, k: int, metric: Metric, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(B, H, W, k') indices into ``win.offsets`` of every pixel's k' = min(k, reachable
    offsets) best candidates, best first, ties to the lower offset; their values (no gradient)
    and validity; and the band height used."""
    nb, h, w, _ = win.shape
    rows = band_rows(win, ra, budget)
    dev = ra.device
    k = min(k, len(win.offsets))  # slots past the reachable offsets stay empty
    best = torch.empty((nb, h, w, k), dtype=torch.int64, device=dev)
    score = torch.empty((nb, h, w, k), dtype=ra.dtype, device=dev)
    valid = torch.empty((nb, h, w, k), dtype=torch.bool, device=dev)
    sign = 1.0 if metric.higher_is_better else -1.0
    with torch.no_grad():
        for y0 in range(0, h, rows):
            y1 = min(h, y0 + rows)
            v, ok = band(win, ra, rb, flow, y0, y1, win.offsets)
            ranked = (v if sign > 0 else -v).masked_fill(~ok, -math.inf)
            if k == 1:
                order = _first_best(ranked)
            else:
                order = ranked.sort(dim=1, descending=True, stable=True).indices[:, :k]
            best[:, y0:y1] = order.permute(0, 2, 3, 1)
            score[:, y0:y1] = v.gather(1, order).permute(0, 2, 3, 1)
            valid[:, y0:y1] = ok.gather(1, order).permute(0, 2, 3, 1)
    return best, score, valid, rows


def topk(
    win: Window,
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
    best, score, valid, rows = rank(win, ra, rb, flow, k, metric, budget)
    offsets = torch.tensor(win.offsets, dtype=torch.int64, device=ra.device).reshape(-1, 2)[best]  # (B, H, W, k, 2)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (ra, rb, flow)):

        def picks(y0: int, y1: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(offsets[:, y0:y1, :, j, 0], offsets[:, y0:y1, :, j, 1]) for j in range(best.shape[3])]

        # each pixel's own picks are gathered, from channels-last rows
        score = values(win, ra.contiguous(), rb.contiguous(), flow, picks, rows, math.nan).permute(0, 2, 3, 1)
    return matches(offsets, score, valid, flow, k, batched)


def matches(
    offsets: torch.Tensor,
    score: torch.Tensor,
    valid: torch.Tensor,
    flow: torch.Tensor | None,
    k: int,
    batched: bool,
) -> Matches:
    """The :class:`Matches` of (B, H, W, k', 2) chosen offsets with their values and validity
    (k' <= k: the slots past k' are empty)."""
    nb, h, w, found = valid.shape
    dev = valid.device
    centre = torch.stack(torch.meshgrid(torch.arange(h, device=dev), torch.arange(w, device=dev), indexing="ij"), -1)
    coords = centre[None, :, :, None] + offsets
    if flow is not None:
        coords = coords + flow[:, :, :, None]
    near = (coords + 0.5).floor().long() if coords.is_floating_point() else coords
    index = torch.where(valid, near[..., 0] * w + near[..., 1], -1)
    score = torch.where(valid, score, math.nan)
    coords = torch.where(valid[..., None], coords, math.nan if coords.is_floating_point() else -1)
    if k > found:
        extra = k - found
        index = F.pad(index, (0, extra), value=-1)
        score = F.pad(score, (0, extra), value=math.nan)
        valid = F.pad(valid, (0, extra), value=False)
        coords = F.pad(coords, (0, 0, 0, extra), value=math.nan if coords.is_floating_point() else -1)
    shape = (*((nb,) if batched else ()), h, w, *((k,) if k > 1 else ()))
    return Matches(
        index=index.reshape(shape),
        coords=coords.reshape(*shape, 2),
        score=score.reshape(shape),
        valid=valid.reshape(shape),
    )


def _first_best(ranked: torch.Tensor) -> torch.Tensor:
    """(B, 1, rows, W) the first offset of the highest value along dim 1 of (B, m, rows, W):
    ties to the lower offset. A running maximum over the offsets, each step a contiguous pass
    over the band's pixels (argmax reduces across the strided offset axis several times slower)."""
    top = ranked[:, 0].clone()
    at = torch.zeros(top.shape, dtype=torch.int64, device=ranked.device)
    for j in range(1, ranked.shape[1]):
        better = ranked[:, j] > top
        top = torch.where(better, ranked[:, j], top)
        at.masked_fill_(better, j)
    return at[:, None]
