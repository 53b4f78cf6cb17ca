"""C's implementation of :class:`densematch.ops.Ops`, and the one place that resolves which runs.

:func:`ops_for` is asked once per public call (or per operator call, inside a compiled model):
the setting allows C, the tensors' device and compute dtype suit it, the library loads, and no
graph is being traced. Each method here also takes tensors of another dtype or device than the
call resolved for (an input the layer did not cast): it hands them to torch's implementation
rather than to a kernel that would refuse them.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..ops import TORCH_OPS, Ops
from ..threads import scratch
from . import c_engine
from .loader import _SUFFIX, usable

__all__ = ["C_OPS", "COps", "ops_for"]


def _fits(*xs: torch.Tensor) -> bool:
    """Whether one kernel call takes these tensors: one float dtype the library has, on the CPU."""
    return all(x.device.type == "cpu" and x.dtype in _SUFFIX and x.dtype == xs[0].dtype for x in xs)


class COps(Ops):
    """densematch's C kernels (:mod:`densematch.kernels.c_engine`), one call per tile on the
    calling thread."""

    name: ClassVar[str] = "c"
    c: ClassVar[bool] = True
    writes_strided: ClassVar[bool] = True

    def minkowski_scores(self, q: torch.Tensor, r: torch.Tensor, out: torch.Tensor | None, *, p: float) -> torch.Tensor:
        if not _fits(q, r):
            return TORCH_OPS.minkowski_scores(q, r, out, p=p)
        out = torch.empty((q.shape[0], r.shape[0]), dtype=q.dtype) if out is None else out
        return c_engine.minkowski(q, r.T, out, linf=p == float("inf"), scale=-1.0)

    def minkowski_bank(self, rows: torch.Tensor, xt: torch.Tensor, out: torch.Tensor, *, p: float) -> None:
        if not _fits(rows, xt, out):
            return TORCH_OPS.minkowski_bank(rows, xt, out, p=p)
        c_engine.minkowski(rows, xt, out, linf=p == float("inf"))

    def minkowski_bank_grads(
        self, rows: torch.Tensor, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor, *, p: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _fits(rows, xt, g, d):
            return TORCH_OPS.minkowski_bank_grads(rows, xt, g, d, p=p)
        return c_engine.minkowski_grad(rows, xt, g, d, linf=p == float("inf"))

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
        if not _fits(body, norms, centre, xt, out):
            return TORCH_OPS.l2_bank(body, norms, centre, xt, out, root=root)
        # tiles of this thread's own for the centred columns and the products, then one pass
        # adds, clamps, roots and writes
        xc = torch.sub(xt, centre[:, None], out=scratch("l2-centred", xt.shape, xt.dtype, xt.device))
        xx = c_engine.sqnorms(xc)
        products = torch.mm(body, xc, out=scratch("l2-products", out.shape, out.dtype, out.device))
        return xc, xx, c_engine.l2_finish(products, norms, xx, out, root=root)

    def l2_weights(
        self, g: torch.Tensor, d: torch.Tensor, *, root: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not _fits(g, d):
            return TORCH_OPS.l2_weights(g, d, root=root)
        return c_engine.l2_weights(g, d, scratch("l2-weights", g.shape, g.dtype, g.device), root=root)

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
        if not _fits(q, r):
            return None
        return c_engine.pair_values(q, r, idx, kind, q_rows=q_rows, r_terms=r_terms)

    def cosine_terms(self, x: torch.Tensor) -> torch.Tensor | None:
        if not _fits(x) or x.dim() != 2 or not (x.stride(1) == 1 or x.shape[1] <= 1):
            return None
        return c_engine.cosine_terms(x)


C_OPS = COps()


def ops_for(allowed: bool, device: torch.device, dtype: torch.dtype) -> Ops:
    """The operations a call runs with: C's where ``allowed`` (the ``kernel`` setting is not
    "torch": :attr:`densematch.precision.Precision.c_kernels`) and they can run for tensors of
    ``dtype`` on ``device`` (:func:`densematch.kernels.native.usable`), else torch's."""
    return C_OPS if allowed and usable(device, dtype) else TORCH_OPS
