"""Precisions, and the certificate that makes half-precision candidate search exact.

- ``"float32"``: scores accumulate in float32 from float32 operands. The reference.
- ``"float64"``: the same in float64.
- ``"exact"``: results equal to ``"float32"`` (ties aside). Where the device multiplies half
  precision faster than float32, candidates are searched in half precision, every candidate
  within a rigorous rounding bound of a row's k-th best is kept and re-scored in float32; a row
  with more candidates than fit is searched again in float32. Elsewhere, plain float32.
- ``"fast"``: scores in the fastest operand dtype the device has, with no re-scoring of the
  ranking (reported values are still recomputed in float32). Approximate: see docs/precision.md
  for its measured disagreement rate.

The bound (one row ``a`` against every reference ``b``, both already prepared in float32, with
half-precision copies ``a'`` and ``b'``): ``a.b - a'.b' = a.(b - b') + (a - a').b'``, so by
Cauchy-Schwarz ``|a.b - a'.b'| <= |a| |b - b'| + |a - a'| |b'|``, with the residual norms measured,
not assumed. Accumulating ``a'.b'`` in float32 adds at most ``gamma |a'| |b'|``, the float32
reference itself is off the true value by at most ``gamma |a| |b|``, and a half-precision score
block (torch's CPU products) adds one more rounding of the output. Taking each reference term at
its maximum over the references gives one bound ``e`` per row, and every reference whose float32
score reaches the row's float32 k-th best has a half score within ``2 e`` of the half k-th best.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from .budget import get_config

__all__ = ["PRECISIONS", "Precision", "RefNorms", "resolve_precision", "row_bounds"]

PRECISIONS = ("exact", "float32", "fast", "float64")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# Unit roundoff of float32; gamma for n terms is n * u / (1 - n * u), doubled here because fused
# dot-product instructions may round twice per pair of products.
_U32 = 2.0**-24
# Relative slack for the float32 rounding of the norms that enter the bound, and an absolute
# term for products flushed to zero (denormals), both far below any score difference that matters.
_NORM_SLACK = 1.0 + 2.0**-12
_FLUSH = 2.0**-110


@dataclass(frozen=True)
class Precision:
    """What a precision resolved to on one device.

    Attributes
    ----------
    name : str
        The public name it came from.
    dtype : torch.dtype
        Accumulation and reported dtype (float32 or float64).
    half : torch.dtype or None
        Operand dtype of the candidate search; None to score in ``dtype``.
    certify : bool
        Re-score every candidate inside the rounding bound (``"exact"``); False for ``"fast"``.
    """

    name: str
    dtype: torch.dtype
    half: torch.dtype | None = None
    certify: bool = True


def unit_roundoff(dtype: torch.dtype) -> float:
    """2^-(significand bits): 2^-8 for bfloat16, 2^-11 for float16, 2^-24 for float32."""
    return float(torch.finfo(dtype).eps) / 2.0


@dataclass(frozen=True)
class RefNorms:
    """Maxima over the references that the bound needs: |b|, |b'| and |b - b'|."""

    ref: float
    half: float
    residual: float

    @staticmethod
    def of(r: torch.Tensor, half: torch.dtype) -> RefNorms:
        """Norms of prepared float32 rows ``r`` (n, C) and of their ``half`` copies."""
        rh = r.to(half).to(r.dtype)
        return RefNorms(
            float(torch.linalg.vector_norm(r, dim=1).max()),
            float(torch.linalg.vector_norm(rh, dim=1).max()),
            float(torch.linalg.vector_norm(r - rh, dim=1).max()),
        )

    def merge(self, other: RefNorms) -> RefNorms:
        return RefNorms(max(self.ref, other.ref), max(self.half, other.half), max(self.residual, other.residual))


def row_bounds(q: torch.Tensor, qh: torch.Tensor, refs: RefNorms, *, out_dtype: torch.dtype | None) -> torch.Tensor:
    """Per query row, a bound ``e`` on |half score - float32 score| over every reference.

    Parameters
    ----------
    q : Tensor of shape (m, C)
        Prepared query rows in float32.
    qh : Tensor of shape (m, C)
        Their half-precision copies (what the product reads).
    refs : RefNorms
        Maxima over the prepared references.
    out_dtype : torch.dtype or None
        The dtype the half score is stored in when it is rounded after accumulation (torch's
        half-precision products return half precision); None when it stays in float32.

    Returns
    -------
    Tensor of shape (m,), float32.
    """
    n = q.shape[1] + 2
    gamma = 2.0 * n * _U32 / (1.0 - n * _U32)
    nq = torch.linalg.vector_norm(q, dim=1)
    qh32 = qh.to(q.dtype)
    nqh = torch.linalg.vector_norm(qh32, dim=1)
    dq = torch.linalg.vector_norm(q - qh32, dim=1)
    e = nq * refs.residual + dq * refs.half + gamma * (nqh * refs.half + nq * refs.ref)
    if out_dtype is not None:
        e = e + unit_roundoff(out_dtype) * (1.0 + gamma) * nqh * refs.half
    return e.mul_(_NORM_SLACK).add_(_FLUSH * n)


def _half_candidates(device: torch.device, metric: str) -> tuple[torch.dtype, ...]:
    """Half dtypes safe for this metric: float16's range (65504) only holds unit rows."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (torch.float16,) if metric == "cosine" else ()
    return (torch.bfloat16, torch.float16) if metric == "cosine" else (torch.bfloat16,)


@functools.cache
def _product_seconds(device: str, dtype: torch.dtype, c: int) -> float:
    """Best of three: one (1024 x c) @ (c x 512) product into a reused block, like a tile."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(1024, c, generator=g, device=dev).to(dtype)
    b = torch.randn(512, c, generator=g, device=dev).to(dtype)
    out = torch.empty(1024, 512, dtype=dtype, device=dev)
    best = float("inf")
    for _ in range(4):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        torch.mm(a, b.T, out=out)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t)
    return best


def fastest_half(device: torch.device, metric: str, c: int, *, margin: float) -> torch.dtype | None:
    """The half dtype whose products beat float32 by ``margin`` (a speed ratio) on this device,
    or None. GPUs have tensor cores: half wins there without measuring. On a CPU it is measured
    once per process and width (rounded up to a power of two): many CPUs without AMX multiply
    bfloat16 at half the float32 rate."""
    choices = _half_candidates(device, metric)
    if not choices:
        return None
    if device.type == "cuda":
        return choices[-1]  # float16 for unit rows (8x tighter bound), else bfloat16
    width = 1 << max(4, (c - 1).bit_length())
    key = str(device)
    base = _product_seconds(key, torch.float32, width)
    timed = {dt: _product_seconds(key, dt, width) for dt in choices}
    best = min(timed, key=timed.__getitem__)
    return best if timed[best] * margin < base else None


def resolve_precision(precision: str, device: torch.device, metric: str, c: int, *, float64: bool = False) -> Precision:
    """Turn a public precision name into a :class:`Precision` for this device and metric.

    ``config_context(half=...)`` overrides the measured choice: ``"bfloat16"`` or ``"float16"``
    force that operand dtype for ``"exact"`` and ``"fast"``, ``"off"`` never uses half precision.
    l1 and linf have no product to speed up: they always score in float32 (or float64).
    """
    if precision == "float64" or float64:
        return Precision(precision, torch.float64)
    if precision == "float32" or metric in ("l1", "linf"):
        return Precision(precision, torch.float32)
    setting = get_config()["half"]
    if setting == "off":
        half = None
    elif setting in HALF_DTYPES:
        half = HALF_DTYPES[setting]
    else:
        # exact pays for candidate selection and re-scoring: only worth it with a clear margin
        half = fastest_half(device, metric, c, margin=1.25 if precision == "exact" else 1.0)
    return Precision(precision, torch.float32, half, certify=precision == "exact")
