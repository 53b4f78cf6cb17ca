"""Local-window matching, the public calls: every pixel of a against the pixels of b in a window
around its own position (moved by a flow), exactly, as the best k (:func:`local_match`) or as a
differentiable cost volume (:func:`local_cost_volume`), and their module twins."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .._oprules import recording, refuse_legacy_onnx
from ..budget import parse_memory
from ..checks import (
    as_tensor,
    check_choice,
    check_int,
    check_real,
    compute_dtype,
)
from ..choices import LayoutName, MetricName, SamplingName
from ..config import kernel_setting, resolve_memory
from ..matching.dense import Matches
from ..metrics import get_metric
from .op import best, volume
from .topk import matches, topk
from .windows import SAMPLINGS, check_flow, check_maps, pair_int, prepare

__all__ = ["LocalCostVolume", "LocalMatcher", "local_cost_volume", "local_match"]


def local_match(
    a: Any,
    b: Any,
    radius: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = 1,
    flow: Any = None,
    sampling: SamplingName = "nearest",
    metric: MetricName = "cosine",
    k: int = 1,
    layout: LayoutName = "hwc",
    mask_a: Any = None,
    mask_b: Any = None,
    memory: int | str | None = None,
) -> Matches:
    """Match every pixel of ``a`` against the pixels of ``b`` in a window around its own
    position, exactly: pixel (y, x) against b at (y + fy + i * dy, x + fx + j * dx) for
    i in -ry..ry, j in -rx..rx, where (fy, fx) is the flow at (y, x) and (dy, dx) the dilation.
    Positions outside b (or masked out) are no candidates.

    Which options fit which job, and what each costs: docs/choosing.md.

    Parameters
    ----------
    a, b : Tensor or ndarray
        Features of one grid, (H, W, C) or (B, H, W, C) for layout="hwc", (C, H, W) or
        (B, C, H, W) for "chw"; any float dtype (computed in float32, float64 for float64 inputs).
    radius : int or (int, int)
        The window's half size per (row, col) axis, >= 0: (2 ry + 1) x (2 rx + 1) candidates.
        (0, r) searches along rows only, as rectified stereo does. Offsets that reach no pixel
        of b (beyond the maps, the flow included) cost nothing: they are missing everywhere.
    dilation : int or (int, int), default=1
        Step between candidates per axis (spatial-correlation-sampler's ``dilation_patch``).
    flow : Tensor or ndarray of shape (B, H, W, 2) or (H, W, 2), optional
        A displacement (d_row, d_col) per pixel of a that moves its window's centre. Note the
        order: flow from RAFT or OpenCV is (dx, dy); pass ``flow.flip(-1)``.
    sampling : {"nearest", "bilinear"}, default="nearest"
        How a fractional flow places the window: rounded to the nearest pixel (halves up), or
        b bilinearly interpolated at the exact positions (differentiable in the flow too); a
        position counts as inside b while it lies within [0, H - 1] x [0, W - 1].
    metric : {"cosine", "dot", "l2", "sqeuclidean", "l1", "linf"}, default="cosine"
        As in :func:`densematch.match`; every value is computed directly from the two features.
    k : int, default=1
        How many best candidates per pixel, best first, ties to the lower
        offset (row-major over the window); 1 <= k <= (2 ry + 1) (2 rx + 1).
    layout : {"hwc", "chw"}, default="hwc"
    mask_a, mask_b : bool Tensor or ndarray of shape (B, H, W) or (H, W), optional
        Pixels of a to match, pixels of b that may be chosen (masked-out pixels may hold NaN).
    memory : int or str, optional
        Cap on the working memory, as in :func:`densematch.match`.

    Returns
    -------
    Matches
        ``index`` (flat index in b's grid), ``coords`` ((row, col) in b; int64, float for
        bilinear sampling, where ``index`` is the nearest pixel), ``score`` (float32, float64
        for float64 inputs) and ``valid``, of shape (*batch, H, W[, k]) (coords: a further 2);
        -1 / NaN / False where a pixel has fewer candidates than k. ``score`` carries gradients
        to a, b and a bilinear flow when they require them.

    Raises
    ------
    ValueError
        Grids, channels, batch sizes or devices that differ, a bad radius, dilation, k, flow
        shape, metric, sampling or layout, NaN or Inf, masks of the wrong shape, or a
        budget that cannot hold one row of windows.
    TypeError
        Integer features, non-boolean masks, inputs of another type.

    Examples
    --------
    >>> f = torch.randn(20, 24, 8)
    >>> moved = torch.roll(f, shifts=(1, -2), dims=(0, 1))      # b[y, x] = a[y - 1, x + 2]
    >>> m = local_match(f, moved, 3)
    >>> bool((m.coords[5:-5, 5:-5] - torch.tensor([1, -2]) == torch.stack(torch.meshgrid(
    ...     torch.arange(5, 15), torch.arange(5, 19), indexing="ij"), -1)).all())
    True
    """
    check_choice(sampling, "sampling", SAMPLINGS)
    m = get_metric(metric)
    use_c = kernel_setting() != "torch"
    if recording() or is_fake(as_tensor(a, "a")):  # one operator: a graph holds no plan of bands for one size
        tensors, (radii, dilations), budget, batched = _operator_inputs(
            a, b, radius, dilation, flow, sampling, layout, mask_a, mask_b, memory, "local_match"
        )
        k = check_int(k, "k", 1, (2 * radii[0] + 1) * (2 * radii[1] + 1))
        offsets, score, valid = best(*tensors, list(radii), list(dilations), sampling, m.name, k, budget, use_c)
        return matches(offsets, score, valid, tensors[2], k, batched)
    win, (ra, rb, moved), batched = prepare(
        a,
        b,
        radius=radius,
        dilation=dilation,
        flow=flow,
        sampling=sampling,
        metric=m,
        layout=layout,
        mask_a=mask_a,
        mask_b=mask_b,
        use_c=use_c,
    )
    k = check_int(k, "k", 1, win.window[0] * win.window[1])
    return topk(win, ra, rb, moved, k, m, resolve_memory(memory, ra.device), batched)


def local_cost_volume(
    a: Any,
    b: Any,
    radius: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = 1,
    flow: Any = None,
    sampling: SamplingName = "nearest",
    metric: MetricName = "cosine",
    layout: LayoutName = "hwc",
    mask_a: Any = None,
    mask_b: Any = None,
    fill: float | None = None,
    memory: int | str | None = None,
) -> torch.Tensor:
    """The cost volume of every pixel of ``a`` against the pixels of ``b`` in a window around its
    own position (moved by a flow), every value computed directly and differentiable: the
    windows as in :func:`local_match`, every candidate kept.

    Which options fit which job, and what each costs: docs/choosing.md.

    Parameters
    ----------
    a, b, radius, dilation, flow, sampling, metric, layout, mask_a, mask_b, memory
        As in :func:`local_match`.
    fill : float, optional
        The value where a candidate is missing (outside b, masked out, or a masked-out pixel
        of a). Default 0 for cosine and dot (the zero padding of spatial-correlation-sampler),
        inf for the distances.

    Returns
    -------
    Tensor of shape (*batch, 2 ry + 1, 2 rx + 1, H, W)
        ``volume[..., i, j, y, x]`` = the metric's value of a at (y, x) and b at offset
        (i - ry, j - rx) times the dilation: spatial-correlation-sampler's layout, equal to its
        ``spatial_correlation_sample(a, b, patch_size=(2ry+1, 2rx+1), dilation_patch=d)`` for
        metric="dot" and layout="chw". Differentiable with respect to a, b and a bilinear flow.

    Raises
    ------
    ValueError, TypeError
        As :func:`local_match` raises (k aside).

    Examples
    --------
    >>> f = torch.randn(20, 24, 8)
    >>> local_cost_volume(f, torch.roll(f, shifts=(1, -2), dims=(0, 1)), (1, 2)).shape
    torch.Size([3, 5, 20, 24])
    """
    check_choice(sampling, "sampling", SAMPLINGS)
    m = get_metric(metric)
    tensors, (radii, dilations), budget, batched = _operator_inputs(
        a, b, radius, dilation, flow, sampling, layout, mask_a, mask_b, memory, "local_cost_volume"
    )
    missing = (0.0 if m.higher_is_better else math.inf) if fill is None else _check_fill(fill)
    settings = (list(radii), list(dilations), sampling, m.name, missing, budget, kernel_setting() != "torch")
    vol = volume(*tensors, *settings, recorded=recording())
    return vol if batched else vol[0]


def _operator_inputs(
    a: Any,
    b: Any,
    radius: Any,
    dilation: Any,
    flow: Any,
    sampling: str,
    layout: str,
    mask_a: Any,
    mask_b: Any,
    memory: int | str | None,
    what: str,
) -> tuple[tuple[Any, ...], tuple[tuple[int, int], tuple[int, int]], int, bool]:
    """What the local operators take, checked at the public boundary: (a, b as (B, H, W, C),
    the flow, mask_a, mask_b), the radii and dilations, the budget, and whether the call came
    batched (finiteness is the operator's own check, where the masks allow)."""
    ra, rb, grid, batched, masks = check_maps(a, b, layout, mask_a, mask_b)
    moved = check_flow(flow, sampling, ra.shape[0], grid, batched, ra.device, compute_dtype(ra, rb))
    radii, dilations = pair_int(radius, "radius", 0), pair_int(dilation, "dilation", 1)
    budget = resolve_memory(memory, ra.device)
    refuse_legacy_onnx(what)
    fa, fb = (_grid_rows(x, layout, batched) for x in (a, b))
    return (fa, fb, moved, masks[0], masks[1]), (radii, dilations), budget, batched


def _grid_rows(x: Any, layout: str, batched: bool) -> torch.Tensor:
    """A map :func:`check_features` accepted, as (B, H, W, C): a view (sizes stay symbolic under
    torch.export, where flat rows reshaped back into a grid would not)."""
    x = as_tensor(x, "a")
    x = x if batched else x.unsqueeze(0)
    return x.movedim(1, 3) if layout == "chw" else x


def _check_fill(fill: Any) -> float:
    """Any real number, NaN and infinities included (a fill marks, it is never computed with)."""
    if isinstance(fill, float) and math.isnan(fill):
        return fill
    return check_real(fill, "fill", -math.inf, math.inf, finite=False)


class _Windowed(nn.Module):
    """The settings both module twins share, checked at construction, and their repr."""

    def __init__(
        self,
        radius: int | tuple[int, int],
        dilation: int | tuple[int, int],
        sampling: str,
        metric: str,
        layout: str,
        memory: int | str | None,
    ) -> None:
        super().__init__()
        self.radius = pair_int(radius, "radius", 0)
        self.dilation = pair_int(dilation, "dilation", 1)
        self.sampling = check_choice(sampling, "sampling", SAMPLINGS)
        self.metric = get_metric(metric).name
        self.layout = check_choice(layout, "layout", ("hwc", "chw"))
        if memory is not None:
            parse_memory(memory)
        self.memory = memory

    def _settings(self) -> dict[str, Any]:
        keys = ("dilation", "sampling", "metric", "layout", "memory")
        return {key: getattr(self, key) for key in keys}

    def _shown(self, *extra: str) -> str:
        shown = [f"radius={self.radius}", f"metric={self.metric!r}", *extra]
        shown += [f"dilation={self.dilation}"] if self.dilation != (1, 1) else []
        shown += [f"sampling={self.sampling!r}"] if self.sampling != "nearest" else []
        shown += [f"layout={self.layout!r}"]
        return ", ".join(shown)


class LocalMatcher(_Windowed):
    """:func:`local_match` as a module.

    Parameters
    ----------
    radius, dilation, sampling, metric, k, layout, memory
        As in :func:`local_match`, checked here.

    Examples
    --------
    >>> LocalMatcher(2, metric="l2", k=2)(torch.randn(6, 7, 4), torch.randn(6, 7, 4)).index.shape
    torch.Size([6, 7, 2])
    """

    def __init__(
        self,
        radius: int | tuple[int, int],
        *,
        dilation: int | tuple[int, int] = 1,
        sampling: SamplingName = "nearest",
        metric: MetricName = "cosine",
        k: int = 1,
        layout: LayoutName = "hwc",
        memory: int | str | None = None,
    ) -> None:
        super().__init__(radius, dilation, sampling, metric, layout, memory)
        self.k = check_int(k, "k", 1, (2 * self.radius[0] + 1) * (2 * self.radius[1] + 1))

    def forward(self, a: Any, b: Any, *, flow: Any = None, mask_a: Any = None, mask_b: Any = None) -> Matches:
        return local_match(a, b, self.radius, flow=flow, k=self.k, mask_a=mask_a, mask_b=mask_b, **self._settings())

    def extra_repr(self) -> str:
        return self._shown(*([f"k={self.k}"] if self.k != 1 else []))


class LocalCostVolume(_Windowed):
    """:func:`local_cost_volume` as a module: a drop-in for spatial-correlation-sampler's
    ``SpatialCorrelationSampler`` with ``metric="dot"`` and ``layout="chw"``.

    Parameters
    ----------
    radius, dilation, sampling, metric, layout, fill, memory
        As in :func:`local_cost_volume`, checked here.

    Examples
    --------
    >>> corr = LocalCostVolume(4, metric="dot", layout="chw")
    >>> corr(torch.randn(2, 16, 12, 10), torch.randn(2, 16, 12, 10)).shape
    torch.Size([2, 9, 9, 12, 10])
    """

    def __init__(
        self,
        radius: int | tuple[int, int],
        *,
        dilation: int | tuple[int, int] = 1,
        sampling: SamplingName = "nearest",
        metric: MetricName = "cosine",
        layout: LayoutName = "hwc",
        fill: float | None = None,
        memory: int | str | None = None,
    ) -> None:
        super().__init__(radius, dilation, sampling, metric, layout, memory)
        self.fill = None if fill is None else _check_fill(fill)

    def forward(self, a: Any, b: Any, *, flow: Any = None, mask_a: Any = None, mask_b: Any = None) -> torch.Tensor:
        settings = self._settings()
        return local_cost_volume(a, b, self.radius, flow=flow, mask_a=mask_a, mask_b=mask_b, fill=self.fill, **settings)

    def extra_repr(self) -> str:
        return self._shown(*([f"fill={self.fill}"] if self.fill is not None else []))
