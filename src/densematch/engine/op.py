"""The engine's top-k as one PyTorch operator, ``densematch::topk``.

torch.compile, torch.export, torch.jit.trace and FakeTensorMode see a single node whose output
shapes its fake kernel gives, instead of Python that plans tiles, starts threads and calls C.
The search's settings (metric, k, budget, precision) are the op's arguments: the caller resolves
them once at the public boundary. The search has no derivative: callers recompute the chosen
pairs' values with autograd where they need one.
"""

from __future__ import annotations

import torch

from .._oprules import call, looped, operator, refuse_legacy_onnx
from ..metrics import Metric
from ..precision import HALF_DTYPES, Precision
from .driver import topk

__all__ = ["search"]

_HALF_NAMES = {dtype: name for name, dtype in HALF_DTYPES.items()}


@operator(
    "densematch::topk",
    schema="(Tensor a, Tensor b, str metric, int k, int budget, str precision, ScalarType dtype, str half, "
    "bool certify, str backend, int? candidates, Tensor? rows_a, Tensor? rows_b, int reserved) -> (Tensor, Tensor)",
)
def _topk_op(
    a: torch.Tensor,
    b: torch.Tensor,
    metric: str,
    k: int,
    budget: int,
    precision: str,
    dtype: torch.dtype,
    half: str,
    certify: bool,
    backend: str,
    candidates: int | None,
    rows_a: torch.Tensor | None,
    rows_b: torch.Tensor | None,
    reserved: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    prec = Precision(precision, dtype, HALF_DTYPES[half] if half else None, certify, backend, candidates)
    return topk(
        a, b, metric=metric, k=k, budget=budget, precision=prec, rows_a=rows_a, rows_b=rows_b, reserved=reserved
    )


@_topk_op.register_fake
def _topk_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    metric: str,
    k: int,
    budget: int,
    precision: str,
    dtype: torch.dtype,
    half: str,
    certify: bool,
    backend: str,
    candidates: int | None,
    rows_a: torch.Tensor | None,
    rows_b: torch.Tensor | None,
    reserved: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    na = a.shape[0] if rows_a is None else rows_a.shape[0]
    return a.new_empty((na, k), dtype=dtype), a.new_empty((na, k), dtype=torch.int64)


def _topk_vmap(info: object, in_dims: tuple[int | None, ...], *args: object) -> tuple[object, object]:
    return looped(_topk_op, in_dims, args)


_topk_op.register_vmap(_topk_vmap)


def search(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    metric: Metric,
    k: int,
    budget: int,
    precision: Precision,
    rows_a: torch.Tensor | None = None,
    rows_b: torch.Tensor | None = None,
    reserved: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`densematch.engine.topk` through the ``densematch::topk`` operator: the same
    values and indices, (na, k), from one node that transformations can record. Inputs are
    detached (the search has no derivative)."""
    refuse_legacy_onnx("densematch's top-k search")
    half = "" if precision.half is None else _HALF_NAMES[precision.half]
    args = (a.detach(), b.detach(), metric.name, k, budget, precision.name, precision.dtype, half, precision.certify)
    return call(_topk_op, *args, precision.backend, precision.candidates, rows_a, rows_b, reserved)
