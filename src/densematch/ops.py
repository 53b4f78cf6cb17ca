"""The kernel operations the metrics delegate, in one object resolved once per call.

Every public function answers "may densematch's C kernels run, and can they?" once, from the
``kernel`` setting (:attr:`densematch.precision.Precision.c_kernels`), the device and the compute
dtype (:func:`densematch.kernels.ops_for`), and hands the answer down as an :class:`Ops`. The
layers call it and never ask again. :class:`Ops` is torch's implementation, written here;
:class:`densematch.kernels.c_ops.COps` is C's, with the same methods and the same answers up to
the rounding of their sums (each sums in a fixed order of its own: tests/kernels/test_ops.py
holds both to one float64 reference).

The metrics hold the mathematics (what a distance is, its gradient, its direct form) and call
these for the passes that have a C kernel: l1 / linf tiles and their gradients, the elementwise
passes around l2's product, and the values of chosen row pairs. The engine, local windows and
align use :attr:`Ops.c` to pick their own C steps (tile merges, window sums, align's passes),
which have no torch twin of the same shape.
"""

from __future__ import annotations

from typing import ClassVar

import torch

__all__ = ["TORCH_OPS", "Ops", "l2_pair_weights"]


def l2_pair_weights(g: torch.Tensor, d: torch.Tensor, *, root: bool) -> torch.Tensor:
    """Each pair's weight in the l2 gradients given ``g`` at distances ``d``: g / d (0 where
    d = 0, the subgradient that keeps training finite) for the distance, g for the squared
    distance (its 2 applied by the caller)."""
    return torch.div(g, d).masked_fill_(d == 0, 0.0) if root else g


class Ops:
    """torch's implementation of the kernel operations (``kernel="torch"``, GPUs, dtypes and
    traces the C kernels do not take)."""

    name: ClassVar[str] = "torch"
    #: whether densematch's C kernels run: the engine's, local windows' and align's own C steps
    c: ClassVar[bool] = False
    #: whether :meth:`minkowski_bank` and :meth:`l2_bank` write into an output of any strides
    writes_strided: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<densematch ops: {self.name}>"

    def minkowski_scores(self, q: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None, *, p: float) -> torch.Tensor:
        """Minus the l1 (``p`` = 1) or linf (``p`` = inf) distances, (len(q), len(r)), of rows
        ``q`` (m, C) and ``r`` (n, C), into ``out`` where given."""
        if out is None:
            return torch.cdist(q, r, p=p).neg_()
        # torch.cdist has no out=; its kernel does, and writing into the caller's reused buffer
        # keeps the allocator from churning one fresh block per tile
        return torch.ops.aten._cdist_forward.out(q, r, p, None, out=out).neg_()

    def minkowski_bank(self, rows: torch.Tensor, xt: torch.Tensor, out: torch.Tensor, *, p: float) -> None:
        """The l1 / linf distances (F, m) from prototypes ``rows`` (F, D) to columns ``xt``
        (D, m), into ``out``."""
        torch.ops.aten._cdist_forward.out(rows, xt.T.contiguous(), p, None, out=out)

    def minkowski_bank_grads(
        self, rows: torch.Tensor, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients (D, m) at ``xt`` and (F, D) at ``rows`` of :meth:`minkowski_bank`'s
        distances ``d`` (F, m), given ``g`` (F, m) at them."""
        # torch's own kernel, on one tile: its buffer of (m, F, D) stays inside the plan
        cols = xt.T.contiguous()
        gx = torch.ops.aten._cdist_backward(g.T.contiguous(), cols, rows, p, d.T.contiguous()).T
        gp = torch.ops.aten._cdist_backward(g.contiguous(), rows, cols, p, d.contiguous())
        return gx, gp

    def l2_bank(
        self,
        body: torch.Tensor,
        norms: torch.Tensor,
        centre: torch.Tensor,
        xt: torch.Tensor,
        out: torch.Tensor,
        *,
        root: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (squared, unless ``root``) l2 distances (F, m) from centred prototypes ``body``
        (F, D), their squared ``norms`` (F,) and ``centre`` (D,) to columns ``xt`` (D, m), by the
        expansion, into ``out``. Returns the centred columns (D, m), their squared norms (m,)
        and each column's smallest squared distance before the clamp (m,), for the caller's
        recomputation of the columns that lost digits."""
        xc = xt - centre[:, None]
        xx = torch.linalg.vecdot(xc, xc, dim=0)
        torch.addmm(norms[:, None], body, xc, alpha=-2.0, out=out).add_(xx)
        smallest = out.amin(0)
        out.clamp_min_(0.0)
        if root:
            out.sqrt_()
        return xc, xx, smallest

    def l2_weights(
        self, g: torch.Tensor, d: torch.Tensor, *, root: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`l2_pair_weights` of ``g`` (F, m) at distances ``d``, with its column and row
        sums."""
        w = l2_pair_weights(g, d, root=root)
        return w, w.sum(0), w.sum(1)

    def pair_values(
        self,
        q: torch.Tensor,
        r: torch.Tensor,
        idx: torch.Tensor,
        kind: str,
        *,
        q_rows: torch.Tensor | None = None,
        r_terms: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The reduction ``kind`` of the pairs (q[q_rows[i]], r[idx[i, j]]) in one pass per pair
        with no gathered copy, or None where this implementation has no such pass (torch's:
        the metric gathers the rows and computes its own direct form)."""
        return None

    def cosine_terms(self, x: torch.Tensor) -> torch.Tensor | None:
        """Cosine's scale and norm of each row of ``x`` (n, C) as :meth:`pair_values` would
        compute them at each pair, once; None where it needs none."""
        return None


TORCH_OPS = Ops()
