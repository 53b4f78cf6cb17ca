"""Distances from every pixel of a batch of feature maps to a bank of prototypes.

``pairwise_distance`` returns the full (N, F, H, W) tensor and ``nearest_prototype`` only the k
nearest, never building that tensor. Neither ever builds the (N*H*W, F, D) broadcast: matrix
metrics go through one matrix product per tile, l1 / linf through densematch's C kernels on a CPU
(:mod:`densematch.kernels.native`) or ``torch.cdist``'s kernels by tiles of bounded size
(``torch.cdist``'s own backward allocates that broadcast). Both are differentiable; the backward
pass recomputes tiles instead of keeping them. Tiles run on worker threads on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import checks, engine
from .._oprules import differentiable, looped, operator, recording, refuse_legacy_onnx
from ..checks import as_tensor, check_bool, check_choice, check_finite, check_int, compute_dtype, options_by_keyword
from ..choices import MetricName, PrecisionName
from ..config import kernel_setting, resolve_memory
from ..metrics import Metric, get_metric
from ..precision import RANKINGS, Precision, resolve_precision
from ..threads import own_thread
from . import tiles

__all__ = ["Nearest", "PrototypeDistance", "nearest_prototype", "pairwise_distance"]


class Nearest(NamedTuple):
    """The nearest prototypes of every pixel (:func:`nearest_prototype`) or bank rows of every
    query (:func:`densematch.knn`, :meth:`densematch.KNNIndex.search`), nearest first. A tuple
    of two, named as ``torch.topk``'s are: ``d, i = nearest_prototype(...)`` unpacks it.

    Attributes
    ----------
    values : Tensor
        The distances, recomputed directly from each pair (differentiable where the inputs
        require grad); for "dot", the products (larger is nearer).
    indices : Tensor of int64, shaped like ``values``
        The prototypes or bank rows; ties go to the lower index.
    """

    values: torch.Tensor
    indices: torch.Tensor


@dataclass(frozen=True)
class NearestTask:
    """A validated nearest-prototype search (:func:`nearest_task`): the pixels ``x``
    (N, D, H, W), the ``prototypes`` (F, D), the metric, the resolved precision, k and the
    working-memory budget in bytes."""

    x: torch.Tensor
    prototypes: torch.Tensor
    metric: Metric
    precision: Precision
    k: int
    budget: int


def _check_inputs(
    x: Any, prototypes: Any, metric: str, finite: bool, *, empty: bool = False, empty_x: bool = False
) -> tuple[torch.Tensor, torch.Tensor, Metric, torch.dtype]:
    """Validated x (N, D, H, W), prototypes as (F, D), the metric, and the compute dtype
    (``empty``: a bank without rows is allowed, as one rank's slice of a sharded bank may be;
    ``empty_x``: so is an x without pixels)."""
    m = get_metric(metric)
    finite = check_bool(finite, "check_finite")
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
    if p.shape[0] == 0 and not empty:
        raise ValueError(f"prototypes must hold at least one prototype (F >= 1), got {tuple(p.shape)}")
    if p.shape[1] != x.shape[1]:
        raise ValueError(f"prototypes must have D={x.shape[1]} features like x (N, D, H, W), got D={p.shape[1]}")
    if x.numel() == 0 and not (empty_x and x.shape[1] > 0):
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    if p.device != x.device:
        raise ValueError(f"x and prototypes must be on one device, got {x.device} and {p.device}")
    if finite:
        check_finite(x.detach(), "x")
        check_finite(p.detach(), "prototypes")
    dtype = compute_dtype(x, p)
    return x, p, m, dtype


# densematch::pairwise_distance: the distances as one PyTorch operator, so that torch.compile,
# torch.export, torch.jit.trace and torch.func see one node with a known output (its fake
# kernel) instead of Python that tiles and calls C. Settings arrive as arguments.
@operator(
    "densematch::pairwise_distance",
    schema="(Tensor x, Tensor prototypes, str metric, int budget, bool use_c, bool compiled, "
    "bool check_finite) -> Tensor",
)
def _distance_op(
    x: torch.Tensor, prototypes: torch.Tensor, metric: str, budget: int, use_c: bool, compiled: bool, check_finite: bool
) -> torch.Tensor:
    if check_finite:
        checks.check_finite(x, "x")
        checks.check_finite(prototypes, "prototypes")
    return tiles.forward(x, prototypes, get_metric(metric), budget, use_c, compiled)


@_distance_op.register_fake
def _distance_fake(
    x: torch.Tensor, prototypes: torch.Tensor, metric: str, budget: int, use_c: bool, compiled: bool, check_finite: bool
) -> torch.Tensor:
    n, _d, h, w = x.shape
    f = prototypes.shape[0]
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return x.new_empty((n, h, w, f)).permute(0, 3, 1, 2)
    return x.new_empty((n, f, h, w))


@operator(
    "densematch::pairwise_distance_backward",
    schema="(Tensor grad, Tensor x, Tensor prototypes, Tensor result, str metric, int budget, bool use_c, "
    "bool need_x) -> (Tensor, Tensor)",
)
def _distance_backward_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    prototypes: torch.Tensor,
    result: torch.Tensor,
    metric: str,
    budget: int,
    use_c: bool,
    need_x: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    gx, gp = tiles.backward(grad, x, prototypes, result, get_metric(metric), budget, use_c, need_x)
    return (x.new_empty(0) if gx is None else gx), gp


@_distance_backward_op.register_fake
def _distance_backward_fake(
    grad: torch.Tensor,
    x: torch.Tensor,
    prototypes: torch.Tensor,
    result: torch.Tensor,
    metric: str,
    budget: int,
    use_c: bool,
    need_x: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty(0)), torch.empty_like(
        prototypes
    )


def _distance_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, p, metric, budget, use_c, _compiled, _finite = inputs
    ctx.save_for_backward(x, p, output)
    ctx.settings = (metric, budget, use_c)


def _gradients(ctx: Any, grads: tuple[torch.Tensor], backward: Any) -> tuple[torch.Tensor | None, ...]:
    """The op's input gradients from ``backward``, called as the backward op is."""
    x, p, result = ctx.saved_tensors
    metric, budget, use_c = ctx.settings
    need_x, need_p = ctx.needs_input_grad[:2]
    gx, gp = backward(grads[0], x, p, result, metric, budget, use_c, need_x)
    return (gx if need_x else None), (gp if need_p else None), None, None, None, None, None


_Distance = differentiable(_distance_op, _distance_backward_op, _distance_setup, _gradients, "pairwise_distance")


def _distance_vmap(info: Any, in_dims: tuple[int | None, ...], x: torch.Tensor, p: torch.Tensor, *rest: Any) -> Any:
    if in_dims[0] is not None and in_dims[1] is None:
        # maps batched, one bank: the batch folds into N
        xb = x.movedim(in_dims[0], 0)
        out = _distance_op(xb.flatten(0, 1), p, *rest)
        return out.unflatten(0, xb.shape[:2]), 0
    return looped(_distance_op, (*in_dims[:2], *(None,) * len(rest)), (x, p, *rest))


def _distance_backward_vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> Any:
    return looped(_distance_backward_op, in_dims, args)


_distance_op.register_vmap(_distance_vmap)
_distance_backward_op.register_vmap(_distance_backward_vmap)


@options_by_keyword(2)
def pairwise_distance(
    x: Any,
    prototypes: Any,
    *,
    metric: MetricName = "l2",
    memory: int | str | None = None,
    check_finite: bool = True,
    compile: bool = False,
) -> torch.Tensor:
    """Distance from every pixel of `x` to every prototype, without the broadcast.

    Which options fit which job, and what each costs: docs/choosing.md.

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
        by ``torch.compile`` (fused, vectorised across pixels). The first call in a process
        compiles (seconds) and needs a C++ compiler on a CPU, Triton on a GPU. On a CPU the
        default C kernels are faster where they run (docs/distance.md); other metrics ignore it.

    Returns
    -------
    Tensor of shape (N, F, H, W)
        In x's dtype (computed in float32, or float64 for float64 inputs), laid out like x.
        Differentiable with respect to x and prototypes (first order). Empty where N, H, W or
        F is 0, as :func:`torch.cdist` gives it.

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
    finite = check_bool(check_finite, "check_finite")
    x, p, m, _dtype = _check_inputs(x, prototypes, metric, False, empty=True, empty_x=True)
    compiled = check_bool(compile, "compile")
    if x.numel() == 0 or p.shape[0] == 0:  # no pixel or no prototype: empty, as torch.cdist gives it
        tied = (x.sum() + p.sum()).to(x.dtype) * 0  # the graph's link to both inputs
        return x.new_zeros((x.shape[0], p.shape[0], *x.shape[2:])) + tied
    refuse_legacy_onnx("pairwise_distance")
    budget, use_c = resolve_memory(memory, x.device), kernel_setting() != "torch"
    with torch.autocast(device_type=x.device.type, enabled=False):
        # a recorded graph holds the op with the derivative registered on it (torch.jit.trace
        # could not save an autograd.Function); eager calls go through _Distance (torch.func's)
        apply = _distance_op if recording() else _Distance.apply
        out: torch.Tensor = apply(x, p, m.name, budget, use_c, compiled, finite)  # type: ignore[no-untyped-call]
        return out


@options_by_keyword(2)
def nearest_prototype(
    x: Any,
    prototypes: Any,
    *,
    metric: MetricName = "l2",
    k: int = 1,
    memory: int | str | None = None,
    check_finite: bool = True,
    precision: PrecisionName = "exact",
) -> Nearest:
    """The `k` nearest prototypes of every pixel, without building the (N, F, H, W) tensor.

    Which options fit which job, and what each costs: docs/choosing.md.

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
    Nearest
        ``values``: Tensor of shape (N, H, W), or (N, k, H, W) for k > 1, recomputed directly
        from each pixel and its prototype (no expansion error), in the compute dtype (float32,
        or float64 for float64 inputs), differentiable with respect to x and prototypes when
        they require grad. ``indices``: int64, same shape, the prototypes, nearest first; ties go
        to the lower index. A named tuple: ``d, i = nearest_prototype(...)`` still unpacks it.

    Examples
    --------
    >>> x = torch.randn(2, 8, 5, 7)
    >>> d, i = nearest_prototype(x, torch.randn(16, 8), k=3)
    >>> d.shape, i.shape
    (torch.Size([2, 3, 5, 7]), torch.Size([2, 3, 5, 7]))
    """
    task = nearest_task(x, prototypes, metric, k, memory, check_finite, precision)
    value, index = nearest_search(task)
    return nearest_result(value, index, task.x.shape)


def nearest_values(task: NearestTask, prepared: engine.Prepared | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's top-k of the task's pixels over its prototypes: the metric's values
    (similarities for cosine and dot; NaN in empty slots) and indices (-1 there), both
    (N, HW, k), without autograd. ``prepared``: the prototypes as
    :func:`densematch.engine.prepare` made them ready."""
    x, k, prec = task.x, task.k, task.precision
    n, _d, h, w = x.shape
    index = torch.empty((n, h * w, k), dtype=torch.int64, device=x.device)
    value = torch.empty((n, h * w, k), dtype=prec.dtype, device=x.device)
    pd, m, budget = task.prototypes.detach(), task.metric, task.budget
    with torch.autocast(device_type=x.device.type, enabled=False):
        for i in range(n):
            rows = x[i].detach().flatten(1).T  # (HW, D), a view
            if prepared is None:
                found = engine.search(rows, pd, metric=m, k=k, budget=budget, precision=prec)
            else:
                found = engine.topk(rows, pd, metric=m, k=k, budget=budget, precision=prec, prepared=prepared)
            with own_thread():  # no OpenMP team woken to spin after a threaded search
                value[i], index[i] = found
    return value, index


def nearest_search(task: NearestTask, prepared: engine.Prepared | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest prototypes of the task's pixels: distances and indices of shape (N, HW, k),
    the distances recomputed with autograd where x or the prototypes require it (see
    :func:`nearest_values` for ``prepared``)."""
    value, index = nearest_values(task, prepared)
    x, p, m, dtype = task.x, task.prototypes, task.metric, task.precision.dtype
    with torch.autocast(device_type=x.device.type, enabled=False):
        if torch.is_grad_enabled() and (x.requires_grad or p.requires_grad):
            # the chosen pairs again, with autograd: (N, HW, k, D) gathered rows, never (.., F, ..)
            xr = x.flatten(2).transpose(1, 2).to(dtype)[:, :, None, :]
            value = m.pair_value(xr, p.to(dtype)[index])
    return m.distance(value), index


def nearest_task(
    x: Any,
    prototypes: Any,
    metric: str,
    k: int,
    memory: int | str | None,
    finite: bool,
    precision: str,
    *,
    bank: int | None = None,
) -> NearestTask:
    """A validated :func:`nearest_prototype` call: x, the prototypes (F, D), the metric, the
    resolved precision (float64 for float64 inputs), k and the budget. ``bank``: the size of
    the whole bank when ``prototypes`` is one slice of it (which may then be empty); ``k`` is
    checked against it."""
    x, p, m, dtype = _check_inputs(x, prototypes, metric, finite, empty=bank is not None, empty_x=True)
    check_choice(precision, "precision", RANKINGS)
    prec = resolve_precision(precision, x.device, m, float64=dtype == torch.float64)
    k = check_int(k, "k", 1, p.shape[0] if bank is None else bank)
    return NearestTask(x, p, m, prec, k, resolve_memory(memory, x.device))


def nearest_result(value: torch.Tensor, index: torch.Tensor, shape: torch.Size) -> Nearest:
    """(N, HW, k) distances and indices as :func:`nearest_prototype` returns them: (N, k, H, W),
    or (N, H, W) for k = 1."""
    n, _d, h, w = shape
    k = index.shape[-1]
    index = index.permute(0, 2, 1).reshape(n, k, h, w)
    value = value.permute(0, 2, 1).reshape(n, k, h, w)
    if k == 1:
        return Nearest(value[:, 0], index[:, 0])
    return Nearest(value, index)


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

    @options_by_keyword(3)
    def __init__(
        self,
        num_prototypes: int,
        dim: int,
        *,
        metric: MetricName = "l2",
        memory: int | str | None = None,
        check_finite: bool = False,
        compile: bool = False,
    ) -> None:
        super().__init__()
        check_int(num_prototypes, "num_prototypes", 1)
        check_int(dim, "dim", 1)
        get_metric(metric)
        self.metric, self.memory, self.check_finite = metric, memory, check_bool(check_finite, "check_finite")
        self.compiled = check_bool(compile, "compile")  # not self.compile: that is nn.Module's own method
        self.prototypes = nn.Parameter(torch.randn(num_prototypes, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pairwise_distance(
            x,
            self.prototypes,
            metric=self.metric,
            memory=self.memory,
            check_finite=self.check_finite,
            compile=self.compiled,
        )

    @options_by_keyword(2)
    def nearest(self, x: torch.Tensor, *, k: int = 1, precision: PrecisionName = "exact") -> Nearest:
        """The k nearest prototypes of every pixel (see :func:`nearest_prototype`)."""
        return nearest_prototype(
            x,
            self.prototypes,
            metric=self.metric,
            k=k,
            memory=self.memory,
            check_finite=self.check_finite,
            precision=precision,
        )

    def extra_repr(self) -> str:
        f, d = self.prototypes.shape
        return f"num_prototypes={f}, dim={d}, metric={self.metric!r}"
