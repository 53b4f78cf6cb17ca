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

from .budget import chunk_rows
from .checks import check_batch_mask, check_choice, check_features, check_finite, check_pair, check_real, compute_dtype
from .choices import LayoutName, SoftMode
from .config import resolve_memory

__all__ = ["SOFT_MODES", "SoftMatches", "soft_match"]

SOFT_MODES = ("softmax", "dual_softmax")
# temperature="auto": each pixel's temperature is its best cosine's lead over its mean cosine,
# divided by this. Chosen on synthetic.match_pairs() (benchmarks/bench_soft_temperature.py): PCK@1
# near the hard argmax's with the built-in patch, color and dsift features, where a fixed 0.1
# gave 0%
AUTO_SHARPNESS = 256.0
_TILE_B = 4096
# the plain softmax through torch's fused attention where a fused kernel takes the inputs
_SDPA = True
# on a CPU, narrower features take the flash kernel's backward after the tiles' forward where
# gradients are wanted; these and wider ones the tiles' backward too: measured at 96x96 (one
# thread, forward + backward), the flash backward led at C=64 and 128, the tiles' at 256
# (BENCHMARKS.md, "the largest weight found on the way")
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
    ra, grid_a, batched = check_features(a, "a", layout)
    rb, grid_b, batched_b = check_features(b, "b", layout, finite=False)
    check_pair(ra, rb, batched, batched_b)
    masks = check_batch_mask(mask_b, "mask_b", ra.shape[0], grid_b, batched, ra.device)
    if masks is not None:
        masks = masks.reshape(ra.shape[0], -1)
    budget = resolve_memory(memory, ra.device)
    dtype = compute_dtype(ra, rb)
    hb, wb = grid_b
    rows = torch.arange(hb, device=ra.device, dtype=torch.float64).repeat_interleave(wb)
    cols = torch.arange(wb, device=ra.device, dtype=torch.float64).repeat(hb)
    # moments about b's centre: small numbers, so that the variance keeps its digits
    centre = ((hb - 1) / 2, (wb - 1) / 2)
    values = torch.stack((rows - centre[0], cols - centre[1], (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2), 1)
    outs, tops = [], []
    # autocast would run the products in bfloat16 or float16 and move coordinates by up to
    # 0.045 px: the weights are computed in float32 (float64 for float64 inputs) whatever it says
    with torch.autocast(device_type=ra.device.type, enabled=False):
        for i in range(ra.shape[0]):
            out, top = _one_item(
                ra[i], rb[i], None if masks is None else masks[i], values, t, mode, auto, budget, dtype
            )
            outs.append(out)
            tops.append(top)
    out, top = torch.stack(outs), torch.stack(tops)

    coords = out[..., :2] + torch.tensor(centre, dtype=out.dtype, device=out.device)
    variance = (out[..., 2] - out[..., :2].square().sum(-1)).clamp_min(1e-12)
    shape = (*((ra.shape[0],) if batched else ()), *grid_a)
    return SoftMatches(
        coords.to(dtype).reshape(*shape, 2), variance.sqrt().to(dtype).reshape(shape), top.to(dtype).reshape(shape)
    )


def _one_item(
    qa: torch.Tensor,
    kb: torch.Tensor,
    mask: torch.Tensor | None,
    values: torch.Tensor,
    t: float,
    mode: str,
    auto: bool,
    budget: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch item: the moments (Na, 3) of ``values`` under each row of a's weights over the
    rows of b that ``mask`` (Nb,) allows, and each row's largest weight (Na,)."""
    allowed = None if mask is None else mask.nonzero().squeeze(1)
    kb = kb if allowed is None else kb.index_select(0, allowed)
    v = values if allowed is None else values.index_select(0, allowed)
    if kb.shape[0] == 0:
        raise ValueError("mask_b must leave at least one pixel of b")
    check_finite(kb.detach(), "b")
    q = F.normalize(qa.to(dtype), dim=1)
    k = F.normalize(kb.to(dtype), dim=1)
    if auto:  # each row's own temperature, folded into its query row
        q = q * _auto_scale(q.detach(), k.detach(), budget)[:, None]
    # float64 takes the tiles everywhere: torch's fused CPU kernel strayed ~1e-9 from
    # float64's exact moments (tests/test_soft.py's rounding bound)
    flash = mode == "softmax" and _SDPA and q.dtype != torch.float64
    wanted = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    fused = _fused(q, k, v, 1.0 / t, budget) if flash and q.device.type != "cpu" else None
    if fused is not None:
        return fused
    if flash and wanted and q.shape[1] < _FUSED_WIDTH:  # on a CPU
        out, top, _lse = _TilesThenFlash.apply(q, k, v, 1.0 / t, budget)  # type: ignore[no-untyped-call]
        return out, top
    out, top, *_lse = _SoftAttention.apply(q, k, v, 1.0 / t, mode == "dual_softmax", budget)  # type: ignore[no-untyped-call]
    return out, top


_EXP_FLOOR = -60.0
# bytes per pair of one tile at the backward's peak: logits and weights in float32, the weights,
# the gradient terms and their products in float64 (the dual softmax's column weights too)
_PAIR_BYTES = 80


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, budget: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On a GPU, the softmax moments through torch's fused attention kernel (never the math
    kernel, which builds the Na x Nb weights), with features and values padded to one width, or
    None where no fused kernel takes these inputs. The largest weight is exp(max logit -
    log-sum-exp), from the kernel's own log-sum-exp and the maxima of one tiled pass of products
    (no exponentials, no sums)."""
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
    with torch.no_grad():
        best = _row_max(q.detach(), k.detach(), scale, ta, tb)
        top = torch.exp(best - lse[0, 0, : q.shape[0]].to(best.dtype)).clamp_max(1.0)  # two roundings apart
    return out[0, 0, :, : v.shape[1]].double(), top


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (1, 1, N, c) and its log-sum-exp per row (1, 1, >= N), differentiable in q, k and
    v: torch's memory-efficient kernel on a GPU (it takes float32; flash takes half precision
    only), its flash kernel on a CPU (where the tests reach this path)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    else:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)
    return out, lse


class _TilesThenFlash(torch.autograd.Function):
    """The plain softmax on a CPU where gradients are wanted of narrow features: the tiles'
    forward, which finds the largest weight on the way, then torch's flash kernel's own CPU
    backward, handed the tiles' log-sum-exp and moments (features and positions padded to one
    width, as the kernel wants; zero columns change no product)."""

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ta, tb = _tiles(q.shape[0], k.shape[0], q.shape[1], budget)
        lse, best, out, _ = _online(q, k, v, scale, ta, tb, None)
        return out, torch.exp(best - lse), lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        # apart from forward (the log-sum-exp an output of its own), as torch.func wants it
        q, k, v, scale, _budget = inputs
        out, top, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(top, lse)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_top: torch.Tensor, grad_lse: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        c = max(q.shape[1], v.shape[1])

        def wide(x: torch.Tensor) -> torch.Tensor:  # (N, c) in q's dtype, as (1, 1, N, c); no copy of q or k
            x = x.to(q.dtype)
            return (x if x.shape[1] == c else F.pad(x, (0, c - x.shape[1]))).contiguous()[None, None]

        dq, dk, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            wide(grad_out), wide(q), wide(k), wide(v), wide(out), lse.float()[None, None].contiguous(), 0.0, False,
            scale=ctx.scale,
        )  # fmt: skip
        return dq[0, 0, :, : q.shape[1]], dk[0, 0, :, : k.shape[1]], None, None, None


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


class _SoftAttention(torch.autograd.Function):
    """out_i = sum_j w_ij v_j with w_ij = softmax_j(l_ij), by tiles; returns the (na, 3)
    moments in float64 and each row's largest weight.

    The plain softmax has logits l_ij = scale q_i . k_j. The dual softmax's weights
    P_ij = softmax_j(s_ij) softmax_i(s_ij) (s = scale q k^T) are renormalised per row, which is
    again a softmax over j, of l_ij = 2 s_ij - c_j with c_j = log sum_i exp(s_ij): taken in the
    log domain, so that a row whose every P_ij underflows (low temperatures) still gets its
    weights, never a fallback to b's centre."""

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dual: bool, budget: int
    ) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():  # under torch.func too, where forward runs with autograd on
            return _SoftAttention._forward(q, k, v, scale, dual, budget)

    @staticmethod
    def _forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dual: bool, budget: int
    ) -> tuple[torch.Tensor, ...]:
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

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        # apart from forward (the log-sum-exps outputs of their own), as torch.func wants it
        q, k, v, scale, dual, budget = inputs
        out, top, lse, col_lse = output
        ctx.save_for_backward(q, k, v, lse, out, *((col_lse,) if dual else ()))
        ctx.scale, ctx.dual, ctx.budget = scale, dual, budget
        ctx.mark_non_differentiable(top, lse, col_lse)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *_no_grads: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, lse, out, *dual_saved = ctx.saved_tensors
        scale = ctx.scale
        na, nb = q.shape[0], k.shape[0]
        shared, ta, tb = _attention_tiles(q, k, ctx.dual, ctx.budget)  # as the forward sized them
        col_lse = dual_saved[0] if ctx.dual else None
        factor = 2.0 if ctx.dual else 1.0
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
        return dq, dk, None, None, None, None


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
    with torch.no_grad():  # a constant of both passes (out= takes no autograd, under torch.func either)
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
