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

The bound, for one query row ``a`` and one reference row ``b``, both prepared in float32, with
half-precision copies ``a'`` and ``b'``: ``a.b - a'.b' = a.(b - b') + (a - a').b'``, so by
Cauchy-Schwarz ``|a.b - a'.b'| <= |a| |b - b'| + |a - a'| |b'|``, with the residual norms measured,
not assumed. Accumulating ``a'.b'`` in float32 adds at most ``gamma |a'| |b'|``, the float32
reference is off the true value by at most ``gamma |a| |b|``. The sum is ``x_i y_j + z_i w_j + f``:
a rank-3 product of per-row terms (:func:`query_terms`, :func:`ref_terms`), cheap for every pair.
A half-precision score block (torch's products on a CPU) rounds each sum once more, by at most
``u / (1 - u)`` of the stored score.

The search: with ``e`` that bound, the float32 score of pair (i, j) lies in ``[h - e, h + e]``
around its half score ``h``. Let ``t`` be the row's k-th largest ``h - e``: at least k references
score ``>= t`` in float32, so the float32 top k all have ``h + e >= t``. Those are the candidates;
re-scored in float32, their best k are the float32 result. A per-pair bound matters for l2 and
dot, whose rows differ in norm: a low-contrast query's near neighbours have small norms, hence
small bounds, however large the bound of far-away rows.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from .budget import get_config

__all__ = ["PRECISIONS", "RANKINGS", "Precision", "query_terms", "ref_terms", "resolve_precision"]

# nearest_prototype takes these: its compute dtype follows its inputs (float64 for float64)
RANKINGS = ("exact", "float32", "fast")
PRECISIONS = (*RANKINGS, "float64")
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


def _gamma(c: int) -> float:
    n = c + 2
    return 2.0 * n * _U32 / (1.0 - n * _U32)


def query_terms(q: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """The query side of the per-pair rounding bound: (m, 3) rows ``(x, z, 1)``.

    The bound of pair (i, j) is ``query_terms[i] . ref_terms[j]``: a bound on |half score -
    float32 score| and on |half score - true score| for a half score accumulated in float32 (a
    caller that rounds the sum to half precision adds ``u / (1 - u)`` of the stored score).

    Parameters
    ----------
    q : Tensor of shape (m, C)
        Prepared query rows in float32.
    qh : Tensor of shape (m, C)
        Their half-precision copies (what the product reads).
    """
    gamma = _gamma(q.shape[1])
    qh32 = qh.to(q.dtype)
    nq = torch.linalg.vector_norm(q, dim=1)
    nqh = torch.linalg.vector_norm(qh32, dim=1)
    dq = torch.linalg.vector_norm(q - qh32, dim=1)
    x = nq * _NORM_SLACK
    z = (dq + nqh * gamma) * _NORM_SLACK
    return torch.stack([x, z, torch.ones_like(x)], dim=1)


def ref_terms(r: torch.Tensor, rh: torch.Tensor) -> torch.Tensor:
    """The reference side of the per-pair rounding bound: (n, 3) rows ``(y, w, flush)`` of
    prepared float32 rows ``r`` and their half copies ``rh``."""
    gamma = _gamma(r.shape[1])
    rh32 = rh.to(r.dtype)
    y = torch.linalg.vector_norm(r - rh32, dim=1) + gamma * torch.linalg.vector_norm(r, dim=1)
    w = torch.linalg.vector_norm(rh32, dim=1)
    return torch.stack([y, w, torch.full_like(y, _FLUSH * (r.shape[1] + 2))], dim=1)


def _half_candidates(device: torch.device, metric: str) -> tuple[torch.dtype, ...]:
    """Half dtypes safe for this metric: float16's range (65504) only holds unit rows."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (torch.float16,) if metric == "cosine" else ()
    return (torch.bfloat16, torch.float16) if metric == "cosine" else (torch.bfloat16,)


@functools.cache
def _product_seconds(device: str, dtype: torch.dtype, c: int) -> float:
    """Best of four: one (1024 x c) @ (c x 512) product into a reused block and its row maxima,
    the work of one tile of the engine (a half-precision block is slower to reduce on a CPU)."""
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
        torch.mm(a, b.T, out=out).amax(1)
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
        # exact pays for the bound, the candidate pool and re-scoring (on this project's CPU,
        # from a third of the half product's time at C=384 to 1.5 times it at C=64): only
        # worth it with a clear margin
        half = fastest_half(device, metric, c, margin=1.5 if precision == "exact" else 1.1)
    return Precision(precision, torch.float32, half, certify=precision == "exact")
