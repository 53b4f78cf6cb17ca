"""Step 1 and 2 of :func:`densematch.align`: the exhaustive grid search (every scale pair of a
fine grid, every integer shift at once through FFT correlations) and the candidates it keeps."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..budget import chunk_rows
from ..kernels import native
from .warp import bilinear_taps, sampling_matrix

__all__ = ["downsample", "grid_search", "pick_candidates", "scale_grid", "shift_errors"]

_CANDIDATES = 8
_SHIFTS = 3  # local minima over the shifts kept per scale pair
_CPU_CHUNK = 64 * 2**20
_MAX_STEP = 0.05
_EDGE_STEP = 1.5
# sampling matrices and band matrices kept: a loop over frames of one size builds none of them again
# after the first call. Only small ones (the coarse levels of images of a few hundred pixels), so
# that what stays held between calls is a few MiB at most
_KEPT = 8
_KEPT_BYTES = 2**20


def scale_grid(lo: float, hi: float, n_pixels: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Scales from lo to hi, so that neighbours move the template's far edge by <= 1 pixel."""
    if hi == lo:
        return torch.tensor([lo], dtype=dtype, device=device)
    step = min(_MAX_STEP, _EDGE_STEP / max(n_pixels, 1))
    n = math.ceil((hi - lo) / step) + 1
    return torch.linspace(lo, hi, n, dtype=dtype, device=device)


def downsample(v: torch.Tensor, factor: int) -> torch.Tensor:
    """Means over factor x factor blocks of v (..., H, W), a power of two, by halving: the rows'
    pairs, then the columns' (several times faster than avg_pool2d on a CPU at these sizes; a
    trailing odd row or column is dropped at each halving, as the blocks' floor division does)."""
    while factor > 1:
        hh, ww = v.shape[-2] // 2 * 2, v.shape[-1] // 2 * 2
        rows = v[..., 0:hh:2, :ww] + v[..., 1:hh:2, :ww]
        v = (rows[..., 0::2] + rows[..., 1::2]) * 0.25
        factor //= 2
    return v


def candidate_rule(
    grid_h: torch.Tensor, grid_w: torch.Tensor, n_s: int
) -> tuple[int, int, tuple[float, float, float, float]]:
    """How many of a grid's best shifts (``n_s`` per scale pair) the candidates are taken from,
    how many are taken, and how near (scale_h, scale_w, shift_y, shift_x) to a taken one a
    candidate is dropped."""
    nh, nw = grid_h.numel(), grid_w.numel()
    step_h = float(grid_h[1] - grid_h[0]) if nh > 1 else 0.0
    step_w = float(grid_w[1] - grid_w[0]) if nw > 1 else 0.0
    n = min(nh * nw * n_s, _CANDIDATES * 8)
    return n, min(_CANDIDATES, n), (1.5 * step_h, 1.5 * step_w, 2.0, 2.0)


def grid_search(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    grid_h: torch.Tensor,
    grid_w: torch.Tensor,
    ncc: bool,
    budget: int,
    in_c: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates (B, M, 4) as (scale_h, scale_w, shift_y, shift_x), the landscape (B, nh, nw)
    and each scale pair's best integer shift (B, nh, nw, 2) as (shift_y, shift_x), NaN where
    the pair has no valid shift. ``in_c``: in C (kernels/align.c) where it runs, as the public
    call resolved it (:func:`densematch.kernels.ops_for`): the whole grid of uniform weights in
    one call (else the best shifts of torch's chunks); the candidates by :func:`pick_candidates`."""
    plan = _plan(tuple(t.shape), tuple(x.shape), mask is not None, grid_h, grid_w, budget, in_c)
    n_x = plan.n_shift[1]
    taps = plan.c_taps
    if taps is not None:  # uniform weights in C: the whole grid in one call
        row_taps, col_taps, max_y, max_x = taps
        best, where = native.align_grid(x, t, row_taps, col_taps, plan.n_shift, max_y, max_x, ncc, plan.minima)
    else:
        best, where = grid_minima(t, x, mask, ncc, plan, in_c)
    at = torch.stack((where[..., 0] // n_x, where[..., 0] % n_x), -1).to(grid_h.dtype)
    shifts = at.masked_fill(~torch.isfinite(best[..., :1]), math.nan)
    return pick_candidates(best, where, grid_h, grid_w, n_x), best[..., 0], shifts


def grid_minima(
    t: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, ncc: bool, plan: _Plan, in_c: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each scale pair's _SHIFTS best local minima over the shifts (B, nh, nw, _SHIFTS) and their
    flat shift indices (:func:`_best_shifts`), from the scores of ``plan``'s chunks in torch."""
    # the chunks come pair by pair, then scale_h by scale_w: nested in that order again
    grouped: dict[int, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
    for (s, r, _col), score in _chunks(t, x, mask, ncc, plan):
        grouped.setdefault(s, {}).setdefault(r, []).append(_best_shifts(score, in_c))

    def joined(i: int) -> torch.Tensor:  # the best values (0) or their indices (1), whole
        by_pair = [torch.cat([torch.cat([bw[i] for bw in row], 2) for row in g.values()], 1) for g in grouped.values()]
        return torch.cat(by_pair)

    return joined(0), joined(1)


def shift_errors(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    scale_h: float,
    scale_w: float,
    ncc: bool,
    budget: int,
    in_c: bool = False,
) -> torch.Tensor:
    """(B, n_y, n_x): the grid search's score (weighted squared error, or 1 - NCC) at every
    integer shift of one scale pair: the landscape over the shifts, for pictures (``in_c``: as
    in :func:`grid_search`)."""
    grid_h = torch.tensor([scale_h], dtype=x.dtype, device=x.device)
    grid_w = torch.tensor([scale_w], dtype=x.dtype, device=x.device)
    plan = _plan(tuple(t.shape), tuple(x.shape), mask is not None, grid_h, grid_w, budget, in_c)
    parts = _chunks(t, x, mask, ncc, plan)
    return torch.cat([score[:, 0, 0] for _, score in parts])  # one scale pair: chunks of pairs, in order


@dataclass(frozen=True)
class _Plan:
    """How :func:`grid_search` and :func:`shift_errors` take a grid: the shifts (n_y, n_x), the
    largest valid one per scale_h and scale_w (max_y (nh,), max_x (nw,)), the FFT size, whether
    products cost less than transforms, the sampling matrices Ry (nh, rows, H) and Rx (nw, cols,
    W), for C their two taps per row (i0, i1, w0, w1, each (nh, rows) or (nw, cols)), and the
    chunks' pairs, scale_h and scale_w that fit the budget."""

    n_shift: tuple[int, int]
    max_y: torch.Tensor
    max_x: torch.Tensor
    fft_size: tuple[int, int]
    products: bool
    ry: torch.Tensor
    rx: torch.Tensor
    row_taps: tuple[torch.Tensor, ...] | None
    col_taps: tuple[torch.Tensor, ...] | None
    steps: tuple[int, int, int]

    @property
    def minima(self) -> int:
        """The local minima kept per scale pair: _SHIFTS, or every shift where there are fewer."""
        return min(_SHIFTS, self.n_shift[0] * self.n_shift[1])

    @property
    def c_taps(
        self,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor] | None:
        """Where C searches the whole grid (uniform weights whose products cost less than
        transforms, with C's taps made): Ry's and Rx's taps and the largest valid shifts
        (max_y, max_x); else None."""
        if self.products and self.row_taps is not None and self.col_taps is not None:
            return self.row_taps, self.col_taps, self.max_y, self.max_x
        return None


def _plan(
    t_shape: tuple[int, ...],
    x_shape: tuple[int, ...],
    weighted: bool,
    grid_h: torch.Tensor,
    grid_w: torch.Tensor,
    budget: int,
    in_c: bool,
) -> _Plan:
    """The :class:`_Plan` of a grid ``grid_h`` x ``grid_w`` (their dtype and device the
    search's) for templates (B, C, h, w) ``t_shape`` in images ``x_shape``, ``weighted`` by a
    mask or not (a ValueError where ``budget`` holds not one scale pair of one pair beside the
    sampling matrices)."""
    b, c, h, w = t_shape
    hh, ww = x_shape[-2:]
    device, dtype = grid_h.device, grid_h.dtype
    # a few dozen scales: numpy's operations on the host, where torch's would cost several times
    # more; in the grid's dtype, as its float32 products round (0.9 * 60 is 54 there)
    on_host_h, on_host_w = grid_h.cpu().numpy(), grid_w.cpu().numpy()
    scales_h, scales_w = on_host_h.tolist(), on_host_w.tolist()
    nh, nw = len(scales_h), len(scales_w)
    top_h, top_w = max(scales_h), max(scales_w)
    # valid integer shifts: 0 <= s <= H * scale - h
    # (at least 0: a coarse level's truncated image may miss the fit by a fraction of a pixel)
    last_y = np.maximum(np.floor(hh * on_host_h - h + 1e-6), 0).astype(np.int64)
    last_x = np.maximum(np.floor(ww * on_host_w - w + 1e-6), 0).astype(np.int64)
    n_y, n_x = int(last_y.max()) + 1, int(last_x.max()) + 1
    max_y, max_x = torch.from_numpy(last_y).to(device), torch.from_numpy(last_x).to(device)
    # rows and columns of the stretched image that any valid crop can touch: every valid shift's
    # window among them, whichever way its scale's product rounded
    rows = max(math.floor(hh * top_h + 1e-6), n_y + h - 1)
    cols = max(math.floor(ww * top_w + 1e-6), n_x + w - 1)
    # FFT size covering every crop without wrap-around, rounded up to a fast length
    fh, fw = _fast_length(rows), _fast_length(cols)
    item = grid_h.element_size()
    products = not weighted and _products_cheaper(t_shape, ww, nh, nw, (n_y, n_x), (fh, fw), in_c)
    if products:  # one pair, one scale pair: its scores' few (n_y, n_x) arrays, and its share of
        # its scale_h's Ry X, products over the template's rows and window sums over them
        per_pair = item * (8 * n_y * n_x + math.ceil((c * (rows + n_y * h) + 4 * n_y) * ww / nw))
    else:  # the stretched images, their squares and spectra
        per_pair = fh * fw * item * (6 * c + 8)
    what = (
        f"the search of one scale pair of a {hh}x{ww} image stretched up to ({top_h:g}, {top_w:g}), beside "
        "its sampling matrices"
    )
    # held for the whole search: the sampling matrices Ry (nh, rows, H) and Rx (nw, cols, W), and
    # for C their two taps per row (two indices, two weights)
    held = item * (nh * rows * hh + nw * cols * ww) + ((nh * rows + nw * cols) * 2 * (8 + item) if in_c else 0)
    chunk_rows(budget, per_pair, what, fixed=held, fix="raise memory or narrow the scale ranges")
    budget -= held
    key = (tuple(scales_h), tuple(scales_w), (rows, cols), (hh, ww), in_c, device, dtype)
    ry, rx, row_taps, col_taps = (_kept_samplers if held <= _KEPT_BYTES else _samplers)(*key)
    # on a CPU, chunks past a few tens of MiB fall out of cache and run slower per pair
    cap = budget if device.type == "cuda" else max(per_pair, min(budget, _CPU_CHUNK))
    pairs = chunk_rows(cap, per_pair, what)
    step_w = min(nw, pairs)
    step_h = min(nh, max(1, pairs // step_w))
    step_b = max(1, min(b, pairs // (nh * nw)))
    steps = (step_b, step_h, step_w)
    return _Plan((n_y, n_x), max_y, max_x, (fh, fw), products, ry, rx, row_taps, col_taps, steps)


def _chunks(
    t: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, ncc: bool, plan: _Plan
) -> Iterator[tuple[tuple[int, int, int], torch.Tensor]]:
    """The scores (B', nh', nw', n_y, n_x) of every scale pair of the grid at every integer shift
    (inf where invalid), in the chunks of ``plan``, each with the first (pair, scale_h, scale_w)
    it holds, in that order."""
    b, _c, h, w = t.shape
    uniform = mask is None
    whole = torch.ones(b, 1, h, w, dtype=t.dtype, device=t.device) if mask is None else mask
    n_y, n_x = plan.n_shift
    ok_y = torch.arange(n_y, device=x.device) <= plan.max_y[:, None]  # (nh, n_y)
    ok_x = torch.arange(n_x, device=x.device) <= plan.max_x[:, None]  # (nw, n_x)
    step_b, step_h, step_w = plan.steps
    for s in range(0, b, step_b):
        for r in range(0, plan.max_y.numel(), step_h):
            for col in range(0, plan.max_x.numel(), step_w):
                e, q, v = min(b, s + step_b), slice(r, r + step_h), slice(col, col + step_w)
                part_taps = None if plan.col_taps is None else tuple(tap[v] for tap in plan.col_taps)
                args = (plan.ry[q], plan.rx[v], plan.fft_size, plan.n_shift, ncc, uniform, plan.products, part_taps)
                valid = ok_y[q, None, :, None] & ok_x[None, v, None, :]  # (step_h, step_w, n_y, n_x)
                yield (s, r, col), _shift_scores(t[s:e], x[s:e], whole[s:e], *args).masked_fill(~valid, math.inf)


def _samplers(
    scales_h: tuple[float, ...],
    scales_w: tuple[float, ...],
    out: tuple[int, int],
    image: tuple[int, int],
    in_c: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """The grid's sampling matrices Ry (nh, rows, H) and Rx (nw, cols, W) of the image's ``out``
    = (rows, cols) stretched by the scales ``scales_h`` x ``scales_w``, and for C Ry's and Rx's
    two taps per row; read-only (:func:`_kept_samplers` keeps small ones, made outside inference
    mode so that a later call with autograd on may read them too)."""
    (rows, cols), (hh, ww) = out, image
    with torch.inference_mode(False):
        grid_h = torch.tensor(scales_h, dtype=dtype, device=device)
        grid_w = torch.tensor(scales_w, dtype=dtype, device=device)
        zeros_h, zeros_w = torch.zeros_like(grid_h), torch.zeros_like(grid_w)
        ry = sampling_matrix(rows, hh, grid_h, zeros_h)
        rx = sampling_matrix(cols, ww, grid_w, zeros_w)
        if not in_c:
            return ry, rx, None, None
        return ry, rx, bilinear_taps(rows, hh, grid_h, zeros_h), bilinear_taps(cols, ww, grid_w, zeros_w)


_kept_samplers = functools.lru_cache(maxsize=_KEPT)(_samplers)


def _fast_length(n: int) -> int:
    """The smallest length >= n whose only prime factors are 2, 3 and 5 (fast FFT sizes)."""
    while True:
        m = n
        for f in (2, 3, 5):
            while m % f == 0:
                m //= f
        if m == 1:
            return n
        n += 1


def _window_sums(v: torch.Tensor, size: tuple[int, int], n_shift: tuple[int, int]) -> torch.Tensor:
    """Sums of v (..., rows, cols) over every (h, w) window at shifts [0, n_y) x [0, n_x), as
    two products with 0/1 band matrices: exact sums of the window's values (an integral image's
    differences cancel), and far faster than cumsum along a strided axis."""
    (h, w), (ny, nx) = size, n_shift
    *lead, rows, cols = v.shape
    # each as one matrix product over every window row (a batch of small products runs slower)
    along_x = (v.reshape(-1, cols) @ _band(cols, w, nx, v)).reshape(-1, rows, nx)
    both = along_x.transpose(1, 2).reshape(-1, rows) @ _band(rows, h, ny, v)  # (N n_x, n_y)
    return both.reshape(-1, nx, ny).transpose(1, 2).reshape(*lead, ny, nx)


def _band(n: int, width: int, n_shift: int, like: torch.Tensor) -> torch.Tensor:
    """(n, n_shift): 1 where j lies in the window [s, s + width) of shift s (read-only)."""
    small = n * n_shift * like.element_size() <= _KEPT_BYTES
    return (_kept_band if small else _build_band)(n, width, n_shift, like.device, like.dtype)


def _build_band(n: int, width: int, n_shift: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):  # kept ones may be read later with autograd on
        j = torch.arange(n, device=device)[:, None]
        s = torch.arange(n_shift, device=device)[None, :]
        return ((j >= s) & (j < s + width)).to(dtype)


_kept_band = functools.lru_cache(maxsize=_KEPT)(_build_band)


def _shift_scores(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    ry: torch.Tensor,
    rx: torch.Tensor,
    fft_size: tuple[int, int],
    n_shift: tuple[int, int],
    ncc: bool,
    uniform: bool,
    products: bool,
    taps: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """(B, nh, nw, n_y, n_x): weighted squared error, or 1 - NCC, at every integer shift.

    sum_w (T - S)^2 = sum_w T^2 - 2 sum_w T S + sum_w S^2. Uniform weights, where products
    cost less than transforms (``products``, decided once per call by :func:`grid_search`, which
    sizes its chunks by it): the cross term and the window sums of S and S^2 from Ry X and
    Rx's taps (:func:`_cross_by_products`, :func:`_window_moments`), no stretched image built.
    Otherwise: the cross term an FFT correlation, the sums of S^2 (and S) window sums of the
    stretched image, or correlations with the weights. With Rx's ``taps``, uniform weights'
    scores in C (:func:`densematch.kernels.native.align_scores`: the same sums in one pass).
    """
    _b, c, h, w = t.shape
    along_y = torch.einsum("hrH,bcHW->bchrW", ry, x)  # (B, C, nh, rows, W)
    if products and taps is not None:  # every term and the score in one pass of C
        return native.align_scores(along_y.contiguous(), t.contiguous(), taps, n_shift, ncc)
    wt = mask * t
    if products:
        # nothing stretched is built: every sum comes from along_y and Rx's columns
        cross = _cross_by_products(t, along_y, rx, n_shift)
        energy, plain = _window_moments(along_y, rx, (h, w), n_shift, ncc)  # sum_w S^2, sum_w S
    else:
        # stretched images (B, C, nh, nw, rows, cols)
        s = torch.einsum("bchrW,wkW->bchwrk", along_y, rx)

        def spec(v: torch.Tensor) -> torch.Tensor:
            return torch.fft.rfft2(v, s=fft_size)

        def corr(img_spec: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
            # circular cross-correlation, valid for shifts that keep the kernel inside the image
            k = spec(kernel)[:, :, None, None].conj()
            out = torch.fft.irfft2(img_spec * k, s=fft_size)
            return out[..., : n_shift[0], : n_shift[1]]

        def weighted_sum(v: torch.Tensor) -> torch.Tensor:  # sum_w v over the window at each shift
            if uniform:
                return _window_sums(v, (h, w), n_shift).sum(1)
            return corr(spec(v), mask.expand_as(t)).sum(1)

        cross = corr(spec(s), wt).sum(1)
        energy = weighted_sum(s * s)
        plain = weighted_sum(s) if ncc else None
    total = mask.sum((1, 2, 3)) * c  # sum of weights over pixels and channels
    if not ncc:
        tt = (wt * t).sum((1, 2, 3))
        return (tt[:, None, None, None, None] - 2 * cross + energy).clamp_min(0) / total[:, None, None, None, None]
    assert plain is not None  # computed for ncc on both paths
    mean_s = plain / total[:, None, None, None, None]
    mean_t = wt.sum((1, 2, 3)) / total
    var_t = (wt * t).sum((1, 2, 3)) / total - mean_t**2
    cov = cross / total[:, None, None, None, None] - mean_s * mean_t[:, None, None, None, None]
    var_s = (energy / total[:, None, None, None, None] - mean_s**2).clamp_min(0)
    denom = (var_s * var_t[:, None, None, None, None]).sqrt().clamp_min(1e-12)
    return 1 - cov / denom


def _best_shifts(score: torch.Tensor, in_c: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scale pair of ``score`` (B, nh, nw, n_y, n_x), the _SHIFTS lowest local minima over
    the shifts, (B, nh, nw, _SHIFTS) scores (inf where fewer) and flat shift indices: a
    periodic texture has several good shifts at one scale, and the truth need not be the best
    at the coarse level. ``in_c``: in one pass of C (:func:`densematch.kernels.native.align_best_shifts`)."""
    b, nh, nw, ny, nx = score.shape
    if in_c:
        return native.align_best_shifts(score.contiguous(), min(_SHIFTS, ny * nx))
    padded = F.pad(score, (1, 1, 1, 1), value=math.inf)
    # the 3 x 3 neighbourhood's lowest, in two passes (max_pool2d is far slower on such sizes)
    lowest = torch.minimum(torch.minimum(padded[..., :-2], padded[..., 1:-1]), padded[..., 2:])
    lowest = torch.minimum(torch.minimum(lowest[..., :-2, :], lowest[..., 1:-1, :]), lowest[..., 2:, :])
    minima = torch.where(score <= lowest, score, math.inf).reshape(b, nh, nw, ny * nx)
    # the k lowest by k passes of min (topk costs ~2x as much on these short rows)
    best, where = [], []
    for i in range(min(_SHIFTS, ny * nx)):
        value, at = minima.min(dim=3, keepdim=True)
        best.append(value)
        where.append(at)
        if i + 1 < _SHIFTS:
            minima.scatter_(3, at, math.inf)
    return torch.cat(best, 3), torch.cat(where, 3)


def _window_moments(
    along_y: torch.Tensor, rx: torch.Tensor, size: tuple[int, int], n_shift: tuple[int, int], with_sum: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Window sums of S^2 (and of S) over channels, (B, nh, nw, n_y, n_x), for S = A Rx^T with
    A = ``along_y`` (B, C, nh, rows, W), without S. Each row of Rx holds at most two adjacent
    taps (a, b at j, j + 1), so S_k^2 = sum_j Rx_kj^2 A_j^2 + 2 Rx_kj Rx_k(j+1) A_j A_(j+1): the
    window over rows is summed on A^2 and A_j A_(j+1) (band products), the window over columns
    on Rx's squared and paired taps, and the two meet in one matrix product per term."""
    b, _c, nh, rows, big_w = along_y.shape
    nw = rx.shape[0]
    (h, w), (ny, nx) = size, n_shift
    band_y = _band(rows, h, ny, along_y)  # (rows, n_y)
    cols = _band(rx.shape[1], w, nx, rx)  # (cols, n_x)

    def rows_summed(v: torch.Tensor) -> torch.Tensor:  # (B, C, nh, rows, W') -> (B nh n_y, W')
        out = (v.transpose(-1, -2) @ band_y).sum(1)  # (B, nh, W', n_y)
        return out.transpose(-1, -2).reshape(b * nh * ny, v.shape[-1])

    def cols_summed(taps: torch.Tensor) -> torch.Tensor:  # (nw, cols, W') -> (nw n_x, W')
        return torch.einsum("nkW,kx->nxW", taps, cols).reshape(nw * nx, taps.shape[-1])

    def meet(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return (left @ right.T).reshape(b, nh, ny, nw, nx).transpose(2, 3)

    pairs = along_y[..., :-1] * along_y[..., 1:]
    energy = meet(rows_summed(along_y.square()), cols_summed(rx.square()))
    if big_w > 1:
        energy = energy + meet(rows_summed(pairs), cols_summed(2 * rx[..., :-1] * rx[..., 1:]))
    total = meet(rows_summed(along_y), cols_summed(rx)) if with_sum else None
    return energy, total


def _products_cheaper(
    t: tuple[int, ...],
    big_w: int,
    nh: int,
    nw: int,
    n_shift: tuple[int, int],
    fft_size: tuple[int, int],
    in_c: bool = False,
) -> bool:
    """Whether the products' multiply-adds cost less than the FFT correlation's transforms,
    counting a transform's flops at 4x a matrix product's (small batched FFTs run far from a
    CPU's peak; BLAS runs near it): torch's :func:`_cross_by_products`, or with ``in_c`` C's
    whole grid (:func:`densematch.kernels.native.align_grid`: the template's rows against Ry X
    at each row shift, then 2 w taps per output), taken up to 8x them: at 1.4-4x their counted
    flops (the masks' coarse levels, fine textures searched at full resolution) it ran 2-4x
    faster than the transforms (benchmarks/history/2026-12-06-issue-41-align-s-search-in-c.md)."""
    b, c, h, w = t
    ny, nx = n_shift
    fft = b * c * nh * nw * fft_size[0] * fft_size[1] * math.log2(fft_size[0] * fft_size[1]) * 2.5
    if in_c:
        return b * nh * ny * w * (c * big_w * h + 2 * nw * nx) <= 8 * fft
    products = b * c * nh * ny * w * big_w * (h + nw * nx)
    return products <= 4 * fft


def _cross_by_products(
    t: torch.Tensor, along_y: torch.Tensor, rx: torch.Tensor, n_shift: tuple[int, int]
) -> torch.Tensor:
    """(B, nh, nw, n_y, n_x) sums over pixels and channels of T times the stretched image S at
    every shift, as two matrix products: S = Ry X Rx^T is separable, so the sum over the
    template's rows is taken on ``along_y`` = Ry X (B, C, nh, rows, W) first (P, for each row
    shift), then P meets each (scale_w, column shift)'s columns of Rx: (h + nw n_x) w W
    multiply-adds per (scale_h, row shift), against an FFT correlation per scale pair."""
    b, _c, h, w = t.shape
    nh, nw, big_w = along_y.shape[2], rx.shape[0], along_y.shape[-1]
    ny, nx = n_shift
    rows = along_y.unfold(3, h, 1)[:, :, :, :ny]  # (B, C, nh, ny, W, h)
    # (W, k) in the order einsum writes and unfold views: both flatten without a copy
    p = torch.einsum("bcnyWr,bcrk->bnyWk", rows, t).reshape(b, nh * ny, big_w * w)
    cols = rx.unfold(1, w, 1)[:, :nx].reshape(nw * nx, big_w * w)
    return (p @ cols.T).reshape(b, nh, ny, nw, nx).transpose(2, 3)


def pick_candidates(
    best: torch.Tensor, where: torch.Tensor, grid_h: torch.Tensor, grid_w: torch.Tensor, n_x: int
) -> torch.Tensor:
    """_CANDIDATES distinct candidates (B, M, 4) as (scale_h, scale_w, shift_y, shift_x): the
    lowest of the scale pairs' best shifts (``best``, ``where``: (B, nh, nw, S)), greedily, each
    farther than one grid step in scale or two pixels in shift from those taken before (C's
    search takes them by the same rule, :func:`densematch.kernels.native.align_search`)."""
    b, _nh, nw, n_s = best.shape
    n, m, near = candidate_rule(grid_h, grid_w, n_s)
    flat = best.reshape(b, -1)
    score, idx = flat.topk(n, dim=1, largest=False)
    pair, shift = idx // n_s, where.reshape(b, -1).gather(1, idx)
    params = torch.stack(
        (
            grid_h[pair // nw],
            grid_w[pair % nw],
            (shift // n_x).to(grid_h.dtype),
            (shift % n_x).to(grid_h.dtype),
        ),
        dim=-1,
    )  # (B, n, 4)
    # a few dozen rows per pair, every pair at once: numpy's per-operation cost is a small part of torch's
    p, alive = params.cpu().numpy(), np.isfinite(score.cpu().numpy())
    taken = np.zeros((b, m), dtype=np.int64)
    pairs = np.arange(b)
    for k in range(taken.shape[1]):
        j = alive.argmax(1)  # the rows are sorted: the first left (where none is, the best again)
        taken[:, k] = j
        alive &= ~(np.abs(p - p[pairs, j][:, None]) <= np.array(near)).all(-1)
    return params[torch.arange(b, device=best.device)[:, None], torch.from_numpy(taken).to(best.device)]
