"""Merging running top-k lists: plain functions on (rows, k) value and index tensors.

Scores are higher-is-better; equal scores go to the lower column (for k = 1, given blocks in
increasing column order, as every strategy scans them), so every strategy returns the same ties.
On a CPU the engine merges float32 / float64 tiles with :func:`densematch.kernels.native.merge`
instead, which keeps the same rule in any order.
"""

from __future__ import annotations

import torch

__all__ = ["best_of_candidates", "merge_best", "merge_topk", "order"]


def _reaching(
    s: torch.Tensor, kth: torch.Tensor, margin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's row maxima, and the rows that can improve (maximum above the k-th best) or,
    given a ``margin``, whose maximum reaches the k-th best minus it."""
    rowmax = s.amax(1)
    reach = rowmax > kth if margin is None else rowmax >= kth - margin
    return rowmax, reach, reach.nonzero().squeeze(1)


def merge_best(
    s: torch.Tensor, offset: int, best_v: torch.Tensor, best_i: torch.Tensor, margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k = 1: keep each row's maximum; an equal score from a later tile never wins.

    Returns the rows that can improve, or with a ``margin`` (per row) those whose block maximum
    reaches their previous best minus it, and those rows of the block: every row with a score
    within ``margin`` of its new best is among them, for the caller's candidates, at no second
    pass. (Row maxima, then the argmax of these rows only, ran faster here than one ``max``
    with indices, which also finds the column of rows that do not improve.)"""
    old = best_v[:, 0]
    rowmax, reach, rows = _reaching(s, old, margin)
    n = rows.numel()
    if n == 0:
        return rows, s[:0]
    if 4 * n >= s.shape[0]:
        win = rowmax > old if margin is not None else reach
        best_i[:, 0] = torch.where(win, s.argmax(1) + offset, best_i[:, 0])
        best_v[:, 0] = torch.where(win, rowmax.to(best_v.dtype), old)
        return rows, s if n == s.shape[0] else s.index_select(0, rows)
    sub = s.index_select(0, rows)
    top, was = rowmax[rows].to(best_v.dtype), old[rows]
    win = top > was
    best_i[rows, 0] = torch.where(win, sub.argmax(1) + offset, best_i[rows, 0])
    best_v[rows, 0] = torch.where(win, top, was)
    return rows, sub


def topk_lowest_index(sub: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k where equal scores go to the lowest column, best first."""
    # topk breaks ties arbitrarily. One value more tells where that matters: a row whose k-th and
    # (k+1)-th values differ has exactly one top-k set (ties inside it are ordered below); a row
    # where they are equal has a tie at the boundary, and only such rows pay for a stable sort
    # (in chunks of one tile).
    v, i = sub.topk(min(k + 1, sub.shape[1]), dim=1)
    crowded = (v[:, k - 1] == v[:, k]).nonzero().squeeze(1) if v.shape[1] > k else v.new_empty(0, dtype=torch.long)
    v, i = v[:, :k], i[:, :k]
    item = sub.element_size()
    step = max(1, sub.shape[0] * item // (item + 8))
    for start in range(0, crowded.numel(), step):
        rows = crowded[start : start + step]
        sv, si = sub.index_select(0, rows).sort(dim=1, descending=True, stable=True)
        v[rows], i[rows] = sv[:, :k], si[:, :k]
    return order(v, i)


def order(v: torch.Tensor, i: torch.Tensor, descending: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by value, equal values by index; index -1 (an empty slot) goes last."""
    key = torch.where(i < 0, torch.iinfo(torch.int64).max, i)
    by_index = key.argsort(dim=1, stable=True)
    v, i = v.gather(1, by_index), i.gather(1, by_index)
    by_value = v.argsort(dim=1, descending=descending, stable=True)
    return v.gather(1, by_value), i.gather(1, by_value)


def merge_topk(
    s: torch.Tensor, offset: int, best_v: torch.Tensor, best_i: torch.Tensor, margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k > 1: merge a block's top-k into the running top-k of the rows that can improve.
    Returns those rows and their rows of the block, as :func:`merge_best` does (with a
    ``margin``, the rows whose maximum reaches the previous k-th best minus it)."""
    k = best_v.shape[1]
    _, _, rows = _reaching(s, best_v[:, -1], margin)
    if rows.numel() == 0:
        return rows, s[:0]
    sub = s if rows.numel() == s.shape[0] else s.index_select(0, rows)
    v, i = topk_lowest_index(sub, min(k, s.shape[1]))
    cand_v = torch.cat([best_v[rows], v.to(best_v.dtype)], dim=1)
    cand_i = torch.cat([best_i[rows], i + offset], dim=1)
    cand_v, cand_i = order(cand_v, cand_i)
    best_v[rows], best_i[rows] = cand_v[:, :k], cand_i[:, :k]
    return rows, sub


def best_of_candidates(
    rows: torch.Tensor, cols: torch.Tensor, score: torch.Tensor, best_v: torch.Tensor, best_i: torch.Tensor
) -> None:
    """Per row, the k best (score, column) of the candidate list, equal scores to the lower
    column, written into best_v / best_i (rows without candidates are left as they are)."""
    if rows.numel() == 0:
        return
    k = best_v.shape[1]
    order = cols.argsort(stable=True)
    order = order[score[order].argsort(descending=True, stable=True)]
    order = order[rows[order].argsort(stable=True)]
    rows, cols, score = rows[order], cols[order], score[order]
    counts = torch.bincount(rows, minlength=best_v.shape[0])
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(rows.numel(), device=rows.device) - first[rows]
    keep = rank < k
    best_v[rows[keep], rank[keep]] = score[keep].to(best_v.dtype)
    best_i[rows[keep], rank[keep]] = cols[keep]
