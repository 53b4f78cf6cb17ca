"""Bindings of align.c and certify.c (:mod:`densematch.kernels.native` holds them all): the
alignment's refinement steps, the grid's cross terms, scores and best shifts, the warp, and the certificate's
bound per cell."""

from __future__ import annotations

import numpy as np
import torch

from ..checks import not_finite
from .loader import _SUFFIX, _loaded, _require

__all__ = [
    "AlignGrid",
    "align_band",
    "align_best_shifts",
    "align_cross",
    "align_grid",
    "align_pick",
    "align_refine",
    "align_scores",
    "align_search",
    "align_warp",
    "certify_bound",
]


def _within(v: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether every value of the integer tensor ``v`` lies in [lo, hi] (one pass; True if empty)."""
    if v.numel() == 0:
        return True
    least, most = torch.aminmax(v)
    return lo <= int(least) and int(most) <= hi


def align_refine(
    t: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    owner: torch.Tensor,
    params: torch.Tensor,
    ranges: tuple[float, float, float, float],
    iterations: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt for align's candidates (align.c), each from its start to its end.

    ``t`` (B, C, h, w), ``x`` (B, C, H, W) and ``weights`` (B, h, w), or (1, h, w) shared by the
    pairs, float64; candidate i fits
    template ``owner[i]`` into its image, starting at ``params[i]`` (M, 4), or (M, 6) with gain
    and bias; scales kept in ``ranges`` (lo_h, hi_h, lo_w, hi_w). Returns the parameters (M, P)
    and each one's weighted sums of squared and of absolute residuals (M, 2). On this thread."""
    lib = _loaded("align_refine", t, x, weights, owner, params)
    b, c, h, w = t.shape
    m, n_par = params.shape
    _require(
        all(v.dtype == torch.float64 and v.is_contiguous() for v in (t, x, weights, params))
        and x.shape[:2] == (b, c)
        and weights.shape in ((b, h, w), (1, h, w))
        and n_par in (4, 6),
        "t, x, weights and params must be contiguous float64 (B, C, h, w), (B, C, H, W), (B or 1, h, w), (M, 4 or 6)",
    )
    owner = owner.to(torch.int64).contiguous()
    _require(owner.shape == (m,) and bool(((owner >= 0) & (owner < b)).all()), "owner must hold M pair indices")
    p = params.clone()
    out = torch.empty(m, 2, dtype=torch.float64)
    box = torch.tensor(ranges, dtype=torch.float64)
    failed = lib.dm_align_refine(
        t.data_ptr(), x.data_ptr(), weights.data_ptr(), weights.shape[0] != b, c, h, w, x.shape[2], x.shape[3],
        owner.data_ptr(), m, n_par, box.data_ptr(), iterations, tolerance, p.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("densematch's C kernels: align_refine could not allocate its scratch")
    return p, out


class AlignGrid:
    """align's coarsest-level grid as :func:`align_search` reads it, checked once, so that a loop
    over pairs of one size checks it once: the scales ``grid_h`` (nh,) and ``grid_w`` (nw,), the
    integer shifts ``n_shift`` (n_y, n_x) of a template of ``tpl`` (h, w) pixels in an image of
    ``image`` (H, W) at that level, in ``dtype``. With ``taps`` (Ry's i0, i1, w0, w1, each (nh,
    rows); Rx's, each (nw, cols), :func:`densematch.alignment.warp.bilinear_taps`; the largest
    valid shifts max_y (nh,) and max_x (nw,)) C searches the grid itself, keeping ``kept`` minima
    per scale pair; without them the minima come to :func:`align_search` as ``given``. It holds
    copies of its own: a later change to the tensors it was made from does not reach it."""

    def __init__(
        self,
        grid_h: torch.Tensor,
        grid_w: torch.Tensor,
        n_shift: tuple[int, int],
        tpl: tuple[int, int],
        image: tuple[int, int],
        dtype: torch.dtype,
        taps: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor] | None = None,
        kept: int = 3,
    ) -> None:
        _require(
            dtype in _SUFFIX and min(*n_shift, *tpl, *image, kept, grid_h.numel(), grid_w.numel()) >= 1,
            "a float dtype, and n_shift, tpl, image, kept and the scales all positive",
        )
        self.grid_h, self.grid_w = (v.detach().to("cpu", torch.float64).reshape(-1).clone() for v in (grid_h, grid_w))
        self.n_shift, self.tpl, self.image, self.dtype, self.kept = n_shift, tpl, image, dtype, kept
        self.taps: tuple[torch.Tensor, ...] | None = None
        self.rows = self.cols = 0
        # the addresses align_search hands C, taken once: the taps' (None without them), the scales'
        self.pointers: list[int | None] = [None] * 10 + [self.grid_h.data_ptr(), self.grid_w.data_ptr()]
        if taps is None:
            return
        row_taps, col_taps, max_y, max_x = taps
        _loaded("AlignGrid", row_taps, col_taps, max_y, max_x)
        one_per_scale = row_taps[0].ndim == 2 and row_taps[0].shape[0] == self.grid_h.numel()
        _require(one_per_scale, "Ry's taps, one row per scale_h")
        _rows_check(dtype, row_taps, (max_y, max_x), self.grid_w.numel(), image[0])
        self.rows = row_taps[0].shape[-1]
        col_taps = tuple(v.contiguous() for v in col_taps)
        self.cols = col_taps[0].shape[-1]
        _grid_check(dtype, tpl, col_taps, (self.rows, image[1]), n_shift)
        self.taps = tuple(v.contiguous().clone() for v in (*row_taps, *col_taps, max_y, max_x))
        self.pointers[:10] = [v.data_ptr() for v in self.taps]


def align_search(
    t: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor | None,
    total: torch.Tensor | None,
    grid: AlignGrid,
    *,
    levels: int,
    given: tuple[torch.Tensor, torch.Tensor] | None = None,
    pick: int,
    candidates: int,
    keep: tuple[int, int],
    objective: int,
    iterations: int,
    ranges: tuple[float, float, float, float],
    near: tuple[float, float, float, float],
    same: tuple[float, float],
    tolerance: tuple[float, float],
    far: float,
) -> tuple[torch.Tensor, ...]:
    """align's whole search in one call (align.c: dm_align_search), pair by pair: the pyramid of
    ``levels`` levels (each halving the one below), the grid at its coarsest level, the candidates,
    their refinement down the pyramid, the far ones refined again (blurred, then sharp), the best
    by the objective and its warp.

    ``t`` (B, C, h, w) and ``x`` (B, C, H, W), float32 or float64; ``weights`` (B, h, w), or
    (1, h, w) shared, or None for uniform ones, and ``total`` (B,) their sums times C, of that
    dtype (None with uniform weights: C h w). ``grid`` (:class:`AlignGrid`, made for the coarsest
    level's sizes and this dtype): C searches it where it has its taps; else ``given`` are its
    minima (B, nh, nw, K) and their flat shift indices, found elsewhere. ``pick`` and
    ``candidates``, ``keep`` (after the coarsest level, after the others), ``objective`` (0 "l1",
    1 "l2", 2 "ncc": gain and bias), ``iterations``, the scale ``ranges`` (lo_h, hi_h, lo_w,
    hi_w), ``near`` (the candidates' spacing), ``same`` (twins), ``tolerance`` (coarse levels,
    full resolution) and ``far`` as :func:`densematch.alignment.api._search` names them.

    Each pair is searched at unit amplitude (less its image's mean level per channel, times a
    power of two), and everything it returns is in its own units: the answers (B, 4) (scale_h,
    scale_w, shift_y, shift_x), their errors (B,), the warps (B, C, h, w), the landscape (B, nh,
    nw), each scale pair's best shift (B, nh, nw, 2) in full-resolution pixels (NaN where none) and
    the errors against the template's own spread (B,). On this thread."""
    lib = _loaded("align_search", t, x, weights, total, given)
    b, c, h, w = t.shape
    big_h, big_w = x.shape[-2:]
    nh, nw = grid.grid_h.numel(), grid.grid_w.numel()
    _require(
        t.dtype == x.dtype == grid.dtype
        and x.shape[:2] == (b, c)
        and (total.dtype == t.dtype and total.shape == (b,) if total is not None else weights is None)
        and 1 <= levels <= 62
        and (weights is None or (weights.dtype == t.dtype and weights.shape in ((b, h, w), (1, h, w))))
        and objective in (0, 1, 2)
        and min(pick, candidates, *keep, iterations) >= 1,
        "t (B, C, h, w), x (B, C, H, W), weights (B or 1, h, w) and total (B,) of the grid's float dtype (total "
        "None only without weights), objective 0, 1 or 2",
    )
    coarse = tuple(v >> (levels - 1) for v in (h, w, big_h, big_w))
    _require(
        grid.tpl == coarse[:2] and grid.image == coarse[2:],
        f"grid must be made for the coarsest level's template {coarse[:2]} and image {coarse[2:]}",
    )
    _require((grid.taps is None) == (given is not None), "one of the grid's taps and given")
    if given is None:
        k = grid.kept
        best = torch.empty(b, nh, nw, k, dtype=t.dtype)
        where = torch.empty(b, nh, nw, k, dtype=torch.int64)
    else:
        best, where = (v.contiguous() for v in given)
        k = best.shape[-1]
        _require(
            best.shape == where.shape and best.shape[:3] == (b, nh, nw) and best.dtype == t.dtype,
            "given must be the best shifts (B, nh, nw, K) in t's dtype and their flat indices",
        )
    _require(pick <= nh * nw * k and candidates <= pick, "candidates <= pick <= nh nw K")
    sizes = np.array(
        (b, c, h, w, big_h, big_w, levels, given is not None, weights is not None and weights.shape[0] != b,
         nh, grid.rows, nw, grid.cols, *grid.n_shift, k, pick, candidates, *keep, objective, iterations),
        dtype=np.int64,
    )  # fmt: skip
    reals = np.array((*ranges, *near, *same, tolerance[1], tolerance[0], far), dtype=np.float64)
    t, x = t.contiguous(), x.contiguous()
    wt = None if weights is None else weights.contiguous()
    total = None if total is None else total.contiguous()
    landscape = torch.empty(b, nh, nw, dtype=t.dtype)
    shifts = torch.empty(b, nh, nw, 2, dtype=t.dtype)
    answer, error = torch.empty(b, 4, dtype=t.dtype), torch.empty(b, dtype=t.dtype)
    warped, relative = torch.empty(b, c, h, w, dtype=t.dtype), torch.empty(b, dtype=t.dtype)
    failed = getattr(lib, f"dm_align_search_{_SUFFIX[t.dtype]}")(
        t.data_ptr(), x.data_ptr(), None if wt is None else wt.data_ptr(), None if total is None else total.data_ptr(),
        sizes.ctypes.data, reals.ctypes.data, *grid.pointers, best.data_ptr(), where.data_ptr(), landscape.data_ptr(),
        shifts.data_ptr(), answer.data_ptr(), error.data_ptr(), warped.data_ptr(), relative.data_ptr(),
    )  # fmt: skip
    if failed:
        if failed in (2, 3):  # checked in C before anything else, as check_finite would have
            raise ValueError(not_finite("template" if failed == 2 else "image"))
        raise MemoryError("densematch's C kernels: align_search could not allocate its scratch")
    return answer, error, warped, landscape, shifts, relative


def align_cross(
    along_y: torch.Tensor, t: torch.Tensor, taps: tuple[torch.Tensor, ...], n_shift: tuple[int, int]
) -> torch.Tensor:
    """align's cross term (align.c): (B, nh, nw, n_y, n_x) sums over the template's pixels and
    channels of T times the stretched image at every integer shift, from ``along_y`` = Ry X
    (B, C, nh, rows, W), the template ``t`` (B, C, h, w) and Rx's taps (i0, i1, w0, w1), each
    (nw, cols) (:func:`densematch.alignment.warp.bilinear_taps`). float32 or float64."""
    return _grid("align_cross", along_y, t, taps, n_shift)


def align_scores(
    along_y: torch.Tensor, t: torch.Tensor, taps: tuple[torch.Tensor, ...], n_shift: tuple[int, int], ncc: bool
) -> torch.Tensor:
    """align's grid scores for uniform weights (align.c), (B, nh, nw, n_y, n_x): at every integer
    shift the mean squared error between the template and the stretched image's window, or with
    ``ncc`` 1 - their normalised cross-correlation; operands as :func:`align_cross` takes them."""
    return _grid("align_scores", along_y, t, taps, n_shift, int(ncc))


def align_grid(
    x: torch.Tensor,
    t: torch.Tensor,
    row_taps: tuple[torch.Tensor, ...],
    col_taps: tuple[torch.Tensor, ...],
    n_shift: tuple[int, int],
    max_y: torch.Tensor,
    max_x: torch.Tensor,
    ncc: bool,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """align's whole grid for uniform weights in one call (align.c): the images ``x`` (B, C, H, W)
    stretched by Ry's and Rx's taps (i0, i1, w0, w1: (nh, rows) and (nw, cols),
    :func:`densematch.alignment.warp.bilinear_taps`), :func:`align_scores` against the template
    ``t`` (B, C, h, w) at every shift (n_y, n_x), inf past ``max_y`` (nh,) and ``max_x`` (nw,), and
    each scale pair's ``k`` best local minima as :func:`align_best_shifts` gives them: (B, nh, nw,
    k) scores and flat shift indices. float32 or float64; the scores are never all held."""
    lib = _loaded("align_grid", x, t, row_taps, col_taps, max_y, max_x)
    b, c, big_h, big_w = x.shape
    h, w = t.shape[-2:]
    nh, rows = row_taps[0].shape
    nw = col_taps[0].shape[0]
    ny, nx = n_shift
    _require(
        t.shape[:2] == (b, c) and t.dtype == x.dtype and k >= 1, "x (B, C, H, W), t (B, C, h, w) of one dtype, k >= 1"
    )
    _rows_check(x.dtype, row_taps, (max_y, max_x), nw, big_h)
    x, t = x.contiguous(), t.contiguous()
    _grid_check(x.dtype, (h, w), col_taps, (rows, big_w), n_shift)
    rt = tuple(v.contiguous() for v in row_taps)
    best = torch.empty(b, nh, nw, k, dtype=x.dtype)
    where = torch.empty(b, nh, nw, k, dtype=torch.int64)
    limits = (max_y.contiguous(), max_x.contiguous())
    failed = getattr(lib, f"dm_align_grid_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), t.data_ptr(), *(v.data_ptr() for v in rt), *(v.data_ptr() for v in col_taps),
        b, c, big_h, big_w, h, w, nh, rows, nw, col_taps[0].shape[1], ny, nx, *(v.data_ptr() for v in limits),
        int(ncc), k, best.data_ptr(), where.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("densematch's C kernels: align_grid could not allocate its scratch")
    return best, where


def _grid(
    name: str,
    along_y: torch.Tensor,
    t: torch.Tensor,
    taps: tuple[torch.Tensor, ...],
    n_shift: tuple[int, int],
    *extra: int,
) -> torch.Tensor:
    """align_cross or align_scores, their operands checked once (``extra``: the C call's own)."""
    lib = _loaded(name, along_y, t, taps)
    b, c, nh, rows, big_w = along_y.shape
    h, w = t.shape[-2:]
    nw, cols = taps[0].shape
    ny, nx = n_shift
    _require(
        along_y.is_contiguous() and t.is_contiguous() and t.dtype == along_y.dtype and t.shape[:2] == (b, c),
        "along_y (B, C, nh, rows, W) and t (B, C, h, w) must be contiguous, of one dtype",
    )
    _grid_check(along_y.dtype, (h, w), taps, (rows, big_w), n_shift)
    out = torch.empty(b, nh, nw, ny, nx, dtype=along_y.dtype)
    sizes = (b, c, nh, rows, big_w, h, w, nw, cols, ny, nx)
    ptrs = (along_y.data_ptr(), t.data_ptr(), *(v.data_ptr() for v in taps))
    if getattr(lib, f"dm_{name}_{_SUFFIX[along_y.dtype]}")(*ptrs, *sizes, *extra, out.data_ptr()):
        raise MemoryError(f"densematch's C kernels: {name} could not allocate its scratch")
    return out


def _rows_check(
    dtype: torch.dtype,
    row_taps: tuple[torch.Tensor, ...],
    limits: tuple[torch.Tensor, torch.Tensor],
    nw: int,
    big_h: int,
) -> None:
    """The rules of Ry's taps (i0, i1 int64, w0, w1 of ``dtype``: each (nh, rows)) inside an
    image of ``big_h`` rows, and of the largest valid shifts ``limits``: max_y (nh,) and max_x
    (nw,), int64 (:func:`align_grid` and :class:`AlignGrid`; :func:`_grid_check` checks Rx's)."""
    r0, r1, v0, v1 = row_taps
    max_y, max_x = limits
    nh, rows = r0.shape
    _require(
        all(v.shape == (nh, rows) for v in row_taps)
        and v0.dtype == v1.dtype == dtype
        and r0.dtype == r1.dtype == max_y.dtype == max_x.dtype == torch.int64
        and max_y.shape == (nh,)
        and max_x.shape == (nw,)
        and _within(r0, 0, big_h - 1)
        and _within(r1, 0, big_h - 1),
        "Ry's taps (nh, rows) of the image's dtype inside its rows, max_y (nh,) and max_x (nw,) int64",
    )


def _grid_check(
    dtype: torch.dtype,
    tpl: tuple[int, int],
    taps: tuple[torch.Tensor, ...],
    size: tuple[int, int],
    n_shift: tuple[int, int],
) -> None:
    """The rules align's grid kernels share: the template (h, w) ``tpl``, Rx's taps (nw, cols) of
    one float ``dtype`` and contiguous, inside the ``size`` (rows, W) stretched along y, i1 = i0
    or i0 + 1, every shift's window inside."""
    i0, i1, w0, w1 = taps
    nw, cols = i0.shape
    (rows, big_w), (ny, nx) = size, n_shift
    h, w = tpl
    _require(
        dtype in _SUFFIX
        and all(v.dtype == dtype and v.is_contiguous() for v in (w0, w1))
        and all(v.dtype == torch.int64 and v.is_contiguous() and v.shape == (nw, cols) for v in (i0, i1))
        and w0.shape == w1.shape == (nw, cols)
        and ny + h - 1 <= rows
        and nx + w - 1 <= cols
        and _within(i0, 0, big_w - 1)
        and _within(i1 - i0, 0, 1)
        and _within(i1, 0, big_w - 1),
        "the image, t (B, C, h, w) and taps (nw, cols) must be contiguous, of one float dtype, with every "
        "shift's window inside rows x cols and taps inside W, i1 = i0 or i0 + 1",
    )


def align_best_shifts(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scale pair of align's grid ``score`` (..., n_y, n_x), float32 or float64: the ``k``
    lowest local minima over the shifts (no higher than any of their 8 neighbours), lowest first,
    ties to the lower flat index, and their flat indices, each (..., k); inf and 0 where fewer."""
    lib = _loaded("align_best_shifts", score)
    *lead, ny, nx = score.shape
    _require(score.dtype in _SUFFIX and score.is_contiguous() and k >= 1, "score must be contiguous float, k >= 1")
    best = torch.empty(*lead, k, dtype=score.dtype)
    where = torch.empty(*lead, k, dtype=torch.int64)
    rows = best.numel() // k
    getattr(lib, f"dm_align_best_shifts_{_SUFFIX[score.dtype]}")(
        score.data_ptr(), rows, ny, nx, k, best.data_ptr(), where.data_ptr()
    )
    return best, where


def align_pick(
    best: torch.Tensor,
    where: torch.Tensor,
    grid_h: torch.Tensor,
    grid_w: torch.Tensor,
    n_x: int,
    near: tuple[float, float, float, float],
    n: int,
    m: int,
) -> torch.Tensor:
    """align's candidates from its grid (align.c, as :func:`align_search` takes them), as
    :func:`densematch.alignment.search.pick_candidates` picks them: of each pair's scale pairs'
    best shifts ``best`` (B, nh, nw, S) (flat shift indices ``where``, rows of ``n_x``), the ``n``
    lowest, then ``m`` greedily, each the first left once those within ``near`` (scale_h,
    scale_w, shift_y, shift_x) of one taken are dropped. (B, m, 4) float64."""
    lib = _loaded("align_pick", best, where, grid_h, grid_w)
    b, nh, nw, n_s = best.shape
    _require(
        where.shape == best.shape and where.dtype == torch.int64 and grid_h.shape == (nh,) and grid_w.shape == (nw,),
        "best and where must be (B, nh, nw, S), where int64, grid_h (nh,) and grid_w (nw,)",
    )
    _require(1 <= n <= nh * nw * n_s and m >= 1, "n must lie in [1, nh nw S] and m be positive")
    v, at = best.double().contiguous(), where.contiguous()
    gh, gw, close = grid_h.double().contiguous(), grid_w.double().contiguous(), torch.tensor(near, dtype=torch.float64)
    order, params = torch.empty(n, dtype=torch.int64), torch.empty(n, 4, dtype=torch.float64)
    alive, out = torch.empty(n, dtype=torch.uint8), torch.empty(b, m, 4, dtype=torch.float64)
    lib.dm_align_pick(
        v.data_ptr(), at.data_ptr(), b, nh * nw, n_s, gh.data_ptr(), gw.data_ptr(), nw, n_x, close.data_ptr(), n, m,
        order.data_ptr(), params.data_ptr(), alive.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def align_warp(x: torch.Tensor, params: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """align's warp (align.c): (M, C, h, w) bilinear samples of the images ``x`` (M, C, H, W),
    float32 or float64, each at its ``params`` (M, 4) (scale_h, scale_w, shift_y, shift_x), as
    :func:`densematch.alignment.warp.warp_batch` takes them."""
    lib = _loaded("align_warp", x, params)
    m, c, big_h, big_w = x.shape
    h, w = size
    _require(
        x.dtype in _SUFFIX and x.is_contiguous() and params.shape == (m, 4) and h >= 1 and w >= 1,
        "x must be contiguous float (M, C, H, W), params (M, 4) and the size positive",
    )
    q = params.to(torch.float64).contiguous()
    out = torch.empty(m, c, h, w, dtype=x.dtype)
    if getattr(lib, f"dm_align_warp_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), q.data_ptr(), m, c, big_h, big_w, h, w, out.data_ptr()
    ):
        raise MemoryError("densematch's C kernels: align_warp could not allocate its scratch")
    return out


def align_band(t: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> float:
    """The level rule's band share (align.c), the least over the pairs: each template of ``t``
    (B, C, h, w), float32 or float64, less its weighted mean per channel, times ``weights`` (1 or
    B, h, w), has the power of its band, ``rows`` (2 n_y, h) @ v @ ``cols`` (w, 2 n_x) (cosines,
    then sines), against its energy times h w (:func:`densematch.alignment.api._low_band`, which
    takes the same sums in numpy). ``weights``, ``rows`` and ``cols``: contiguous float64."""
    lib = _loaded("align_band", t, weights, rows, cols)
    b, c, h, w = t.shape
    _require(
        t.dtype in _SUFFIX
        and weights.dtype == rows.dtype == cols.dtype == torch.float64
        and weights.is_contiguous()
        and rows.is_contiguous()
        and cols.is_contiguous()
        and weights.shape in ((1, h, w), (b, h, w))
        and rows.ndim == cols.ndim == 2
        and rows.shape[1] == h
        and cols.shape[0] == w
        and rows.shape[0] % 2 == cols.shape[1] % 2 == 0,
        "t (B, C, h, w) float, weights (1 or B, h, w), rows (2 n_y, h) and cols (w, 2 n_x) contiguous float64",
    )
    t = t.contiguous()
    least = np.empty(1)
    if getattr(lib, f"dm_align_band_{_SUFFIX[t.dtype]}")(
        t.data_ptr(), weights.data_ptr(), weights.shape[0] != 1, b, c, h, w, rows.data_ptr(), rows.shape[0],
        cols.data_ptr(), cols.shape[1], least.ctypes.data,
    ):  # fmt: skip
        raise MemoryError("densematch's C kernels: align_band could not allocate its scratch")
    return float(least[0])


def certify_bound(
    image: torch.Tensor,
    template: torch.Tensor,
    cells: torch.Tensor,
    half: tuple[float, ...],
    rows: torch.Tensor,
    *,
    pivot: tuple[float, float],
    exact: bool,
    squared: bool,
    stop: float,
    floors: torch.Tensor | None = None,
    row_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """certify_alignment's bound (certify.c): per cell of ``cells`` (M, 4) (centres scale_h,
    scale_w, centre_y, centre_x: where the template pixel ``pivot`` (y, x) lands; half widths
    ``half``), the sum over the template's ``rows`` (in that order) and channels of each pixel's
    distance (squared: its square) from its value in ``template`` (C, h, w) to the range of
    ``image`` (C, H, W) over the box it samples from: whole pixels, or with ``exact`` the bilinear
    interpolant's own. A cell's sum stops at the first row after which it exceeds ``stop``. (M,)
    float64, on this thread.

    ``floors`` (M, len(rows)), float64: a lower bound on each cell's sum over each row, in the
    rows' order (a cell's parent's ``row_sums``: a cell inside another has each term at least the
    other's); the rows a cell stops before count by their floors. ``row_sums`` (M, len(rows)),
    float64, contiguous: filled with each cell's sum per row, its floor (or 0) where it stopped
    before the row."""
    lib = _loaded("certify_bound", image, template, cells, rows, floors, row_sums)
    c, h, w = template.shape
    m, n = cells.shape[0] if cells.ndim == 2 else -1, rows.numel()
    _require(
        all(v.dtype == torch.float64 and v.is_contiguous() for v in (image, template, cells))
        and image.ndim == 3
        and image.shape[0] == c
        and cells.ndim == 2
        and cells.shape[1] == 4
        and rows.dtype == torch.int64
        and bool(((rows >= 0) & (rows < h)).all())
        and all(
            v is None or (v.dtype == torch.float64 and v.shape == (m, n) and v.is_contiguous())
            for v in (floors, row_sums)
        ),
        "image (C, H, W), template (C, h, w) and cells (M, 4) must be contiguous float64, rows template rows, "
        "floors and row_sums (M, rows) contiguous float64",
    )
    rows = rows.contiguous()
    spread, at = torch.tensor(half, dtype=torch.float64), torch.tensor(pivot, dtype=torch.float64)
    out = torch.empty(m, dtype=torch.float64)
    failed = lib.dm_certify_bound(
        image.data_ptr(), template.data_ptr(), c, h, w, image.shape[1], image.shape[2], cells.data_ptr(), m,
        spread.data_ptr(), at.data_ptr(), rows.data_ptr(), n, exact, squared, stop,
        None if floors is None else floors.data_ptr(), out.data_ptr(),
        None if row_sums is None else row_sums.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("densematch's C kernels: certify_bound could not allocate its scratch")
    return out
