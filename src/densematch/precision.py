"""Precisions, and the certificate that makes half-precision candidate search exact.

- ``"float32"``: scores accumulate in float32 from float32 operands. The reference.
- ``"float64"``: the same in float64.
- ``"exact"``: results equal to ``"float32"`` (ties aside). Where the device multiplies half
  precision faster than float32 (GPUs with tensor cores, CPUs with AMX, AMD CPUs with
  AVX-512 BF16: :func:`device_half`),
  candidates are searched in half precision, every candidate within a rigorous rounding bound
  of a row's k-th best is kept and re-scored in float32; a row with more candidates than fit is
  searched again from float32 products, its near-ties settled as float32's are. Elsewhere,
  plain float32.
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

References
----------
- N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM, 2002, chapter
  3: ``gamma_n = n u / (1 - n u)``, the bound on an inner product of n terms accumulated in a
  precision of unit roundoff u (:func:`unit_roundoff`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._oprules import read_once
from .config import KERNEL_SETTINGS, half_setting, kernel_setting
from .metrics import Metric, get_metric

__all__ = [
    "FLOAT32",
    "PRECISIONS",
    "RANKINGS",
    "Precision",
    "cross_terms",
    "group_centres",
    "group_norms",
    "group_terms",
    "product_slack",
    "query_terms",
    "ref_terms",
    "resolve_precision",
    "row_norms",
]

# nearest_prototype takes these: its compute dtype follows its inputs (float64 for float64)
RANKINGS = ("exact", "float32", "fast")
PRECISIONS = (*RANKINGS, "float64")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Candidates listed per row during the scan (at least 8 k) by the certified half-precision search
# and by the float32 search's near-tie settling: enough for the near-ties of real features. A row
# with more is searched again or resolved after the scan without any cap, so the cap changes the
# cost, never the answer. docs/precision.md.
CANDIDATES = 32
# With the default, the cap grows with the references: a row over it costs 1.7-2 float32 product
# rows where many are (nb products at matrix-product speed, then float32's own settling), several
# where a handful are (one more pass per query tile), a listed candidate at most one direct score
# (tens of times a product's cost per value on a CPU; most are dropped unscored as the floor rises),
# so up to about nb / 16 candidates are cheaper to keep than the row is to search again (same-scene
# features at C >= 256: benchmarks/history/2026-12-07-issue-39-the-certificate-s-cap-on-an-avx2-cpu.md).
# Capped at 256 below C=256: at C=64 (9216 references) 512 halved l2's rows over the cap and saved
# nothing. From C=256, where a row searched again costs four times the products of C=64 and a
# candidate about what it did, at 512: 80x80x256 l2 at 400 (nb / 16) sent no row over against
# 2.3-3.0% at 256, and the certificate cost 5-20% less (AVX2 EPYC, two sessions:
# benchmarks/history/2026-12-07-issue-39-the-certified-c-step-s-chunk-test-and-the-cap-from-c-256.md).
_CANDIDATES_PER_REFERENCE = 1 / 16
_MOST_CANDIDATES = 256
_MORE_CANDIDATES_FROM = 256  # channels

# Unit roundoff of float32; gamma for n terms is n * u / (1 - n * u), doubled here because fused
# dot-product instructions may round twice per pair of products.
_U32 = 2.0**-24
# Relative slack for the float32 rounding of the norms that enter the bound, and an absolute
# term for products flushed to zero (denormals), both far below any score difference that matters.
_NORM_SLACK = 1.0 + 2.0**-12
_FLUSH = 2.0**-110


@dataclass(frozen=True)
class Precision:
    """How a search ranks: made once from ``precision=`` and the config at the public boundary
    (:func:`resolve_precision`) and passed whole to the engine, which reads no global setting.

    Attributes
    ----------
    name : str
        The public name it came from.
    dtype : torch.dtype
        Accumulation and reported dtype (float32 or float64).
    half : torch.dtype or None
        Operand dtype of the candidate search (bfloat16 or float16, with ``dtype`` float32, for
        matrix metrics); None to score in ``dtype``.
    certify : bool
        With ``half``: keep every candidate inside the rounding bound and re-score it
        (``"exact"``); False ranks by the half scores (``"fast"``). Without ``half``, for matrix
        metrics: settle near-ties by the direct form, so exact ties go to the lowest index.
    backend : {"auto", "torch", "triton"}
        "triton" runs the fused kernel of :mod:`densematch.kernels` (on a CPU only under
        TRITON_INTERPRET=1); "auto" chooses it on CUDA devices when Triton is installed and the
        search fits it; "torch" never does.
    candidates : int, optional
        Candidates kept per row: the cap is ``max(candidates, 8 k)``. None (the default) lets
        it grow with the number of references ``nb`` and their channels ``C``: ``max(32, 8 k,
        min(nb / 16, 256))``, with 512 in place of 256 from C=256.

    Examples
    --------
    >>> Precision("fast", half=torch.bfloat16, certify=False)
    Precision(name='fast', dtype=torch.float32, half=torch.bfloat16, certify=False, backend='auto', candidates=None)
    """

    name: str = "float32"
    dtype: torch.dtype = torch.float32
    half: torch.dtype | None = None
    certify: bool = True
    backend: str = "auto"
    candidates: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {self.dtype}")
        if self.half is not None and (self.half not in HALF_DTYPES.values() or self.dtype != torch.float32):
            raise ValueError(f"half must be torch.bfloat16 or torch.float16 with dtype float32, got {self.half}")
        if not isinstance(self.certify, bool):
            raise TypeError(f"certify must be True or False, got {self.certify!r}")
        if self.backend not in KERNEL_SETTINGS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, KERNEL_SETTINGS))}, got {self.backend!r}")

    def check(self, metric: Metric) -> None:
        """Raise a ValueError when ``metric`` cannot be searched this way: half-precision
        operands need a matrix metric (l1 and linf have no product to speed up)."""
        if self.half is not None and not metric.matrix:
            raise ValueError(f"half={self.half} needs a matrix metric, got {metric.name!r}; use half=None")

    @property
    def c_kernels(self) -> bool:
        """Whether densematch's C kernels may run (where :func:`densematch.kernels.native.usable`
        says they can): every backend but "torch", which means torch's own kernels throughout."""
        return self.backend != "torch"

    def cap(self, k: int, nb: int = 0, c: int = 0) -> int:
        """Candidates kept per row for a top-``k`` search of ``nb`` references of ``c`` channels."""
        if self.candidates is not None:
            return max(self.candidates, 8 * k)
        most = _MOST_CANDIDATES * (2 if c >= _MORE_CANDIDATES_FROM else 1)
        return max(CANDIDATES, 8 * k, min(int(nb * _CANDIDATES_PER_REFERENCE), most))


FLOAT32 = Precision()


def unit_roundoff(dtype: torch.dtype) -> float:
    """2^-(significand bits): 2^-8 for bfloat16, 2^-11 for float16, 2^-24 for float32."""
    return float(torch.finfo(dtype).eps) / 2.0


def _gamma(c: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative error bound of a length-c dot product accumulated in ``dtype``."""
    u = _U32 if dtype == torch.float32 else unit_roundoff(dtype)
    n = c + 2
    return 2.0 * n * u / (1.0 - n * u)


def product_slack(q: torch.Tensor, ref_norms: tuple[float, float], extra: int = 0) -> torch.Tensor:
    """(m,) bounds on how far the compute dtype's products of prepared query rows ``q`` (m, C)
    with any prepared reference row lie from the exact products. ``ref_norms``: the largest
    norm of the references' first ``C - extra`` columns and of their last ``extra`` (the l2
    column). The rounding of a dot product is at most ``gamma sum |q_i r_i|``, which Cauchy-Schwarz
    bounds part by part: ``gamma (|q_body| |r_body| + |q_extra| |r_extra|)``, far tighter for
    l2 than ``gamma |q| |r|``, whose ``1 x ||b||^2 / 2`` would multiply the whole query norm.
    Doubled: the second half for the rows' own preparation (centring, unit scaling, the l2
    column), which rounds in the same dtype."""
    c = q.shape[1] - extra
    bound = torch.linalg.vector_norm(q[:, :c], dim=1) * ref_norms[0]
    if extra:
        bound += torch.linalg.vector_norm(q[:, c:], dim=1) * ref_norms[1]
    return 2 * _gamma(q.shape[1], q.dtype) * bound + _FLUSH


def shifted_slack(
    q_norms: torch.Tensor, c: int, dtype: torch.dtype, ref_norm: float, unshifted: float = 0.0
) -> torch.Tensor:
    """:func:`product_slack` of a pure product (no extra column) for query rows of norms
    ``q_norms`` (m,) and ``c`` columns, against references of largest norm ``ref_norm``, where
    those references may be shifted by one vector ``m`` (``r - m``: every exact product of a
    query row moves by ``q . m``, so its ranking stays). Then ``ref_norm`` is the shifted rows'
    and ``unshifted`` the largest norm before the shift, of rows prepared within 3 roundings of
    each value (:meth:`densematch.metrics.Metric.prepare` with ``precise``): their own error,
    which no shift reduces, adds ``4 u |q| unshifted``."""
    factor = 2 * _gamma(c, dtype) * ref_norm + 4 * unit_roundoff(dtype) * unshifted
    return q_norms * factor + _FLUSH


def row_norms(x: torch.Tensor, h: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's norms (n, 4) that the bound terms are made of: ``|x|``, ``|h|``, ``|h - x|``
    (the difference in x's dtype) and ``|u|`` (0 without ``u``), of rows ``x`` and ``u`` in the
    compute dtype and their half copies ``h``, all (n, C). :func:`densematch.kernels.native.row_norms`
    makes the same in one pass (bfloat16 on a CPU)."""
    h32 = h.to(x.dtype, copy=True)  # the one (n, C) temporary: reused for the difference
    nh = torch.linalg.vector_norm(h32, dim=1)
    both = [torch.linalg.vector_norm(x, dim=1), nh, torch.linalg.vector_norm(h32.sub_(x), dim=1)]
    return torch.stack([*both, torch.zeros_like(nh) if u is None else torch.linalg.vector_norm(u, dim=1)], dim=1)


def query_terms(
    q: torch.Tensor, qh: torch.Tensor, uncentred: torch.Tensor | None = None, *, norms: torch.Tensor | None = None
) -> torch.Tensor:
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
    uncentred : Tensor of shape (m, C), optional
        Where ``q`` is these rows less a common centre ``v`` (the score then gains ``v . b``, see
        :func:`cross_terms`): the rows before. The float32 roundings of ``q = fl(u - v)`` and of
        the references' own centring are at most ``u32 (|u| + |q|)`` per unit of reference norm,
        which the float32 terms above, proportional to ``|q|``, no longer cover when ``|q|`` is
        far below ``|u|``.
    norms : Tensor of shape (m, 4), optional
        :func:`row_norms` of ``(q, qh, uncentred)``, where the caller has them.
    """
    gamma = _gamma(q.shape[1], q.dtype)
    nq, nqh, dq, nu = (row_norms(q, qh, uncentred) if norms is None else norms).unbind(1)
    x = nq * _NORM_SLACK
    z = (dq + nqh * gamma) * _NORM_SLACK
    if uncentred is not None:  # against the half references' norm w, within u of their own
        z += 2 * unit_roundoff(q.dtype) * (nu + x)
    return torch.stack([x, z, torch.ones_like(x)], dim=1)


def cross_terms(
    terms: torch.Tensor,
    centre: torch.Tensor,
    cross: torch.Tensor,
    half: torch.dtype,
    norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """(n,) additions to the per-reference term of :func:`ref_terms` ``terms`` for queries
    centred on ``centre`` (C,): the float32 product ``cross = b . centre`` (n,) is within
    ``gamma |centre| |b|`` of the exact one (``|b| <= w / (1 - u)``, ``w`` the half rows' norm,
    or ``norms`` (n,), the rows' own, where the half rows are not copies of b), and adding it to
    a score rounds by at most 4 u32 of it."""
    reach = _gamma(centre.shape[0], centre.dtype) * float(torch.linalg.vector_norm(centre))
    if norms is None:
        norms, reach = terms[:, 1], reach / (1.0 - unit_roundoff(half))
    return (reach * _NORM_SLACK) * norms + 4 * unit_roundoff(centre.dtype) * cross.abs()


def group_centres(r: torch.Tensor, size: int) -> torch.Tensor:
    """(ceil(n / size), C) centres of the groups of ``size`` consecutive rows of ``r`` (n, C):
    the mean of a group's rows, or where that is not finite, of its finite rows (zero where none
    is or that mean is not finite either). Any finite centre is sound (:func:`group_terms`); the
    mean makes the rows less their centre small."""
    n, c = r.shape
    full = n // size
    centres = r.new_empty((-(-n // size), c))
    if full:
        torch.mean(r[: full * size].reshape(full, size, c), 1, out=centres[:full])
    if full < centres.shape[0]:
        centres[full] = r[full * size :].mean(0)
    for g in (~torch.isfinite(centres).all(1)).nonzero().squeeze(1).tolist():  # NaN, inf, overflow
        rows = r[g * size : (g + 1) * size]
        finite = torch.isfinite(rows).all(1)
        # each row divided first (exact: a power of two in practice), so that no sum overflows
        centre = (rows[finite] / size).sum(0) * (size / max(int(finite.sum()), 1))
        centres[g] = centre.masked_fill_(~torch.isfinite(centre), 0.0)
    return centres


def group_terms(q: torch.Tensor, uncentred: torch.Tensor, *, norms: torch.Tensor | None = None) -> torch.Tensor:
    """The query side (m, 5) of the bound on each query row's product with a reference group's
    centre, for references whose half rows hold ``d = fl(b - t)``, ``t`` their group's centre.

    The score ``q . b`` is then ``q . d + p``, ``p = fl(q . t)``, within
    ``((g0 |t| + g1 B) + g2 D) + g3 |p| + g4`` (``g`` a row of these terms; B and D the group's
    largest ``|b|`` and ``|d|``, :func:`group_norms`): the float32 product is within
    ``gamma |q| |t|`` (plus flushed products), the centring's rounding within ``u32 |q| |d|``,
    the bounds of :func:`query_terms`, scaled to the half rows' norm ``|d|``, no longer cover the
    preparation's roundings, ``2 u32 (|u| + |q|)`` per unit of ``|b|``, and adding ``p`` plus the
    bound to a score rounds by at most ``2 u32`` of ``|p|`` (the caller covers the score's and
    the bias's shares). The terms carry the slack of the bound's own float32 arithmetic. The C
    kernel (``dm_merge_certified_bf16``) forms the bound from them per row and group.

    Parameters
    ----------
    q : Tensor of shape (m, C)
        The query rows the half product reads, in float32 (centred, where they are).
    uncentred : Tensor of shape (m, C)
        The rows before their centring (``q`` itself where none).
    norms : Tensor of shape (m, 4), optional
        :func:`row_norms` with ``q`` first and ``uncentred`` last (as :func:`query_terms` takes
        them), where the caller has them.
    """
    gamma, u = _gamma(q.shape[1], q.dtype), _U32
    if norms is None:
        nq, nu = torch.linalg.vector_norm(q, dim=1), torch.linalg.vector_norm(uncentred, dim=1)
    else:
        nq, nu = norms[:, 0], norms[:, 3]
    nq, nu = nq * _NORM_SLACK, nu * _NORM_SLACK
    rows = [gamma * nq, 2 * u * (nu + nq), 2 * u * nq, torch.full_like(nq, 4 * u * _NORM_SLACK)]
    return torch.stack([*rows, torch.full_like(nq, _FLUSH * (q.shape[1] + 2))], dim=1)


def group_norms(centres: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """The group side (G, 3) of :func:`group_terms`' bound: ``(|t|, B, D)`` of the centres
    (G, C) and each group's largest norms ``largest`` (G, 2: ``|b|``, ``|d|``), with their
    rounding's slack."""
    return torch.cat([torch.linalg.vector_norm(centres, dim=1, keepdim=True), largest], dim=1) * _NORM_SLACK


def ref_terms(r: torch.Tensor, rh: torch.Tensor, *, norms: torch.Tensor | None = None) -> torch.Tensor:
    """The reference side of the per-pair rounding bound: (n, 3) rows ``(y, w, flush)`` of
    prepared float32 rows ``r`` and their half copies ``rh`` (``norms``: their :func:`row_norms`,
    where the caller has them)."""
    gamma = _gamma(r.shape[1], r.dtype)
    nr, w, dr, _ = (row_norms(r, rh) if norms is None else norms).unbind(1)
    y = dr + gamma * nr
    return torch.stack([y, w, torch.full_like(y, _FLUSH * (r.shape[1] + 2))], dim=1)


def _half_candidates(device: torch.device, metric: Metric) -> tuple[torch.dtype, ...]:
    """Half dtypes safe for this metric: float16's range (65504) only holds unit rows."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (torch.float16,) if metric.unit else ()
    return (torch.bfloat16, torch.float16) if metric.unit else (torch.bfloat16,)


def cpu_capabilities() -> dict[str, Any] | None:
    """torch's own probe of this CPU (its name and instruction sets), None where torch has none."""
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    return None if probe is None else dict(probe())


def cpu_bf16_unit() -> str | None:
    """The unit with which this CPU multiplies bfloat16 faster than float32, from torch's own
    CPU feature probe: ``"AMX"`` (tiles: 3-6x float32's rate), ``"AVX512-BF16"`` on an AMD CPU
    (``vdpbf16ps``, two products per float32 lane: about 2.2x float32's rate through oneDNN on an
    AMD EPYC Zen 4, BENCHMARKS.md), or None: bfloat16 emulated (about half float32's rate), or
    ``avx512_bf16`` on an Intel CPU without AMX (on a Xeon with ``avx512_bf16`` and
    ``avx512_fp16`` whose hypervisor hides AMX, oneDNN's bfloat16 product took 1.7-2.0x MKL's
    float32 time, and float16's 1.0-1.1x: BENCHMARKS.md)."""
    caps = cpu_capabilities()
    if caps is None:
        tile = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return "AMX" if tile is not None and tile() else None
    if caps.get("amx_bf16") and caps.get("amx_tile"):
        return "AMX"
    if caps.get("avx512_bf16") and str(caps.get("cpu_name", "")).upper().startswith("AMD"):
        return "AVX512-BF16"
    return None


def device_half(device: torch.device, metric: str | Metric) -> torch.dtype | None:
    """The half dtype this device multiplies fastest, from what the device is, never timed.

    CUDA devices with tensor cores (compute capability 7.0 and up): float16 for unit rows (an
    8x tighter bound), else bfloat16 where supported. CPUs whose bfloat16 products are faster
    than float32's (AMX, or AVX-512 BF16 on AMD: :func:`cpu_bf16_unit`): bfloat16. Other CPUs
    and older GPUs: None, since their half products are no faster than float32 (a CPU that
    emulates bfloat16 multiplies it at about half the float32 rate).
    """
    choices = _half_candidates(device, get_metric(metric))
    if not choices:
        return None
    if device.type == "cuda":
        return choices[-1] if torch.cuda.get_device_capability(device) >= (7, 0) else None
    if device.type == "cpu" and cpu_bf16_unit() is not None:
        return torch.bfloat16
    return None


@read_once
def resolve_precision(
    precision: str, device: torch.device, metric: str | Metric, *, float64: bool = False
) -> Precision:
    """Turn a public precision name, and the config, into a :class:`Precision` for this device
    and metric: the one place either is read.

    The choice depends only on the device and the metric (:func:`device_half`), so every process
    on one machine takes the same path. ``config_context(half=...)`` overrides it: ``"bfloat16"``
    or ``"float16"`` force that operand dtype for ``"exact"`` and ``"fast"``, ``"off"`` never
    uses half precision. l1 and linf have no product to speed up: they always score in float32
    (or float64). ``config_context(kernel=...)`` gives the backend.
    """
    metric = get_metric(metric)
    backend = kernel_setting()
    if precision == "float64" or float64:
        return Precision(precision, torch.float64, backend=backend)
    if precision == "float32" or not metric.matrix:
        return Precision(precision, torch.float32, backend=backend)
    setting = half_setting()
    if setting == "off":
        half = None
    elif setting in HALF_DTYPES:
        half = HALF_DTYPES[setting]
    else:
        half = device_half(device, metric)
    return Precision(precision, torch.float32, half, certify=precision == "exact", backend=backend)
