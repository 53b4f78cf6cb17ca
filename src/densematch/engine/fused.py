"""The fused Triton kernel's search: the kernel multiplies and merges each score tile into a
running top-k without writing it to memory (and, certified, lists the candidates inside the
rounding bound); the re-scoring and the float32 fallback are :class:`HalfSearch`'s. With float32
operands the kernel multiplies in IEEE arithmetic and its top-k is final."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..precision import query_terms
from .half import HalfSearch
from .plan import Dims
from .strategy import rescore_bytes

__all__ = ["KernelSearch"]


class KernelSearch(HalfSearch):
    """The fused kernel ranks; no score block ever reaches memory (see the module)."""

    # narrower reference tiles only cost the kernel more launches: it holds no score block
    narrowest_b = 1024

    @classmethod
    def tile_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int]:
        return na, nb

    @classmethod
    def own_bytes(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        # the kernel's running top-k (`_run`: value + int32 index, k slots rounded up), and the
        # certificate's candidate slots (`rank`: an int32 each, then row and column as int64),
        # the re-scoring chunk (`block`) and the references' bound terms
        state = ta * 2 * max(2, d.k) * 8
        if not d.cap:
            return state
        return state + ta * d.cap * 28 + ta * rescore_bytes(d.c) + d.ref_rows(tb, whole_b) * 3 * d.item

    def block(self, ta: int) -> torch.Tensor:
        """The re-scoring chunk's bytes (the kernel needs no score block)."""
        return torch.empty(ta * rescore_bytes(self.a.shape[1]), dtype=torch.uint8, device=self.a.device)

    def _run(
        self, q: torch.Tensor, refs: Callable[[int, int], torch.Tensor], k: int, cert: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel over every reference tile: (m, slots) running scores and int32 indices."""
        m = q.shape[0]
        slots = max(2, 1 << (k - 1).bit_length())
        val = torch.full((m, slots), -math.inf, dtype=torch.float32, device=q.device)
        idx = torch.full((m, slots), -1, dtype=torch.int32, device=q.device)
        from ..kernels.topk import topk_launch

        for j in range(0, self.nb, self.tile_b):
            stop = min(j + self.tile_b, self.nb)
            r = refs(j, stop)
            terms = self._ref_terms(j, stop, r) if cert else None
            topk_launch(q, r, val, idx, k=k, offset=j, bias=self.metric.extra_columns == 1, ref_terms=terms, **cert)
        return val, idx

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        m, k = best_v.shape
        q = self._prepare_queries(start, m)
        qh = q.to(self.half)
        cert: dict[str, torch.Tensor] = {}
        if self.cap_rows:
            cert = {
                "query_terms": query_terms(q, qh),
                "count": torch.zeros(m, dtype=torch.int32, device=q.device),
                "cand": torch.full((m, self.cap_rows), -1, dtype=torch.int32, device=q.device),
            }
        val, idx = self._run(qh, self._half_refs, k, cert)
        if not self.cap_rows:
            best_v.copy_(val[:, :k])
            best_i.copy_(idx[:, :k])
            return
        over = cert["count"] > self.cap_rows
        listed = (cert["cand"] >= 0) & ~over[:, None]
        rows, slot = listed.nonzero().unbind(1)
        self._settle(q, start, rows, cert["cand"][rows, slot].long(), over, best_v, best_i, buf)

    def _search_float32(self, q: torch.Tensor, k: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The overflowing rows again, through the kernel in IEEE float32 (their order within
        the k is settled by :meth:`finalise`)."""
        val, idx = self._run(q, self._prepare_refs, k, {})
        return val[:, :k], idx[:, :k].long()
