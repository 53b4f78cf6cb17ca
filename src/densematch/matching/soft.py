"""Soft matching: for every pixel of a, softmax weights over b's pixels and the expected
position under them, differentiable, without the Na x Nb weight matrix.

The forward keeps per row a running maximum, a running sum and running weighted moments of the
position (online softmax, one tile of logits at a time); the backward recomputes the tiles from
the saved log-sum-exp. Memory: O((Na + Nb) x C) plus one tile, never Na x Nb.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._oprules import differentiable, looped, operator, recording, refuse_legacy_onnx
from ..budget import chunk_rows
from ..checks import check_batch_mask, check_choice, check_features, check_finite, check_pair, check_real, compute_dtype
from ..choices import LayoutName, SoftMode
from ..config import resolve_memory

__all__ = ["SOFT_MODES", "SoftMatches", "soft_match"]

SOFT_MODES = ("softmax", "dual_softmax")
# temperature="auto": each pixel's temperature is its best cosine's lead over its mean cosine,
# divided by this. Chosen on synthetic.match_pairs() (benchmarks/studies/bench_soft_temperature.py): PCK@1
# near the hard argmax's with the built-in patch, color and dsift features, where a fixed 0.1
# gave 0%
AUTO_SHARPNESS = 256.0
_TILE_B = 4096
# the plain softmax through torch's fused attention where a fused kernel takes the inputs
_SDPA = True
# on a CPU, narrower features take the flash kernel's backward after the tiles' forward where
# gradients are wanted; these and wider ones the tiles' backward too: measured at 96x96 (one
# thread, forward + backward), the flash backward led at C=64 and 128, the tiles' at 256
# (benchmarks/history/2026-12-01-soft-match-the-largest-weight-found-on-the.md)
_FUSED_WIDTH = 128


@dataclass
class SoftMatches:
    """The result of :func:`soft_match`.

    Attributes
    ----------
    coords : Tensor of float32 (float64 for float64 inputs), shape (*batch, H_a, W_a, 2)
        The expected (row, col) in b's grid under each pixel's weights; differentiable.
    spread : Tensor of coords' dtype, shape (*batch, H_a, W_a)
        The standard deviation of that position (the root of the summed variances of row and
        col): a confidence, small where the weight sits on one place; differentiable.
    max_weight : Tensor of coords' dtype, shape (*batch, H_a, W_a)
        The largest weight of the pixel (not differentiable).
    """

    coords: torch.Tensor
    spread: torch.Tensor
    max_weight: torch.Tensor


def soft_match(
    a: Any,
    b: Any,
    *,
    temperature: float | str = "auto",
    mode: SoftMode = "softmax",
    layout: LayoutName = "hwc",
    mask_b: Any = None,
    memory: int | str | None = None,
) -> SoftMatches:
    """Soft matches: for every pixel i of ``a``, weights p_ij over the pixels j of ``b`` from
    their cosine similarities s_ij, and the expected position sum_j p_ij (row_j, col_j).

    Which options fit which job, and what each costs: docs/choosing.md.

    Parameters
    ----------
    a, b : Tensor or ndarray
        Features of shape (H, W, C) or (B, H, W, C) for layout="hwc", (C, H, W) or
        (B, C, H, W) for "chw"; any float dtype (computed in float32, or float64 for float64
        inputs). Grids may differ.
    temperature : float or "auto", default="auto"
        p_ij = softmax_j(s_ij / temperature). "auto": scale-free, per pixel of a,
        t_i = (max_j s_ij - mean_j s_ij) / 256, the best cosine's lead over the mean one (a
        constant of the pixel: no gradient flows through it). On synthetic.match_pairs() (shift,
        affine, homography) it reaches PCK@1 0.94 / 0.58 / 0.63 with "patch" features, 0.95 /
        0.54 / 0.39 with "color" and 0.94 / 0.64 / 0.79 with "dsift", close to the hard
        argmax's; a fixed 0.1 reached 0.00 / 0.00 / 0.00 with "patch" (BENCHMARKS.md).
    mode : {"softmax", "dual_softmax"}, default="softmax"
        "dual_softmax": p_ij = softmax_j(s_ij / t) * softmax_i(s_ij / t), LoFTR's coarse
        matching, whose weights per pixel of a sum to at most 1 (``coords`` are then the
        weighted mean of the positions, the weights renormalised).
    mask_b : bool Tensor or ndarray of shape (*batch, H_b, W_b) or (H_b, W_b), optional
        Pixels of b that may take weight.
    memory : int or str, optional
        Cap on the working memory of the tiles (logits, weights and their gradient terms), as
        in :func:`densematch.match`. Outside it, because they are as large as the inputs and
        needed whole: the unit-normalised copies of a and b, kept for the backward ((Na + Nb)
        x C values), and in the backward the accumulators of their gradients (as many again)
        plus the normalisation's own backward (about as many again); on a CPU, the plain
        softmax with gradients of fewer than 128 channels runs torch's flash backward, which
        also holds the positions, the moments and their gradients padded to C (about 2 (Na + Nb)
        rows of C).

    Returns
    -------
    SoftMatches
        ``coords``, ``spread`` (differentiable with respect to ``a`` and ``b``) and
        ``max_weight``.

    Examples
    --------
    >>> f = torch.randn(12, 14, 32)
    >>> s = soft_match(f, f, temperature=0.01)       # each pixel's weight sits on itself
    >>> grid = torch.stack(torch.meshgrid(torch.arange(12.0), torch.arange(14.0), indexing="ij"), -1)
    >>> bool((s.coords - grid).abs().max() < 1e-3), bool(s.max_weight.min() > 0.99)
    (True, True)
    """
    check_choice(mode, "mode", SOFT_MODES)
    auto = isinstance(temperature, str) and temperature == "auto"
    t = 1.0 if auto else check_real(temperature, "temperature", 0.0, math.inf, low_open=True)
    if layout not in ("hwc", "chw"):
        raise ValueError(f"layout must be 'hwc' or 'chw' (positions need a 2-D grid), got {layout!r}")
    ra, grid_a, batched = check_features(a, "a", layout, finite=False)  # the op checks a, b (b where allowed)
    rb, grid_b, batched_b = check_features(b, "b", layout, finite=False)
    check_pair(ra, rb, batched, batched_b)
    masks = check_batch_mask(mask_b, "mask_b", ra.shape[0], grid_b, batched, ra.device)
    if masks is not None:
        masks = masks.reshape(ra.shape[0], -1)
    refuse_legacy_onnx("soft_match")
    budget = resolve_memory(memory, ra.device)
    dtype = compute_dtype(ra, rb)
    hb, wb = grid_b
    rows = torch.arange(hb, device=ra.device, dtype=torch.float64).repeat_interleave(wb)
    cols = torch.arange(wb, device=ra.device, dtype=torch.float64).repeat(hb)
    # moments about b's centre: small numbers, so that the variance keeps its digits
    centre = ((hb - 1) / 2, (wb - 1) / 2)
    values = torch.stack((rows - centre[0], cols - centre[1], (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2), 1)
    # autocast would run the products in bfloat16 or float16 and move coordinates by up to
    # 0.045 px: the weights are computed in float32 (float64 for float64 inputs) whatever it says
    with torch.autocast(device_type=ra.device.type, enabled=False):
        apply = _moments_op if recording() else _Moments.apply  # as pairwise_distance chooses
        args = (ra.to(dtype), rb.to(dtype), masks, values, 1.0 / t, mode == "dual_softmax", auto, budget)
        out, top, *_ = apply(*args)  # type: ignore[no-untyped-call]

    coords = out[..., :2] + torch.tensor(centre, dtype=out.dtype, device=out.device)
    variance = (out[..., 2] - out[..., :2].square().sum(-1)).clamp_min(1e-12)
    shape = (*((ra.shape[0],) if batched else ()), *grid_a)
    return SoftMatches(
        coords.to(dtype).reshape(*shape, 2), variance.sqrt().to(dtype).reshape(shape), top.to(dtype).reshape(shape)
    )


# densematch::soft_moments: the soft weights' moments as one PyTorch operator (what
# torch.compile, torch.export, torch.jit.trace and torch.func see), with its backward an
# operator of its own. Per batch item: a (Na, C) and b (Nb, C) in the compute dtype, b's rows
# that mask_b allows, and values (Nb, 3) whose moments are taken. Outputs: the moments
# (B, Na, 3) in float64, each row's largest weight, and what the backward reuses: the rows'
# log-sum-exp, the dual softmax's column log-sum-exp (B, Nb; -inf at masked columns; (B, 0)
# for the plain softmax) and each row's scale (1 / t_i for temperature="auto", else 1).
@operator(
    "densematch::soft_moments",
    schema="(Tensor a, Tensor b, Tensor? mask_b, Tensor values, float scale, bool dual, bool auto, int budget) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _moments_op(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_b: torch.Tensor | None,
    values: torch.Tensor,
    scale: float,
    dual: bool,
    auto: bool,
    budget: int,
) -> tuple[torch.Tensor, ...]:
    check_finite(a, "a")
    items = []
    for i in range(a.shape[0]):
        kept = _allowed(mask_b, i)
        kb, v = _kept(b[i], kept), _kept(values, kept)
        if kb.shape[0] == 0:
            raise ValueError("mask_b must leave at least one pixel of b")
        check_finite(kb, "b")
        out, top, lse, col_lse, row_scale = _forward_item(a[i], kb, v, scale, dual, auto, budget)
        if dual and kept is not None:  # back to b's own columns
            col_lse = col_lse.new_full((b.shape[1],), -math.inf).index_copy_(0, kept, col_lse)
        items.append((out, top, lse, col_lse, row_scale))
    return tuple(torch.stack(parts) for parts in zip(*items, strict=True))


@_moments_op.register_fake
def _moments_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_b: torch.Tensor | None,
    values: torch.Tensor,
    scale: float,
    dual: bool,
    auto: bool,
    budget: int,
) -> tuple[torch.Tensor, ...]:
    n, na = a.shape[:2]
    rows = a.new_empty((n, na))
    return (
        a.new_empty((n, na, values.shape[1]), dtype=torch.float64),
        rows,
        rows.clone(),
        a.new_empty((n, b.shape[1] if dual else 0)),
        rows.clone(),
    )


@operator(
    "densematch::soft_moments_backward",
    schema="(Tensor grad, Tensor a, Tensor b, Tensor? mask_b, Tensor values, Tensor moments, Tensor lse, "
    "Tensor col_lse, Tensor row_scale, float scale, bool dual, int budget) -> (Tensor, Tensor)",
)
def _moments_backward_op(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    mask_b: torch.Tensor | None,
    values: torch.Tensor,
    moments: torch.Tensor,
    lse: torch.Tensor,
    col_lse: torch.Tensor,
    row_scale: torch.Tensor,
    scale: float,
    dual: bool,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    ga, gb = (
        torch.empty_like(a, memory_format=torch.contiguous_format),
        torch.zeros_like(b, memory_format=torch.contiguous_format),
    )
    for i in range(a.shape[0]):
        kept = _allowed(mask_b, i)
        kb = _kept(b[i], kept)
        item = (moments[i], lse[i], _kept(col_lse[i], kept) if dual else None, row_scale[i])
        ga[i], gk = _backward_item(grad[i], a[i], kb, _kept(values, kept), *item, scale, budget)
        if kept is None:
            gb[i] = gk
        else:
            gb[i].index_copy_(0, kept, gk)
    return ga, gb


@_moments_backward_op.register_fake
def _moments_backward_fake(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *rest: Any
) -> tuple[torch.Tensor, ...]:
    return torch.empty_like(a, memory_format=torch.contiguous_format), torch.empty_like(
        b, memory_format=torch.contiguous_format
    )


def _moments_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    a, b, mask_b, values, scale, dual, _auto, budget = inputs
    moments, top, lse, col_lse, row_scale = output
    ctx.save_for_backward(a, b, mask_b, values, moments, lse, col_lse, row_scale)
    ctx.settings = (scale, dual, budget)
    ctx.mark_non_differentiable(top, lse, col_lse, row_scale)


def _moments_gradients(ctx: Any, grads: tuple[torch.Tensor, ...], backward: Any) -> tuple[torch.Tensor | None, ...]:
    a, b, mask_b, values, moments, lse, col_lse, row_scale = ctx.saved_tensors
    ga, gb = backward(grads[0], a, b, mask_b, values, moments, lse, col_lse, row_scale, *ctx.settings)
    need_a, need_b = ctx.needs_input_grad[:2]
    return (ga if need_a else None), (gb if need_b else None), None, None, None, None, None, None


_Moments = differentiable(_moments_op, _moments_backward_op, _moments_setup, _moments_gradients, "soft_match")


def _moments_vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> Any:
    if in_dims[3] is not None:  # values per vmapped item: one call each
        return looped(_moments_op, in_dims, args)
    # a, b and mask_b batched or not: the vmapped items fold into the op's own batch
    size = info.batch_size
    n = next(t.shape[dim + 1] for t, dim in zip(args[:3], in_dims[:3], strict=False) if dim is not None)

    def fold(t: torch.Tensor | None, dim: int | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
        return t.flatten(0, 1)

    folded = (fold(t, dim) for t, dim in zip(args[:3], in_dims[:3], strict=True))
    outs = _moments_op(*folded, *args[3:])
    return tuple(o.unflatten(0, (size, n)) for o in outs), (0,) * len(outs)


def _moments_backward_vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> Any:
    return looped(_moments_backward_op, in_dims, args)


_moments_op.register_vmap(_moments_vmap)
_moments_backward_op.register_vmap(_moments_backward_vmap)


def _allowed(mask_b: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """The indices of item i's allowed rows of b (None: all of them)."""
    return None if mask_b is None else mask_b[i].nonzero().squeeze(1)


def _kept(x: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    return x if kept is None else x.index_select(0, kept)


def _forward_item(
    a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, scale: float, dual: bool, auto: bool, budget: int
) -> tuple[torch.Tensor, ...]:
    """One item's moments (Na, 3), largest weights, log-sum-exps and row scales (see the op)."""
    q, k = F.normalize(a, dim=1), F.normalize(b, dim=1)
    row_scale = _auto_scale(q, k, budget) if auto else q.new_ones(q.shape[0])
    if auto:  # each row's own temperature, folded into its query row
        q = q * row_scale[:, None]
    # float64 takes the tiles everywhere: torch's fused CPU kernel strayed ~1e-9 from
    # float64's exact moments (tests/matching/test_soft.py's rounding bound)
    if not dual and _SDPA and q.dtype != torch.float64 and q.device.type != "cpu":
        fused = _fused(q, k, v, scale, budget)
        if fused is not None:
            return (*fused, q.new_empty(0), row_scale)
    out, top, lse, col_lse = _attention_forward(q, k, v, scale, dual, budget)
    return out, top, lse, col_lse, row_scale


def _backward_item(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    col_lse: torch.Tensor | None,
    row_scale: torch.Tensor,
    scale: float,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One item's gradients for a (Na, C) and its allowed rows of b from the moments' ``grad``."""
    unit_a, unit_b = F.normalize(a, dim=1), F.normalize(b, dim=1)
    q = unit_a * row_scale[:, None]
    # on a CPU the plain softmax of narrow features takes torch's flash backward (float32)
    flash = col_lse is None and _SDPA and q.dtype != torch.float64 and q.shape[1] < _FUSED_WIDTH
    if flash and q.device.type == "cpu":
        dq, dk = _flash_backward(grad, q, unit_b, v, out, lse, scale)
    else:
        dq, dk = _attention_backward(grad, q, unit_b, v, out, lse, col_lse, scale, budget)
    # the automatic temperature is a constant of each row: the gradient passes its scale only
    return _normalize_grad(a, unit_a, dq * row_scale[:, None]), _normalize_grad(b, unit_b, dk)


_NORMALIZE_EPS = 1e-12  # F.normalize's


def _normalize_grad(x: torch.Tensor, unit: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient at x of F.normalize(x, dim=1) = x / max(||x||, eps) given ``g`` at its
    output: (g - u (u . g)) / ||x|| where the norm exceeds eps, g / eps elsewhere."""
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    over = norm > _NORMALIZE_EPS
    along = (unit * g).sum(1, keepdim=True)
    return torch.where(over, (g - unit * along) / norm.clamp_min(_NORMALIZE_EPS), g / _NORMALIZE_EPS)


_EXP_FLOOR = -60.0
# bytes per pair of one tile at the backward's peak: logits and weights in float32, the weights,
# the gradient terms and their products in float64 (the dual softmax's column weights too)
_PAIR_BYTES = 80


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """On a GPU, the softmax moments through torch's fused attention kernel (never the math
    kernel, which builds the Na x Nb weights), with features and values padded to one width, its
    largest weights and log-sum-exps, or None where no fused kernel takes these inputs. The
    largest weight is exp(max logit - log-sum-exp), from the kernel's own log-sum-exp and the
    maxima of one tiled pass of products (no exponentials, no sums). The backward runs the tiles
    (:func:`_attention_backward`) from that log-sum-exp."""
    c = -(-max(q.shape[1], v.shape[1]) // 8) * 8  # a width every fused kernel takes; zero columns change no product
    qp, kp = (F.pad(x, (0, c - x.shape[1])) for x in (q, k))
    vp = F.pad(v.to(q.dtype), (0, c - v.shape[1]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch explains a kernel it cannot use
            out, lse = _attention(qp[None, None], kp[None, None], vp[None, None], scale)
    except RuntimeError:
        return None
    ta, tb = _tiles(q.shape[0], k.shape[0], q.shape[1], budget)
    best = _row_max(q, k, scale, ta, tb)
    lse_rows = lse[0, 0, : q.shape[0]].to(best.dtype)
    top = torch.exp(best - lse_rows).clamp_max(1.0)  # two roundings apart
    return out[0, 0, :, : v.shape[1]].double(), top, lse_rows


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (1, 1, N, c) and its log-sum-exp per row (1, 1, >= N): torch's
    memory-efficient kernel on a GPU (it takes float32; flash takes half precision only), its
    flash kernel on a CPU (where the tests reach this path)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    else:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)
    return out, lse


def _flash_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain softmax's gradients for q and k on a CPU through torch's flash kernel's own
    backward, handed the tiles' log-sum-exp and moments (features and positions padded to one
    width, as the kernel wants; zero columns change no product)."""
    c = max(q.shape[1], v.shape[1])

    def wide(x: torch.Tensor) -> torch.Tensor:  # (N, c) in q's dtype, as (1, 1, N, c); no copy of q or k
        x = x.to(q.dtype)
        return (x if x.shape[1] == c else F.pad(x, (0, c - x.shape[1]))).contiguous()[None, None]

    dq, dk, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        wide(grad), wide(q), wide(k), wide(v), wide(out), lse.float()[None, None].contiguous(), 0.0, False,
        scale=scale,
    )  # fmt: skip
    return dq[0, 0, :, : q.shape[1]], dk[0, 0, :, : k.shape[1]]


def _auto_scale(q: torch.Tensor, k: torch.Tensor, budget: int) -> torch.Tensor:
    """1 / t_i for temperature="auto": AUTO_SHARPNESS / (max_j cos_ij - mean_j cos_ij) per row
    (1 where every cosine of the row is equal, which any temperature leaves uniform)."""
    ta, tb = _tiles(q.shape[0], k.shape[0], q.shape[1], budget)
    lead = _row_max(q, k, 1.0, ta, tb) - q @ k.mean(0)
    return torch.where(lead > 0, AUTO_SHARPNESS / lead.clamp_min(torch.finfo(q.dtype).tiny), 1.0)


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp of a tile of logits less their row's maximum or log-sum-exp (<= 0), in place, each
    floored at _EXP_FLOOR: weights of e^-60 (9e-27) of the row's largest, even 10^8 of them,
    move its sums by under 1e-18 of themselves, below a float64 rounding step; and the floor
    keeps subnormal numbers, which a CPU computes with a microcode assist per operation, out of
    the sums and products (the automatic temperature's sharp rows made a 64x64 forward 5x
    slower)."""
    return x.clamp_min_(_EXP_FLOOR).exp_()


def _logits(qi: torch.Tensor, kj: torch.Tensor, scale: float) -> torch.Tensor:
    """scale qi kj^T, the scale folded into the rows of qi: one pass over a tile fewer, and the
    same rounding wherever a tile is computed (forward, backward, row statistics)."""
    return (qi if scale == 1.0 else qi * scale) @ kj.T


def _row_max(q: torch.Tensor, k: torch.Tensor, scale: float, ta: int, tb: int) -> torch.Tensor:
    """The largest logit of every row, over column tiles (products and maxima, no exponentials)."""
    best = torch.empty(q.shape[0], dtype=q.dtype, device=q.device)
    for i in range(0, q.shape[0], ta):
        qi = q[i : i + ta]
        top = torch.full((qi.shape[0],), -math.inf, dtype=q.dtype, device=q.device)
        for j in range(0, k.shape[0], tb):
            top = torch.maximum(top, _logits(qi, k[j : j + tb], scale).amax(1))
        best[i : i + ta] = top
    return best


def _tiles(na: int, nb: int, c: int, budget: int) -> tuple[int, int]:
    """Row and column tiles whose temporaries (:data:`_PAIR_BYTES` per pair) fit the budget."""
    tb = min(nb, _TILE_B)
    ta = chunk_rows(budget, tb * _PAIR_BYTES + 16 * c, "one row of soft weights")
    return max(1, min(ta, na)), tb


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dual: bool, budget: int
) -> tuple[torch.Tensor, ...]:
    """out_i = sum_j w_ij v_j with w_ij = softmax_j(l_ij), by tiles: the (na, 3) moments in
    float64, each row's largest weight, its log-sum-exp and (dual) the columns' log-sum-exp.

    The plain softmax has logits l_ij = scale q_i . k_j. The dual softmax's weights
    P_ij = softmax_j(s_ij) softmax_i(s_ij) (s = scale q k^T) are renormalised per row, which is
    again a softmax over j, of l_ij = 2 s_ij - c_j with c_j = log sum_i exp(s_ij): taken in the
    log domain, so that a row whose every P_ij underflows (low temperatures) still gets its
    weights, never a fallback to b's centre."""
    shared, ta, tb = _attention_tiles(q, k, dual, budget)
    products = None
    if shared:
        products = _products(q, k, scale, ta)
        col_lse = _column_lse(products, ta)
    elif dual:
        col_lse = _row_stats(k, q, scale, tb, ta)[0]
    else:
        col_lse = None
    lse, best, out, plain_lse = _online(q, k, v, scale, ta, tb, col_lse, products)
    del products
    # the largest weight: exp(best - lse), of P_ij itself in dual mode (which may underflow:
    # a row whose best match is every other row's best too carries little weight)
    top = torch.exp(best - (plain_lse if plain_lse is not None else lse))
    return out, top, lse, (lse.new_empty(0) if col_lse is None else col_lse)


def _attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    col_lse: torch.Tensor | None,
    scale: float,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_attention_forward`'s moments for q and k (``col_lse``: the
    dual softmax's, None for the plain one), its tiles recomputed as the forward sized them."""
    dual = col_lse is not None
    na, nb = q.shape[0], k.shape[0]
    shared, ta, tb = _attention_tiles(q, k, dual, budget)
    factor = 2.0 if dual else 1.0
    # out_i = sum_j w_ij v_j: the gradient reaches l_ij as w_ij g_ij, g_ij = grad_i . (v_j - out_i).
    # The tiles are computed in the inputs' dtype, as the dense recipe's autograd computes
    # them (float32 for float32 features: float64 tiles cost twice the time); the per-row
    # and per-column sums that many tiles add to are kept in float64.
    dt = q.dtype
    g_v, v_t = grad_out.to(dt), v.to(dt)
    d_row = (grad_out.double() * out).sum(1).to(dt)

    products = _products(q, k, scale, ta) if shared else None

    def tile(i: int, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if products is None:
            s = _logits(q[i : i + ta], k[j : j + tb], scale)
        else:
            s = products[i : i + ta, j : j + tb]
        w = _weights(s, factor, lse[i : i + ta], col_lse, j)
        return s, w, torch.addmm(d_row[i : i + ta, None], g_v[i : i + ta], v_t[j : j + tb].T, beta=-1)

    col_sum = torch.zeros(nb, dtype=torch.float64, device=q.device)
    if col_lse is not None:  # C_j = sum_i w_ij g_ij: what reaches c_j (negated)
        for i in range(0, na, ta):
            for j in range(0, nb, tb):
                _, w, g = tile(i, j)
                col_sum[j : j + tb] += (w * g).sum(0, dtype=torch.float64)
    # accumulated in the rows' own dtype: per-input state the size of the inputs, not twice it
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    for i in range(0, na, ta):
        qi = q[i : i + ta]
        for j in range(0, nb, tb):
            kj = k[j : j + tb]
            s, w, g = tile(i, j)
            if col_lse is not None:
                # l = 2 s - c(s), dc_j / ds_ij = A_ij (the column softmax): ds = 2 w g - A C
                col = _exp_(s - col_lse[None, j : j + tb])
                ds = 2 * w * g - col * col_sum[None, j : j + tb].to(dt)
            else:
                ds = w.mul_(g)  # w is this tile's own here
            dq[i : i + ta].addmm_(ds, kj, alpha=scale)
            dk[j : j + tb].addmm_(ds.T, qi, alpha=scale)
    return dq, dk


def _attention_tiles(q: torch.Tensor, k: torch.Tensor, dual: bool, budget: int) -> tuple[bool, int, int]:
    """Whether the dual softmax's two passes share one matrix product (where it fits), and the
    tiles in what is left of the budget."""
    na, nb = q.shape[0], k.shape[0]
    shared = dual and _products_fit(na, nb, q, budget)
    return shared, *_tiles(na, nb, q.shape[1], budget - (_products_bytes(na, nb, q) if shared else 0))


def _products_bytes(na: int, nb: int, q: torch.Tensor) -> int:
    return na * nb * q.element_size()


def _products_fit(na: int, nb: int, q: torch.Tensor, budget: int) -> bool:
    """Whether all na x nb products fit three quarters of the budget (the rest for the tiles)."""
    return 4 * _products_bytes(na, nb, q) <= 3 * budget


def _products(q: torch.Tensor, k: torch.Tensor, scale: float, ta: int) -> torch.Tensor:
    """scale q k^T (na, nb), written a row tile at a time (no temporary of its size)."""
    out = torch.empty(q.shape[0], k.shape[0], dtype=q.dtype, device=q.device)
    for i in range(0, q.shape[0], ta):
        torch.mm(q[i : i + ta] * scale, k.T, out=out[i : i + ta])
    return out


def _column_lse(products: torch.Tensor, ta: int) -> torch.Tensor:
    """The log-sum-exp of every column of ``products``, online over row tiles."""
    top = torch.full((products.shape[1],), -math.inf, dtype=products.dtype, device=products.device)
    total = torch.zeros_like(top)
    for i in range(0, products.shape[0], ta):
        s = products[i : i + ta]
        new = torch.maximum(top, s.amax(0))
        total = total * torch.exp(top - new) + _exp_(s - new[None, :]).sum(0)
        top = new
    return top + total.log()


def _online(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    ta: int,
    tb: int,
    col_lse: torch.Tensor | None,
    products: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pass of products for the rows' softmax over l_ij = scale q_i . k_j (the dual's
    2 scale q_i . k_j - c_j where ``col_lse`` gives c): the log-sum-exp, the largest logit and
    the moments sum_j w_ij v_j (float64), kept online as each column tile arrives (the sums
    rescaled to each new maximum), and for the dual also the plain rows' log-sum-exp of
    scale q_i . k_j, which its largest weight needs. ``products``: scale q k^T, where computed
    already."""
    na, nb = q.shape[0], k.shape[0]
    factor = 1.0 if col_lse is None else 2.0
    lse = torch.empty(na, dtype=q.dtype, device=q.device)
    best = torch.empty_like(lse)
    plain = None if col_lse is None else torch.empty_like(lse)
    out = torch.empty(na, v.shape[1], dtype=torch.float64, device=q.device)
    # a column of ones after the moments: one product gives each tile's moments and weight sums
    v_t = torch.cat((v.to(q.dtype), v.new_ones(nb, 1, dtype=q.dtype)), 1)
    for i in range(0, na, ta):
        qi = q[i : i + ta]
        top = torch.full((qi.shape[0],), -math.inf, dtype=q.dtype, device=q.device)
        acc = out.new_zeros((qi.shape[0], v_t.shape[1]))
        plain_top, plain_total = top.clone(), torch.zeros_like(top)
        for j in range(0, nb, tb):
            s = _logits(qi, k[j : j + tb], scale) if products is None else products[i : i + ta, j : j + tb]
            logit = s if col_lse is None else factor * s - col_lse[None, j : j + tb]
            new = torch.maximum(top, logit.amax(1))
            shrink = torch.exp(top - new)
            # the weights in place where the tile is this pass's own (not the shared products)
            fresh = logit is not s or products is None
            w = _exp_(logit.sub_(new[:, None]) if fresh else logit - new[:, None])
            # each tile's moments and sums in the features' dtype, their sum over tiles in float64
            acc = acc * shrink.double()[:, None] + (w @ v_t[j : j + tb]).double()
            top = new
            if col_lse is not None:
                plain_new = torch.maximum(plain_top, s.amax(1))
                plain_total = plain_total * torch.exp(plain_top - plain_new) + _exp_(s - plain_new[:, None]).sum(1)
                plain_top = plain_new
        total = acc[:, -1]
        lse[i : i + ta], best[i : i + ta] = top + total.log().to(q.dtype), top
        out[i : i + ta] = acc[:, :-1] / total[:, None]
        if plain is not None:
            plain[i : i + ta] = plain_top + plain_total.log()
    return lse, best, out, plain


def _weights(s: torch.Tensor, factor: float, lse: torch.Tensor, bias: torch.Tensor | None, j: int) -> torch.Tensor:
    """One tile of weights exp(factor s_ij - bias_j - lse_i) from its scaled products s (bias:
    the dual's c_j, with factor 2)."""
    logit = s if factor == 1.0 else factor * s  # the plain softmax's tile as it is, no copy
    if bias is not None:
        logit = logit - bias[None, j : j + s.shape[1]]
    return _exp_(logit - lse[:, None])


def _row_stats(
    q: torch.Tensor, k: torch.Tensor, scale: float, ta: int, tb: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp and the largest value of every row of scale q k^T - bias (bias: one
    value per column, optional), online over column tiles."""
    lse = torch.empty(q.shape[0], dtype=q.dtype, device=q.device)
    best = torch.empty_like(lse)
    for i in range(0, q.shape[0], ta):
        qi = q[i : i + ta]
        top = torch.full((qi.shape[0],), -math.inf, dtype=q.dtype, device=q.device)
        total = torch.zeros_like(top)
        for j in range(0, k.shape[0], tb):
            s = _logits(qi, k[j : j + tb], scale)
            if bias is not None:
                s = s - bias[None, j : j + tb]
            new = torch.maximum(top, s.amax(1))
            total = total * torch.exp(top - new) + _exp_(s - new[:, None]).sum(1)
            top = new
        lse[i : i + ta], best[i : i + ta] = top + total.log(), top
    return lse, best
