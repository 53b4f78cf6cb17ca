"""Bindings of align.c and certify.c (:mod:`densematch.kernels.native` holds them all): the
alignment's refinement steps, the grid's cross terms, scores and best shifts, the warp, and the certificate's
bound per cell."""

from __future__ import annotations

import torch

from .loader import _SUFFIX, _loaded, _require

__all__ = [
    "align_best_shifts",
    "align_cross",
    "align_grid",
    "align_levels",
    "align_pick",
    "align_refine",
    "align_scores",
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


def align_levels(
    levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    owner: torch.Tensor,
    cand: torch.Tensor,
    keep: list[int],
    tolerance: list[float],
    ranges: tuple[float, float, float, float],
    photometric: bool,
    iterations: int,
    same: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """align's refinement down its pyramid in one call (align.c): ``levels`` coarsest first, each
    (t (B, C, h, w), x (B, C, H, W), weights (B or 1, h, w), downsampling factor), float64. The
    candidates ``cand`` (M, 4), full-resolution (scale_h, scale_w, shift_y, shift_x) of the
    pairs ``owner`` (M,), grouped by pair in ascending order, are refined at each level to its
    ``tolerance`` (:func:`align_refine`'s iteration, gain and bias from 1 and 0 where
    ``photometric``); after each level but the last each pair keeps its ``keep[l]`` best by the
    squared error, less any within ``same`` (scales, full-resolution shifts) of a better one.
    Returns the last level's candidates, their owners, their starts there and their sums
    (squared, absolute), full resolution. On this thread."""
    lib = _loaded("align_levels", owner, cand, *(v for level in levels for v in level[:3]))
    b, c = levels[0][0].shape[:2]
    shared = levels[0][2].shape[0] != b
    _require(
        len(keep) == len(levels) - 1 == len(tolerance) - 1
        and all(
            t.dtype == x.dtype == wt.dtype == torch.float64
            and t.shape[:2] == x.shape[:2] == (b, c)
            and wt.shape == ((1,) if shared else (b,)) + t.shape[-2:]
            for t, x, wt, _ in levels
        )
        and cand.ndim == 2
        and cand.shape[1] == 4
        and owner.shape == cand.shape[:1]
        and _within(owner, 0, b - 1)
        and _within(owner[1:] - owner[:-1], 0, b),
        "levels must hold float64 (B, C, h, w), (B, C, H, W), (B or 1, h, w) and cand (M, 4) full-resolution "
        "candidates of the pairs owner (M,), grouped in ascending order",
    )
    parts = [v.reshape(-1) for level in levels for v in level[:3]]
    offsets = torch.tensor([0, *(p.numel() for p in parts[:-1])], dtype=torch.int64).cumsum(0)
    data = torch.cat(parts).contiguous()
    dims = torch.tensor([[*t.shape[-2:], *x.shape[-2:]] for t, x, _, _ in levels], dtype=torch.int64)
    factor = torch.tensor([float(f) for *_, f in levels], dtype=torch.float64)
    # every operand held by a name until the call returns: a temporary's memory would be freed
    steps = torch.tensor([*keep, 0], dtype=torch.int64)
    tol, box, twins = (torch.tensor(v, dtype=torch.float64) for v in (tolerance, ranges, same))
    owner = owner.to(torch.int64).clone()
    cand = cand.to(torch.float64).clone()
    m = cand.shape[0]
    start, sums = torch.empty(m, 4, dtype=torch.float64), torch.empty(m, 2, dtype=torch.float64)
    kept = lib.dm_align_levels(
        data.data_ptr(), offsets.data_ptr(), dims.data_ptr(), factor.data_ptr(), steps.data_ptr(), tol.data_ptr(),
        len(levels), c, shared, 6 if photometric else 4, box.data_ptr(), iterations, twins.data_ptr(), m,
        owner.data_ptr(), cand.data_ptr(), start.data_ptr(), sums.data_ptr(),
    )  # fmt: skip
    if kept < 0:
        raise MemoryError("densematch's C kernels: align_levels could not allocate its scratch")
    return cand[:kept], owner[:kept], start[:kept], sums[:kept]


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
    r0, r1, v0, v1 = row_taps
    nh, rows = r0.shape
    nw = col_taps[0].shape[0]
    ny, nx = n_shift
    _require(
        t.shape[:2] == (b, c)
        and all(v.dtype == x.dtype for v in (t, v0, v1))
        and all(v.shape == (nh, rows) for v in row_taps)
        and r0.dtype == r1.dtype == max_y.dtype == max_x.dtype == torch.int64
        and max_y.shape == (nh,)
        and max_x.shape == (nw,)
        and _within(r0, 0, big_h - 1)
        and _within(r1, 0, big_h - 1)
        and k >= 1,
        "x (B, C, H, W), t (B, C, h, w), Ry's taps (nh, rows) inside H, max_y (nh,) and max_x (nw,) int64, k >= 1",
    )
    x, t = x.contiguous(), t.contiguous()
    _grid_check(x, t, col_taps, (rows, big_w), n_shift)
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
    _require(along_y.is_contiguous() and t.shape[:2] == (b, c), "along_y (B, C, nh, rows, W) must be contiguous")
    _grid_check(along_y, t, taps, (rows, big_w), n_shift)
    out = torch.empty(b, nh, nw, ny, nx, dtype=along_y.dtype)
    sizes = (b, c, nh, rows, big_w, h, w, nw, cols, ny, nx)
    ptrs = (along_y.data_ptr(), t.data_ptr(), *(v.data_ptr() for v in taps))
    if getattr(lib, f"dm_{name}_{_SUFFIX[along_y.dtype]}")(*ptrs, *sizes, *extra, out.data_ptr()):
        raise MemoryError(f"densematch's C kernels: {name} could not allocate its scratch")
    return out


def _grid_check(
    image: torch.Tensor,
    t: torch.Tensor,
    taps: tuple[torch.Tensor, ...],
    size: tuple[int, int],
    n_shift: tuple[int, int],
) -> None:
    """The rules align's grid kernels share: one float dtype, contiguous, Rx's taps (nw, cols)
    inside the ``size`` (rows, W) stretched along y, i1 = i0 or i0 + 1, every shift's window inside."""
    i0, i1, w0, w1 = taps
    nw, cols = i0.shape
    (rows, big_w), (ny, nx) = size, n_shift
    h, w = t.shape[-2:]
    _require(
        image.dtype in _SUFFIX
        and all(v.dtype == image.dtype and v.is_contiguous() for v in (t, w0, w1))
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
    """align's candidates from its grid (align.c), as
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
) -> torch.Tensor:
    """certify_alignment's bound (certify.c): per cell of ``cells`` (M, 4) (centres scale_h,
    scale_w, centre_y, centre_x: where the template pixel ``pivot`` (y, x) lands; half widths
    ``half``), the sum over the template's ``rows`` (in that order) and channels of each pixel's
    distance (squared: its square) from its value in ``template`` (C, h, w) to the range of
    ``image`` (C, H, W) over the box it samples from: whole pixels, or with ``exact`` the bilinear
    interpolant's own. A cell's sum stops at the first row after which it exceeds ``stop``. (M,)
    float64, on this thread."""
    lib = _loaded("certify_bound", image, template, cells, rows)
    c, h, w = template.shape
    _require(
        all(v.dtype == torch.float64 and v.is_contiguous() for v in (image, template, cells))
        and image.ndim == 3
        and image.shape[0] == c
        and cells.ndim == 2
        and cells.shape[1] == 4
        and rows.dtype == torch.int64
        and bool(((rows >= 0) & (rows < h)).all()),
        "image (C, H, W), template (C, h, w) and cells (M, 4) must be contiguous float64, rows template rows",
    )
    rows = rows.contiguous()
    spread, at = torch.tensor(half, dtype=torch.float64), torch.tensor(pivot, dtype=torch.float64)
    out = torch.empty(cells.shape[0], dtype=torch.float64)
    failed = lib.dm_certify_bound(
        image.data_ptr(), template.data_ptr(), c, h, w, image.shape[1], image.shape[2], cells.data_ptr(),
        cells.shape[0], spread.data_ptr(), at.data_ptr(), rows.data_ptr(), rows.numel(), exact, squared, stop,
        out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("densematch's C kernels: certify_bound could not allocate its scratch")
    return out
