"""Merging running top-k lists: plain functions on (rows, k) value and index tensors.

Scores are higher-is-better; equal scores always go to the lower column, whatever order the
blocks come in, so every strategy returns the same ties.
"""

from __future__ import annotations

import torch

__all__ = ["best_of_candidates", "merge_best", "merge_topk", "order"]


def merge_best(s: torch.Tensor, offset: int, best_v: torch.Tensor, best_i: torch.Tensor) -> torch.Tensor:
    """k = 1: keep each row's maximum; an equal score from a later tile never wins. Returns the
    block's row maxima. (Row maxima, then the argmax of the rows that improve, ran faster here
    than one ``max`` with indices, which also finds the column of rows that do not improve.)"""
    rowmax = s.amax(1)
    need = rowmax > best_v[:, 0]
    rows = need.nonzero().squeeze(1)
    n = rows.numel()
    if n == 0:
        return rowmax
    if 4 * n >= s.shape[0]:
        arg = s.argmax(1)
        best_v[:, 0] = torch.where(need, rowmax, best_v[:, 0])
        best_i[:, 0] = torch.where(need, arg + offset, best_i[:, 0])
    else:
        best_v[rows, 0] = rowmax[rows].to(best_v.dtype)
        best_i[rows, 0] = s.index_select(0, rows).argmax(1) + offset
    return rowmax


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


def merge_topk(s: torch.Tensor, offset: int, best_v: torch.Tensor, best_i: torch.Tensor) -> torch.Tensor:
    """k > 1: merge a block's top-k into the running top-k of the rows that can improve.
    Returns the block's row maxima."""
    k = best_v.shape[1]
    rowmax = s.amax(1)
    rows = (rowmax > best_v[:, -1]).nonzero().squeeze(1)
    if rows.numel() == 0:
        return rowmax
    sub = s if rows.numel() == s.shape[0] else s.index_select(0, rows)
    v, i = topk_lowest_index(sub, min(k, s.shape[1]))
    cand_v = torch.cat([best_v[rows], v.to(best_v.dtype)], dim=1)
    cand_i = torch.cat([best_i[rows], i + offset], dim=1)
    cand_v, cand_i = order(cand_v, cand_i)
    best_v[rows], best_i[rows] = cand_v[:, :k], cand_i[:, :k]
    return rowmax


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
