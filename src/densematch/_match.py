"""Dense matching: for every pixel of one feature map, its best pixels in another."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from . import engine
from .budget import parse_memory
from .checks import LAYOUTS, check_choice, check_features, check_finite, check_int, check_mask, check_real
from .config import resolve_memory
from .metrics import Metric, get_metric
from .precision import PRECISIONS, resolve_precision
from .progress import progress_bar

__all__ = ["DenseMatcher", "Matches", "match"]


@dataclass
class Matches:
    """The result of :func:`match`.

    Attributes
    ----------
    index : Tensor of int64, shape (*batch, *grid_a[, k])
        Flat index of the match in b's grid; -1 where there is none (a masked-out pixel of a,
        or fewer allowed pixels in b than k).
    coords : Tensor of int64, shape (*batch, *grid_a[, k], 2), or None
        (row, col) of the match in b's grid, derived with b's own width; -1 where there is none.
        None for layout="flat".
    score : Tensor of float32 (float64 with precision="float64"), shape (*batch, *grid_a[, k])
        Similarity (cosine, dot) or distance (l2, sqeuclidean, l1, linf); NaN where there is none.
    valid : Tensor of bool, shape (*batch, *grid_a[, k])
        True where a match exists and every requested filter (mutual, ratio) passes.
    """

    index: torch.Tensor
    coords: torch.Tensor | None
    score: torch.Tensor
    valid: torch.Tensor

    def numpy(self) -> dict[str, np.ndarray]:
        """The fields as numpy arrays (``coords`` left out for layout="flat")."""
        return {
            f.name: getattr(self, f.name).detach().cpu().numpy()
            for f in fields(self)
            if getattr(self, f.name) is not None
        }


def match(
    a: Any,
    b: Any,
    *,
    metric: str = "cosine",
    k: int = 1,
    mutual: bool = False,
    ratio: float | None = None,
    layout: str = "hwc",
    mask_a: Any = None,
    mask_b: Any = None,
    memory: int | str | None = None,
    progress: bool = False,
    precision: str = "exact",
) -> Matches:
    """Find, for every pixel of `a`, its `k` best pixels in `b`, exactly, within a memory budget.

    Exact for any `memory`: equal to brute force under `precision` accumulation. The N x N
    similarity matrix is never built; `a` and `b` are tiled and a running top-k is merged.

    Parameters
    ----------
    a, b : Tensor or ndarray
        Query and reference features, float16, bfloat16, float32 or float64, of shape
        (H, W, C) or (B, H, W, C) for layout="hwc"; (C, H, W) or (B, C, H, W) for "chw";
        (N, C) or (B, N, C) for "flat". Grids may differ; C and B must agree. On one device.
    metric : {"cosine", "dot", "l2", "sqeuclidean", "l1", "linf"}, default="cosine"
        Cosine and dot are similarities (higher is better), the rest distances.
    k : int, default=1
        How many matches per pixel, best first; 1 <= k <= pixels of b.
    mutual : bool, default=False
        Valid only where a's pixel is also the best match in a of its match in b (mutual
        nearest neighbours). Costs a second bounded pass, b against a.
    ratio : float in (0, 1], optional
        Lowe's ratio test: valid where d1 / d2 <= ratio for the best and second-best distances
        (inclusive). For cosine, d is the chord distance sqrt(2 - 2 cos) of unit features; for
        sqeuclidean, the Euclidean distance. A pixel whose second distance is 0 fails; one with
        no second candidate passes. Not defined for "dot".
    layout : {"hwc", "chw", "flat"}, default="hwc"
        How `a` and `b` are laid out; sizes are never guessed from.
    mask_a, mask_b : bool Tensor or ndarray, optional
        Pixels to use, of shape (*batch, *grid), or (*grid) to apply to every batch item.
        Masked-out pixels of a are not matched (valid False, index -1); masked-out pixels of
        b are never chosen. Masked pixels cost no work.
    memory : int or str, optional
        Hard cap on the extra working memory of the call, inputs and outputs aside: bytes or a
        string such as "256MiB" or "2GB". None: :func:`densematch.config_context`, else
        ``DENSEMATCH_MEMORY``, else half the device's free memory, capped (512 MiB on a CPU).
    progress : bool, default=False
        Show a tqdm bar over the query pixels (needs tqdm).
    precision : {"exact", "float32", "fast", "float64"}, default="exact"
        "exact": the same matches as "float32" (ties aside), using a certified half-precision
        search where the device multiplies half precision faster (GPUs; CPUs with AMX), else
        float32. "float32" / "float64": plain accumulation in that dtype. "fast": ranks by
        half-precision scores where that is faster, without re-scoring: approximate. Measured
        (benchmarks/bench_match.py): 1.9-2.1% of pixels get another match than "float32" on
        noise and 5.3-9.2% on photo patch features in bfloat16; 0.3-1.0% in float16 (see
        docs/precision.md). Scores are always recomputed in float32 (float64).

    Returns
    -------
    Matches
        `index` (int64), `score` (float32; float64 for precision="float64") and `valid` (bool)
        of shape (*batch, *grid_a), plus a trailing k axis when k > 1; `coords` (int64) with a
        further trailing axis of 2.

    Raises
    ------
    ValueError
        Wrong rank for the layout, a C or batch mismatch, empty maps, NaN or Inf, an unknown
        metric, layout or precision, k out of range, ratio outside (0, 1] or with "dot", masks
        of the wrong shape, or a memory budget smaller than one tile.
    TypeError
        Integer or boolean features, non-boolean masks, or inputs of another type.

    Notes
    -----
    Convention: ties go to the lower flat index of b. Zero vectors under cosine score 0. For
    l2 and sqeuclidean, candidates are ranked through the expansion ||a||^2 - 2 a.b + ||b||^2
    of features centred on b's mean, and each reported score is recomputed directly from the
    two features.

    Examples
    --------
    >>> f = torch.randn(24, 32, 16)
    >>> match(f, f, k=2, metric="l2").coords.shape
    torch.Size([24, 32, 2, 2])
    >>> bool((match(f, f).coords[..., 1] == torch.arange(32)).all())
    True
    """
    layout = check_choice(layout, "layout", LAYOUTS)
    m = get_metric(metric)
    check_choice(precision, "precision", PRECISIONS)
    ra, grid_a, batched_a = check_features(a, "a", layout, finite=False)
    rb, grid_b, batched_b = check_features(b, "b", layout, finite=False)
    if ra.device != rb.device:
        raise ValueError(f"a and b must be on one device, got {ra.device} and {rb.device}")
    if batched_a != batched_b or ra.shape[0] != rb.shape[0]:
        raise ValueError(
            f"a and b must have the same batch size, got {tuple(ra.shape[:1]) if batched_a else 'none'} "
            f"and {tuple(rb.shape[:1]) if batched_b else 'none'}"
        )
    if ra.shape[2] != rb.shape[2]:
        raise ValueError(f"a and b must have the same number of channels C, got {ra.shape[2]} and {rb.shape[2]}")
    nb = rb.shape[1]
    k = check_int(k, "k", 1, nb)
    ratio = _check_ratio(ratio, m)
    nbatch = ra.shape[0]
    prec = resolve_precision(precision, ra.device, m)
    masks = [
        _batch_mask(mask, name, nbatch, grid, batched_a, ra.device)
        for mask, name, grid in ((mask_a, "mask_a", grid_a), (mask_b, "mask_b", grid_b))
    ]
    # masked-out pixels are never read, so they may hold anything (NaN padding of ragged batches)
    for rows, mask, name in ((ra, masks[0], "a"), (rb, masks[1], "b")):
        check_finite(rows, name, mask=None if mask is None else mask.reshape(nbatch, -1))
    budget = resolve_memory(memory, ra.device)
    na = ra.shape[1]
    reserved = 8 * (na + nb)  # the mask row lists
    k_rank = max(k, 2) if ratio is not None else k

    index = torch.full((nbatch, na, k), -1, dtype=torch.int64, device=ra.device)
    score = torch.full((nbatch, na, k), float("nan"), dtype=prec.dtype, device=ra.device)
    valid = torch.zeros((nbatch, na, k), dtype=torch.bool, device=ra.device)
    passes = 2 if mutual else 1
    with progress_bar(progress, total=passes * nbatch * na, unit="px", desc="match") as bar:
        # what both passes (a against b, and the mutual check's b against a) search with
        search = functools.partial(engine.topk, metric=m, budget=budget, precision=prec, on_tile=bar.update)
        for i in range(nbatch):
            rows_a, rows_b = (None if mk is None else mk[i].reshape(-1).nonzero().squeeze(1) for mk in masks)
            v, idx = search(ra[i], rb[i], k=k_rank, rows_a=rows_a, rows_b=rows_b, reserved=reserved)
            ok = idx >= 0
            if ratio is not None:
                ok &= _passes_ratio(m.ratio_distance(v[:, :2]), idx, ratio)[:, None]
            v, idx, ok = v[:, :k], idx[:, :k], ok[:, :k]
            if mutual:
                # the second bounded pass: the best pixel of a for every allowed pixel of b
                _, back = search(rb[i], ra[i], k=1, rows_a=rows_b, rows_b=rows_a, reserved=reserved + 8 * nb)
                ok &= _is_mutual(idx, back[:, 0], rows_a, rows_b, na, nb)
            target = slice(None) if rows_a is None else rows_a
            index[i, target] = idx
            score[i, target] = v
            valid[i, target] = ok
    shape = (*((nbatch,) if batched_a else ()), *grid_a, *((k,) if k > 1 else ()))
    index, score, valid = (t.reshape(shape) for t in (index, score, valid))
    coords = None
    if layout != "flat":
        width = grid_b[1]
        coords = torch.stack((index.div(width, rounding_mode="floor"), index.remainder(width)), dim=-1)
        coords = torch.where(index[..., None] >= 0, coords, -1)
    return Matches(index=index, coords=coords, score=score, valid=valid)


def _check_ratio(ratio: Any, metric: Metric) -> float | None:
    """``ratio`` as a float in (0, 1], or None; refused for "dot", which is not a distance."""
    if ratio is None:
        return None
    ratio = check_real(ratio, "ratio", 0.0, 1.0, low_open=True)
    if not metric.has_ratio:
        raise ValueError(f"ratio is undefined for metric={metric.name!r} (not a distance); use 'cosine'")
    return ratio


def _passes_ratio(d: torch.Tensor, idx: torch.Tensor, ratio: float) -> torch.Tensor:
    """Lowe's test on the best two distances d (n, 2): d1 <= ratio * d2, and d2 > 0 (a second
    candidate at distance 0 makes the match ambiguous); a pixel with no second candidate passes."""
    return (idx[:, 1] < 0) | ((d[:, 1] > 0) & (d[:, 0] <= ratio * d[:, 1]))


def _is_mutual(
    idx: torch.Tensor, back: torch.Tensor, rows_a: torch.Tensor | None, rows_b: torch.Tensor | None, na: int, nb: int
) -> torch.Tensor:
    """(n, k) True where the best pixel of a for b-pixel idx is the querying pixel itself."""
    owner = torch.full((nb,), -1, dtype=torch.int64, device=idx.device)
    owner[rows_b if rows_b is not None else slice(None)] = back
    me = torch.arange(na, device=idx.device) if rows_a is None else rows_a
    return owner[idx.clamp_min(0)] == me[:, None]


def _batch_mask(
    mask: Any, name: str, nbatch: int, grid: tuple[int, ...], batched: bool, device: torch.device
) -> torch.Tensor | None:
    """A mask of shape (B, *grid): batched masks as given, a (*grid) mask repeated."""
    if mask is None:
        return None
    shape = tuple(getattr(mask, "shape", ()))
    if batched and shape == grid:
        return check_mask(mask, name, grid, device).expand(nbatch, *grid)
    full = (nbatch, *grid) if batched else grid
    return check_mask(mask, name, full, device).reshape(nbatch, *grid)


class DenseMatcher(nn.Module):
    """:func:`match` as a module: the settings are checked and stored, ``forward(a, b)`` matches.

    Parameters
    ----------
    metric, k, mutual, ratio, layout, memory, progress, precision
        As in :func:`match`, checked here (``k`` against b's pixels at each call).

    Examples
    --------
    >>> m = DenseMatcher(metric="l2", k=3)
    >>> m
    DenseMatcher(metric='l2', k=3, layout='hwc', precision='exact')
    >>> m(torch.randn(8, 8, 4), torch.randn(6, 9, 4)).index.shape
    torch.Size([8, 8, 3])
    """

    def __init__(
        self,
        *,
        metric: str = "cosine",
        k: int = 1,
        mutual: bool = False,
        ratio: float | None = None,
        layout: str = "hwc",
        memory: int | str | None = None,
        progress: bool = False,
        precision: str = "exact",
    ) -> None:
        super().__init__()
        m = get_metric(metric)
        self.metric = m.name
        self.k = check_int(k, "k", 1)
        self.mutual, self.progress = bool(mutual), bool(progress)
        self.ratio = _check_ratio(ratio, m)
        self.layout = check_choice(layout, "layout", LAYOUTS)
        if memory is not None:
            parse_memory(memory)
        self.memory = memory
        self.precision = check_choice(precision, "precision", PRECISIONS)

    def forward(self, a: Any, b: Any, *, mask_a: Any = None, mask_b: Any = None) -> Matches:
        return match(
            a,
            b,
            metric=self.metric,
            k=self.k,
            mutual=self.mutual,
            ratio=self.ratio,
            layout=self.layout,
            mask_a=mask_a,
            mask_b=mask_b,
            memory=self.memory,
            progress=self.progress,
            precision=self.precision,
        )

    def extra_repr(self) -> str:
        shown = [f"metric={self.metric!r}", f"k={self.k}"]
        shown += ["mutual=True"] if self.mutual else []
        shown += [f"ratio={self.ratio}"] if self.ratio is not None else []
        shown += [f"layout={self.layout!r}"]
        shown += [f"memory={self.memory!r}"] if self.memory is not None else []
        return ", ".join([*shown, f"precision={self.precision!r}"])
