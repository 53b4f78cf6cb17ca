"""The fused Triton kernel's search: the kernel multiplies and merges each score tile into a
running top-k without writing it to memory (and, certified, lists the candidates inside the
rounding bound); the re-scoring and the resolution of rows over the cap are :class:`HalfSearch`'s.
With float32 operands the kernel multiplies in IEEE arithmetic and certifies with float32's bound,
so exact ties and near-ties are settled by the direct form as in the plain search."""

from __future__ import annotations

import math

import torch

from ..precision import query_terms
from .half import HalfSearch
from .plan import Dims
from .strategy import rescore_bytes, resolve_bytes

__all__ = ["KernelCandidates", "KernelSearch"]


class KernelCandidates:
    """The kernel's candidate slots as a :class:`~densematch.engine.pool.CandidateList`:
    ``count`` (m,) pairs listed per row, the first ``cand.shape[1]`` of them in ``cand`` (m, cap)
    (int32 columns, -1 where empty). The kernel keeps no values, so every listed pair is kept."""

    def __init__(self, count: torch.Tensor, cand: torch.Tensor) -> None:
        self.cand = cand
        self.over = count > cand.shape[1]

    def reaching(self, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, slot = ((self.cand >= 0) & ~self.over[:, None]).nonzero().unbind(1)
        return rows, self.cand[rows, slot].long()


class KernelSearch(HalfSearch):
    """The fused kernel ranks; no score block ever reaches memory (see the module)."""

    # narrower reference tiles only cost the kernel more launches: it holds no score block
    narrowest_b = 1024
    split_bias = False  # the kernel adds the l2 column itself
    centre_queries = False  # nor a bias per reference
    centre_groups = False  # nor a bias per query row and reference group
    # rows over the cap are resolved in torch (`_resolve`) in blocks of at most this many pairs
    # and this many columns: the half scores, their bounds and the pass mask
    RESOLVE_PAIRS, RESOLVE_COLUMNS, RESOLVE_PAIR_BYTES = 2**20, 4096, 16

    @classmethod
    def tile_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int]:
        return na, nb

    @classmethod
    def narrower_caps(cls, device: torch.device, na: int, nb: int) -> tuple[int, int] | None:
        return None

    @classmethod
    def own_bytes(cls, d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        # the kernel's running top-k (`_run`: value + int32 index, k slots rounded up), and the
        # certificate's candidate slots (`rank`: an int32 each, then row and column as int64),
        # the re-scoring chunk (`block`) and the references' bound terms
        state = ta * 2 * max(2, d.k) * 8
        if not d.cap:
            return state
        rows, cols = cls._resolve_block(ta, tb)
        resolve = rows * cols * cls.RESOLVE_PAIR_BYTES + resolve_bytes(ta, cols, d.cap)
        return state + ta * d.cap * 28 + ta * rescore_bytes(d.c) + d.ref_rows(tb, whole_b) * 3 * d.item + resolve

    @classmethod
    def _resolve_block(cls, ta: int, tb: int) -> tuple[int, int]:
        # min(ta, ...) rows: concave in ta, so the planner's per-row cost never undercounts it
        cols = max(1, min(tb, cls.RESOLVE_COLUMNS))
        return min(ta, max(1, cls.RESOLVE_PAIRS // cols)), cols

    def _resolve_shape(self, m: int) -> tuple[int, int]:
        return self._resolve_block(m, self.tile_b)

    def block(self, ta: int) -> torch.Tensor:
        """The re-scoring chunk's bytes (the kernel needs no score block)."""
        return torch.empty(ta * rescore_bytes(self.a.shape[1]), dtype=torch.uint8, device=self.a.device)

    def _run(self, q: torch.Tensor, k: int, cert: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel over every reference tile: (m, slots) running scores and int32 indices.
        Each tile's half rows and (certified) bound terms come from one preparation
        (:meth:`HalfSearch._sides`: no centre, no bias here)."""
        m = q.shape[0]
        slots = max(2, 1 << (k - 1).bit_length())
        val = torch.full((m, slots), -math.inf, dtype=torch.float32, device=q.device)
        idx = torch.full((m, slots), -1, dtype=torch.int32, device=q.device)
        from ..kernels.topk import topk_launch

        side = self._sides(None, bound=bool(cert))
        for j in range(0, self.nb, self.tile_b):
            r, terms, _ = side(j, min(j + self.tile_b, self.nb))
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
        val, idx = self._run(qh, k, cert)
        if not self.cap_rows:
            best_v.copy_(val[:, :k])
            best_i.copy_(idx[:, :k])
            return
        floor = val[:, :k].amin(1).to(self.dtype)  # the k-th best lower bound, in any slot order
        listed = KernelCandidates(cert["count"], cert["cand"])
        self._settle(q, start, listed, floor, best_v, best_i, buf)
