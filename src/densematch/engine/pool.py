"""Candidate lists: the (row, column) pairs of one query tile that may still enter a row's top
k. :class:`CandidateList` is what every search hands to its last step, whoever listed them: the
torch :class:`Pool` here, the C merge's :class:`densematch.kernels.native.Candidates`, or the
fused kernel's slots (:class:`densematch.engine.fused.KernelCandidates`)."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["CandidateList", "Pool"]


class CandidateList(Protocol):
    """The candidates of one query tile of m rows.

    Attributes
    ----------
    over : Tensor of bool, shape (m,)
        Rows whose candidates outgrew the cap: their list is incomplete, and the search resolves
        them without one.
    """

    over: torch.Tensor

    def reaching(self, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the listed pairs that may reach their row's ``floor`` (m,), rows
        that are over left out."""
        ...


class Pool:
    """Candidates of one query tile: every (row, column) whose upper bound reaches the row's
    floor (the running k-th best lower bound). Rows that collect more than ``cap`` are marked
    ``over`` and collect no more. With ``lazy``, new candidates wait in a list and the pool is
    pruned only when it holds more than ``cap`` per row on average (for floors that rarely
    change, this saves a pass over the pool for every tile)."""

    @staticmethod
    def bytes(rows: int, cap: int) -> int:
        """The most a pool of ``rows`` rows holds: (row, column, score) in 20 bytes, up to twice
        ``cap`` per row while pruning, and the sorts that pick the best."""
        return rows * cap * 20 * 4

    def __init__(self, m: int, cap: int, device: torch.device, dtype: torch.dtype, lazy: bool = False) -> None:
        self.m, self.cap, self.lazy = m, cap, lazy
        self.rows = torch.empty(0, dtype=torch.int64, device=device)
        self.cols = torch.empty(0, dtype=torch.int64, device=device)
        self.vals = torch.empty(0, dtype=dtype, device=device)
        self.over = torch.zeros(m, dtype=torch.bool, device=device)
        self.overflowed = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.held = 0

    def add(self, upper: torch.Tensor, offset: int, floor: torch.Tensor, rows: torch.Tensor) -> None:
        """Collect from the block of upper bounds ``upper`` (len(rows), n) of the pool's ``rows``
        against reference tile ``offset``; ``floor`` has one value per row of the pool. The
        caller may pass only rows whose best bound reaches the floor (the lazy pool's caller
        does; the check is repeated otherwise)."""
        if self.lazy and not self.overflowed:
            local = None
        else:
            reach = ~self.over[rows] if self.lazy else (upper.amax(1) >= floor[rows]) & ~self.over[rows]
            local = reach.nonzero().squeeze(1)
            if local.numel() == 0:
                return
        if local is None or local.numel() == rows.numel():
            hot, sub = rows, upper
        else:
            hot, sub = rows[local], upper.index_select(0, local)
        passing = sub >= floor[hot, None]
        # a row with more than cap new candidates overflows at once, before any are listed
        # (counted per row only when the block holds that many in all, from the listed pairs
        # when they are few enough to list)
        count = int(torch.count_nonzero(passing))
        listed = None
        if count > self.cap:
            if count <= hot.numel() * self.cap:
                listed = passing.nonzero()
                per_row = torch.bincount(listed[:, 0], minlength=hot.numel())
            else:
                per_row = passing.sum(1)
            burst = per_row > self.cap
            if bool(burst.any()):
                self.over[hot[burst]] = True
                self.overflowed = True
                passing[burst] = False
                listed = None
        r, col = (passing.nonzero() if listed is None else listed).unbind(1)
        self.pending.append((hot[r], col + offset, sub[r, col].to(self.vals.dtype)))
        self.held += r.numel()
        if not self.lazy or self.held > self.m * self.cap:
            self._prune(floor)

    def _prune(self, floor: torch.Tensor) -> None:
        if self.pending:
            parts = [(self.rows, self.cols, self.vals), *self.pending]
            self.rows, self.cols, self.vals = (torch.cat(p) for p in zip(*parts, strict=True))
            self.pending = []
        keep = self.vals >= floor[self.rows]
        counts = torch.bincount(self.rows[keep], minlength=self.m)
        self.over |= counts > self.cap
        self.overflowed = bool(self.over.any())
        keep &= ~self.over[self.rows]
        self.rows, self.cols, self.vals = self.rows[keep], self.cols[keep], self.vals[keep]
        self.held = self.rows.numel()

    def reaching(self, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final candidates (rows, columns), pruned with the final floor."""
        self._prune(floor)
        return self.rows, self.cols
