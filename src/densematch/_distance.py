"""Distances from every pixel of a batch of feature maps to a bank of prototypes.

``pairwise_distance`` returns the full (N, F, H, W) tensor and ``nearest_prototype`` only the k
nearest, never building that tensor. Neither ever builds the (N*H*W, F, D) broadcast: matrix
metrics go through one matrix product per tile, and l1 / linf through ``torch.cdist``'s kernel
forward and tiles of bounded size backward (``torch.cdist``'s own backward allocates that
broadcast). Both are differentiable; the backward pass recomputes tiles instead of keeping them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from . import engine
from .budget import chunk_rows, resolve_memory
from .checks import as_tensor, check_choice, check_finite, check_int
from .metrics import get_metric, row_norms, unit_rows
from .precision import RANKINGS, resolve_precision

__all__ = ["PrototypeDistance", "nearest_prototype", "pairwise_distance"]

_EPS = 1e-12


def _check_inputs(x: Any, prototypes: Any, metric: str, finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Validated x (N, D, H, W), prototypes as (F, D), and the compute dtype."""
    get_metric(metric)
    x = as_tensor(x, "x")
    p = as_tensor(prototypes, "prototypes")
    if x.ndim != 4:
        raise ValueError(f"x must have shape (N, D, H, W), got {tuple(x.shape)}")
    if p.ndim == 4 and p.shape[2:] == (1, 1):
        p = p.flatten(1)
    if p.ndim != 2:
        raise ValueError(f"prototypes must have shape (F, D) or (F, D, 1, 1), got {tuple(p.shape)}")
    for t, name in ((x, "x"), (p, "prototypes")):
        if not t.is_floating_point():
            raise TypeError(f"{name} must hold floats, got {t.dtype}; convert with .float()")
    if p.shape[0] == 0:
        raise ValueError(f"prototypes must hold at least one prototype (F >= 1), got {tuple(p.shape)}")
    if p.shape[1] != x.shape[1]:
        raise ValueError(f"prototypes must have D={x.shape[1]} features like x (N, D, H, W), got D={p.shape[1]}")
    if x.numel() == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    if p.device != x.device:
        raise ValueError(f"x and prototypes must be on one device, got {x.device} and {p.device}")
    if finite:
        check_finite(x.detach(), "x")
        check_finite(p.detach(), "prototypes")
    dtype = torch.float64 if torch.float64 in (x.dtype, p.dtype) else torch.float32
    return x, p, dtype


# The expansion's error is about eps * (||x||^2 + ||p||^2); below this fraction of that scale a
# squared distance would keep too few correct digits, so it is recomputed from x - p directly.
_CLOSE = 1e-4


class _Bank:
    """The prototypes, prepared once per call in the compute dtype: (F, D) rows, and for the
    matrix metrics their centre, centred rows and squared norms, or their unit rows."""

    def __init__(self, p: torch.Tensor, metric: str, dtype: torch.dtype) -> None:
        self.metric = metric
        self.p = p.detach().to(dtype).contiguous()
        if metric in ("l2", "sqeuclidean"):
            # centring on the prototypes' mean leaves distances alone and shrinks the norms,
            # and with them the cancellation of ||x||^2 - 2 x.p + ||p||^2
            self.centre = self.p.mean(0)
            self.pc = self.p - self.centre
            self.pp = self.pc.square().sum(1)
        elif metric == "cosine":
            self.norm = row_norms(self.p, dim=1)[:, 0]
            self.unit = unit_rows(self.p, dim=1)

    def forward_tile(self, xt: torch.Tensor, out: torch.Tensor) -> None:
        """Distances (F, m) of the columns of xt (D, m) into ``out``, in place."""
        m = self.metric
        if m in ("l1", "linf"):
            torch.ops.aten._cdist_forward.out(self.p, xt.T.contiguous(), _P[m], None, out=out)
        elif m == "dot":
            torch.mm(self.p, xt, out=out)
        elif m == "cosine":
            torch.mm(self.unit, unit_rows(xt, dim=0), out=out).neg_().add_(1.0)
        else:
            xc = xt - self.centre[:, None]
            xx = xc.square().sum(0)
            torch.addmm(self.pp[:, None], self.pc, xc, alpha=-2.0, out=out).add_(xx)
            # columns with a near prototype have lost digits: recompute them directly
            close = (out.amin(0) < _CLOSE * (xx + self.pp.max())).nonzero().squeeze(1)
            step = max(1, out.numel() // max(1, xt.shape[0] * self.p.shape[0]))
            for start in range(0, close.numel(), step):
                cols = close[start : start + step]
                diff = self.pc[:, :, None] - xc[:, cols][None]
                out[:, cols] = diff.square_().sum(1)
            out.clamp_min_(0.0)
            if m == "l2":
                out.sqrt_()

    def backward_tile(self, xt: torch.Tensor, g: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients for the columns xt (D, m) and the bank (F, D), from g and d, both (F, m)."""
        m = self.metric
        if m in ("l1", "linf"):
            # torch's own kernel, on one tile: its buffer of (m, F, D) stays inside the plan
            rows = xt.T.contiguous()
            gx = torch.ops.aten._cdist_backward(g.T.contiguous(), rows, self.p, _P[m], d.T.contiguous()).T
            gp = torch.ops.aten._cdist_backward(g.contiguous(), self.p, rows, _P[m], d.contiguous())
            return gx, gp
        if m == "dot":
            return self.p.T @ g, g @ xt.T
        if m == "cosine":
            nx = row_norms(xt, dim=0)[0]
            xn = unit_rows(xt, dim=0)
            gx = _unit_grad(xn, nx, -(self.unit.T @ g), dim=0)
            # the bank's projection is linear: it is applied once, after the last tile
            return gx, -(g @ xn.T)
        # d = ||x - p||^2: gradient 2 (x - p) g per pair; d = ||x - p||: (x - p) g / d, and 0
        # where d = 0 (the subgradient that keeps training finite)
        if m == "sqeuclidean":
            w, scale = g, 2.0
        else:
            w, scale = torch.div(g, d).masked_fill_(d == 0, 0.0), 1.0
        gx = torch.addmm(xt * w.sum(0), self.p.T, w, alpha=-1.0)
        gp = torch.addmm(self.p * w.sum(1, keepdim=True), w, xt.T, alpha=-1.0)
        return gx.mul_(scale), gp.mul_(scale)

    def finish_grad(self, gp: torch.Tensor) -> torch.Tensor:
        if self.metric == "cosine":
            return _unit_grad(self.unit, self.norm, gp, dim=1)
        return gp


_P = {"l1": 1.0, "linf": float("inf")}


@functools.cache
def _compiled_minkowski(metric: str, rows_last: bool) -> Any:
    """A torch.compile'd l1 / linf kernel. Inductor fuses the difference, absolute value and
    reduction into one loop nest vectorised across pixels, so the broadcast is never stored.
    Maps (N, D, HW) to (N, F, HW), or rows (N, HW, D) to (N, HW, F) when ``rows_last``."""

    def kernel(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if rows_last:
            diff = (x[:, :, None, :] - p[None, None, :, :]).abs()
            return diff.sum(-1) if metric == "l1" else diff.amax(-1)
        diff = (x[:, None, :, :] - p[None, :, :, None]).abs()
        return diff.sum(2) if metric == "l1" else diff.amax(2)

    return torch.compile(kernel, dynamic=True)


def _unit_grad(unit: torch.Tensor, norm: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """Gradient through the unit vector x / ||x|| given the gradient g there; exact zero vectors
    (unit 0) pass g / eps, as through x / max(||x||, eps)."""
    full = norm > 0
    proj = torch.where(full, (unit * g).sum(dim), 0.0)
    return (g - unit * proj.unsqueeze(dim)) / torch.where(full, norm, _EPS).unsqueeze(dim)


def _column_tile(budget: int, f: int, d: int, item: int, minkowski: bool) -> int:
    """Pixels per tile. The l1 / linf backward holds torch's (pixels, F, D) buffer (pass
    ``minkowski=True`` for it); the rest hold a few (F, pixels) blocks and copies of the
    pixels' features."""
    per_col = f * 4 * item + 4 * d * item + (f * d * item if minkowski else 0)
    fixed = 4 * f * d * item  # the prepared bank, its centred or unit copy, the bank's gradient
    return chunk_rows(budget, per_col, f"one tile of F={f}, D={d}", fixed=fixed)


class _PairwiseDistance(torch.autograd.Function):
    """Tiled forward written into the output; tiled closed-form backward from the output."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        p: torch.Tensor,
        metric: str,
        dtype: torch.dtype,
        cols: int,
        cols_backward: int,
        compiled: bool,
    ) -> torch.Tensor:
        n, d, h, w = x.shape
        f, hw = p.shape[0], h * w
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        bank = _Bank(p, metric, dtype)
        x3 = x.detach().flatten(2)  # (N, D, HW): a view for NCHW and channels_last alike
        if compiled and metric in _P and x.dtype == dtype:
            # the fused kernel holds nothing but its output: no tiling needed
            kernel = _compiled_minkowski(metric, channels_last)
            buf = kernel(x3.transpose(1, 2) if channels_last else x3, bank.p)
        elif metric in _P and cols >= hw and x.dtype == dtype:
            # whole maps fit: one batched kernel call writes the output in x's layout directly
            rows = x3.transpose(1, 2).contiguous()  # (N, HW, D): a view already if channels_last
            bank_n = bank.p.expand(n, f, d).contiguous()
            buf = torch.ops.aten._cdist_forward(
                *((rows, bank_n) if channels_last else (bank_n, rows)), _P[metric], None
            )
        else:
            # the output is laid out like x: NCHW, or channels_last as a (N, HW, F) buffer
            buf = torch.empty((n, hw, f) if channels_last else (n, f, hw), dtype=x.dtype, device=x.device)
            out = buf.transpose(1, 2) if channels_last else buf
            for i in range(n):
                for s in range(0, hw, cols):
                    o = out[i, :, s : s + cols]
                    direct = o.dtype == dtype and o.is_contiguous()
                    tile = o if direct else torch.empty(o.shape, dtype=dtype, device=x.device)
                    bank.forward_tile(x3[i, :, s : s + cols].to(dtype), tile)
                    if not direct:
                        o.copy_(tile)
        result = (buf.transpose(1, 2) if channels_last else buf).view(n, f, h, w)
        ctx.save_for_backward(x, p, result)
        ctx.settings = (metric, dtype, cols_backward)
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, p, result = ctx.saved_tensors
        metric, dtype, cols = ctx.settings
        n, d, h, w = x.shape
        x3, g3, d3 = x.flatten(2), grad.flatten(2), result.flatten(2)
        bank = _Bank(p, metric, dtype)
        gx = torch.empty((n, d, h * w), dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        gp = torch.zeros(p.shape, dtype=dtype, device=p.device)
        for i in range(n):
            for s in range(0, h * w, cols):
                part = slice(s, s + cols)
                tx, tp = bank.backward_tile(
                    x3[i, :, part].to(dtype), g3[i, :, part].to(dtype), d3[i, :, part].to(dtype)
                )
                if gx is not None:
                    gx[i, :, part] = tx
                gp += tp
        gx = None if gx is None else gx.view(n, d, h, w)
        gp = bank.finish_grad(gp).to(p.dtype) if ctx.needs_input_grad[1] else None
        return gx, gp, None, None, None, None, None


def pairwise_distance(
    x: Any,
    prototypes: Any,
    metric: str = "l2",
    *,
    memory: int | str | None = None,
    check_finite: bool = True,
    compile: bool = False,
) -> torch.Tensor:
    """Distance from every pixel of `x` to every prototype, without the broadcast.

    Parameters
    ----------
    x : Tensor or ndarray of shape (N, D, H, W)
        Feature maps, NCHW or channels_last, float16, bfloat16, float32 or float64.
    prototypes : Tensor or ndarray of shape (F, D) or (F, D, 1, 1)
        The bank (a 1x1 convolution's weight works as is).
    metric : {"l2", "sqeuclidean", "l1", "linf", "cosine", "dot"}, default="l2"
        Euclidean, squared Euclidean, Manhattan, Chebyshev, cosine distance 1 - cos (zero
        vectors have cos 0), or the dot product (a similarity: larger is nearer).
    memory : int or str, optional
        Cap on the working memory beyond inputs and output (tiles of the forward and backward
        pass). None: as in :func:`densematch.match`.
    check_finite : bool, default=True
        Raise on NaN or Inf. Switch off in training loops: on a GPU the check syncs.
    compile : bool, default=False
        For l1 and linf on float32 / float64 inputs, run the forward pass through a kernel built
        by ``torch.compile`` (fused, vectorised across pixels: 2.6x faster than torch.cdist's on
        the benchmark CPU). The first call in a process compiles (seconds) and needs a C++
        compiler on a CPU, Triton on a GPU. Other metrics ignore it.

    Returns
    -------
    Tensor of shape (N, F, H, W)
        In x's dtype (computed in float32, or float64 for float64 inputs), laid out like x.
        Differentiable with respect to x and prototypes (first order).

    Notes
    -----
    l2 goes through ||x - c||^2 - 2 (x - c).(p - c) + ||p - c||^2 with c the prototypes' mean,
    clamped at 0; its gradient at distance 0 is 0. Under autocast the computation stays in
    float32. A float16 output can still overflow where the distance itself exceeds 65504.

    Examples
    --------
    >>> x = torch.randn(2, 8, 5, 7)
    >>> pairwise_distance(x, torch.randn(3, 8)).shape
    torch.Size([2, 3, 5, 7])
    """
    x, p, dtype = _check_inputs(x, prototypes, metric, check_finite)
    budget = resolve_memory(memory, x.device)
    item = torch.finfo(dtype).bits // 8
    hw = x.shape[2] * x.shape[3]
    cols = min(_column_tile(budget, p.shape[0], p.shape[1], item, False), hw)
    cols_backward = min(_column_tile(budget, p.shape[0], p.shape[1], item, metric in ("l1", "linf")), hw)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _PairwiseDistance.apply(x, p, metric, dtype, cols, cols_backward, bool(compile))


def _pair_distance(xr: torch.Tensor, pr: torch.Tensor, metric: str) -> torch.Tensor:
    """Distances of matched row pairs (..., D), computed directly, differentiable."""
    value = get_metric(metric).pair_value(xr, pr)
    return 1.0 - value if metric == "cosine" else value


def nearest_prototype(
    x: Any,
    prototypes: Any,
    metric: str = "l2",
    *,
    k: int = 1,
    memory: int | str | None = None,
    check_finite: bool = True,
    precision: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` nearest prototypes of every pixel, without building the (N, F, H, W) tensor.

    Parameters
    ----------
    x : Tensor or ndarray of shape (N, D, H, W)
    prototypes : Tensor or ndarray of shape (F, D) or (F, D, 1, 1)
    metric : {"l2", "sqeuclidean", "l1", "linf", "cosine", "dot"}, default="l2"
        As in :func:`pairwise_distance`; for "dot" the nearest is the largest.
    k : int, default=1
        1 <= k <= F.
    memory : int or str, optional
        Cap on working memory, as in :func:`densematch.match`.
    check_finite : bool, default=True
        Raise on NaN or Inf.
    precision : {"exact", "float32", "fast"}, default="exact"
        How the search ranks, as in :func:`densematch.match` ("exact" equals "float32" up to
        ties; "fast" is approximate). Float64 inputs are searched in float64 whatever this says.
        The returned distances are always recomputed directly in the compute dtype.

    Returns
    -------
    distance : Tensor of shape (N, H, W), or (N, k, H, W) for k > 1
        Recomputed directly from each pixel and its prototype (no expansion error), in the
        compute dtype (float32, or float64 for float64 inputs). Differentiable with respect to
        x and prototypes when they require grad.
    index : Tensor of int64, same shape
        The prototypes, nearest first; ties go to the lower index.

    Examples
    --------
    >>> x = torch.randn(2, 8, 5, 7)
    >>> d, i = nearest_prototype(x, torch.randn(16, 8), k=3)
    >>> d.shape, i.shape
    (torch.Size([2, 3, 5, 7]), torch.Size([2, 3, 5, 7]))
    """
    x, p, dtype = _check_inputs(x, prototypes, metric, check_finite)
    check_choice(precision, "precision", RANKINGS)
    prec = resolve_precision(precision, x.device, metric, x.shape[1], float64=dtype == torch.float64)
    n, _d, h, w = x.shape
    k = check_int(k, "k", 1, p.shape[0])
    budget = resolve_memory(memory, x.device)
    index = torch.empty((n, h * w, k), dtype=torch.int64, device=x.device)
    value = torch.empty((n, h * w, k), dtype=dtype, device=x.device)
    pd = p.detach()
    with torch.autocast(device_type=x.device.type, enabled=False):
        for i in range(n):
            rows = x[i].detach().flatten(1).T  # (HW, D), a view
            v, idx = engine.topk(
                rows, pd, metric=metric, k=k, budget=budget, dtype=dtype, half=prec.half, certify=prec.certify
            )
            index[i], value[i] = idx, v
        if metric == "cosine":
            value = 1.0 - value
        if torch.is_grad_enabled() and (x.requires_grad or p.requires_grad):
            # the chosen pairs again, with autograd: (N, HW, k, D) gathered rows, never (.., F, ..)
            xr = x.flatten(2).transpose(1, 2).to(dtype)[:, :, None, :]
            value = _pair_distance(xr, p.to(dtype)[index], metric)
    index = index.permute(0, 2, 1).reshape(n, k, h, w)
    value = value.permute(0, 2, 1).reshape(n, k, h, w)
    if k == 1:
        return value[:, 0], index[:, 0]
    return value, index


class PrototypeDistance(nn.Module):
    """A learnable bank of prototypes; ``forward(x)`` gives :func:`pairwise_distance`.

    Parameters
    ----------
    num_prototypes, dim : int
        F and D.
    metric : str, default="l2"
    memory : int or str, optional
    check_finite : bool, default=False
        Off by default: a training loop should not sync the GPU on every step.
    compile : bool, default=False
        Use the torch.compile'd l1 / linf forward kernel (see :func:`pairwise_distance`).

    Examples
    --------
    >>> layer = PrototypeDistance(10, 8, metric="l1")
    >>> layer(torch.randn(2, 8, 4, 4)).shape
    torch.Size([2, 10, 4, 4])
    >>> layer.nearest(torch.randn(2, 8, 4, 4))[1].shape
    torch.Size([2, 4, 4])
    """

    def __init__(
        self,
        num_prototypes: int,
        dim: int,
        metric: str = "l2",
        *,
        memory: int | str | None = None,
        check_finite: bool = False,
        compile: bool = False,
    ) -> None:
        super().__init__()
        check_int(num_prototypes, "num_prototypes", 1)
        check_int(dim, "dim", 1)
        get_metric(metric)
        self.metric, self.memory, self.check_finite = metric, memory, check_finite
        self.compiled = compile  # not self.compile: that is nn.Module's own method
        self.prototypes = nn.Parameter(torch.randn(num_prototypes, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pairwise_distance(
            x, self.prototypes, self.metric, memory=self.memory, check_finite=self.check_finite, compile=self.compiled
        )

    def nearest(self, x: torch.Tensor, k: int = 1, precision: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest prototypes of every pixel (see :func:`nearest_prototype`)."""
        return nearest_prototype(
            x,
            self.prototypes,
            self.metric,
            k=k,
            memory=self.memory,
            check_finite=self.check_finite,
            precision=precision,
        )

    def extra_repr(self) -> str:
        f, d = self.prototypes.shape
        return f"num_prototypes={f}, dim={d}, metric={self.metric!r}"
