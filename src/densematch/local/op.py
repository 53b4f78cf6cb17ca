"""densematch::local_cost_volume (the windows' values, with its backward an operator of its own)
and densematch::local_topk (the best k of each window), so that torch.compile, torch.export and
torch.jit.trace see one node of known shape (its fake kernel) at any size, instead of the Python
that plans bands and offsets.

The operator takes what the public call validated: a and b as (B, H, W, C), the flow as (B, H,
W, 2) (int64 for nearest sampling, float for bilinear), masks as (B, H, W), and the settings as
plain values. Inside it, :func:`.windows.prepare` plans the call as eager does.
"""

from __future__ import annotations

from typing import Any

import torch

from .._oprules import differentiable, looped, operator
from ..checks import compute_dtype
from ..metrics import get_metric, unit_rows_grad
from .topk import rank
from .volume import band_rows, value_grads, values
from .windows import Window, prepare

__all__ = ["best", "volume"]


def _planned(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor | None,
    mask_a: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    radius: list[int],
    dilation: list[int],
    sampling: str,
    metric: str,
    use_c: bool,
) -> tuple[Window, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    win, rows, _ = prepare(
        a,
        b,
        radius=tuple(radius),
        dilation=tuple(dilation),
        flow=flow,
        sampling=sampling,
        metric=get_metric(metric),
        layout="hwc",
        mask_a=mask_a,
        mask_b=mask_b,
        use_c=use_c,
    )
    return win, rows


def _slots(win: Window) -> tuple[list[int], int] | None:
    """Where each reachable offset sits in the whole window (None: every offset is reachable)."""
    return None if win.slots is None else (win.slots, win.window[0] * win.window[1])


@operator(
    "densematch::local_cost_volume",
    schema="(Tensor a, Tensor b, Tensor? flow, Tensor? mask_a, Tensor? mask_b, int[] radius, int[] dilation, "
    "str sampling, str metric, float fill, int budget, bool use_c) -> Tensor",
)
def _volume_op(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor | None,
    mask_a: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    radius: list[int],
    dilation: list[int],
    sampling: str,
    metric: str,
    fill: float,
    budget: int,
    use_c: bool,
) -> torch.Tensor:
    win, (ra, rb, moved) = _planned(a, b, flow, mask_a, mask_b, radius, dilation, sampling, metric, use_c)
    nb, h, w, _ = win.shape
    vol = values(win, ra, rb, moved, lambda y0, y1: win.offsets, band_rows(win, ra, budget), fill, _slots(win))
    return vol.reshape(nb, *win.window, h, w)


@_volume_op.register_fake
def _volume_fake(
    a: torch.Tensor, b: torch.Tensor, flow: Any, mask_a: Any, mask_b: Any, radius: list[int], *rest: Any
) -> torch.Tensor:
    nb, h, w, _ = a.shape
    return a.new_empty((nb, 2 * radius[0] + 1, 2 * radius[1] + 1, h, w), dtype=compute_dtype(a, b))


@operator(
    "densematch::local_cost_volume_backward",
    schema="(Tensor grad, Tensor a, Tensor b, Tensor? flow, Tensor? mask_a, Tensor? mask_b, int[] radius, "
    "int[] dilation, str sampling, str metric, int budget, bool use_c) -> (Tensor, Tensor, Tensor)",
)
def _volume_backward_op(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor | None,
    mask_a: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    radius: list[int],
    dilation: list[int],
    sampling: str,
    metric: str,
    budget: int,
    use_c: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bilinear = flow is not None and flow.is_floating_point()
    win, (ra, rb, moved) = _planned(a, b, flow, mask_a, mask_b, radius, dilation, sampling, metric, use_c)
    nb, h, w, _ = win.shape
    slots = _slots(win)
    places = None if slots is None else torch.tensor(slots[0], dtype=torch.long, device=a.device)
    g = grad.reshape(nb, -1, h, w).to(ra.dtype)
    rows = band_rows(win, ra, budget)
    ga, gb, gf = value_grads(win, ra, rb, moved, lambda y0, y1: win.offsets, rows, places, g, (True, True, bilinear))
    assert ga is not None and gb is not None
    cosine = metric == "cosine"
    return (
        _through_preparation(ga, a, mask_a, cosine),
        _through_preparation(gb, b, mask_b, cosine and not bilinear),  # a blend of b is taken raw
        (gf.to(flow.dtype) if bilinear and gf is not None and flow is not None else a.new_empty(0)),
    )


def _through_preparation(g: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None, unit: bool) -> torch.Tensor:
    """The gradient at the map ``x`` (B, H, W, C) given ``g`` at the rows :func:`.windows.prepare`
    made of it: in the compute dtype, masked-out pixels zeroed, unit rows for cosine
    (:func:`densematch.metrics.unit_rows_grad`)."""
    if unit:
        g = unit_rows_grad(x.to(g.dtype) if mask is None else torch.where(mask[..., None], x.to(g.dtype), 0.0), g)
    if mask is not None:
        g = torch.where(mask[..., None], g, 0.0)
    return g.to(x.dtype)


@_volume_backward_op.register_fake
def _volume_backward_fake(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, flow: Any, *rest: Any
) -> tuple[torch.Tensor, ...]:
    bilinear = flow is not None and flow.is_floating_point()
    return torch.empty_like(a), torch.empty_like(b), (torch.empty_like(flow) if bilinear else a.new_empty(0))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    a, b, flow, mask_a, mask_b, radius, dilation, sampling, metric, _fill, budget, use_c = inputs
    ctx.save_for_backward(a, b, flow, mask_a, mask_b)
    ctx.settings = (radius, dilation, sampling, metric, budget, use_c)


def _gradients(ctx: Any, grads: tuple[torch.Tensor, ...], backward: Any) -> tuple[torch.Tensor | None, ...]:
    a, b, flow, mask_a, mask_b = ctx.saved_tensors
    ga, gb, gf = backward(grads[0], a, b, flow, mask_a, mask_b, *ctx.settings)
    need = ctx.needs_input_grad
    return (ga if need[0] else None), (gb if need[1] else None), (gf if need[2] else None), *(None,) * 9


_Volume = differentiable(_volume_op, _volume_backward_op, _setup, _gradients, "local_cost_volume")
_volume_op.register_vmap(lambda info, in_dims, *args: looped(_volume_op, in_dims, args))
_volume_backward_op.register_vmap(lambda info, in_dims, *args: looped(_volume_backward_op, in_dims, args))


def volume(*args: Any, recorded: bool) -> torch.Tensor:
    """The operator (a recorded graph's) or its autograd.Function (eager's, torch.func's)."""
    out: torch.Tensor = (_volume_op if recorded else _Volume.apply)(*args)  # type: ignore[no-untyped-call]
    return out


@operator(
    "densematch::local_topk",
    schema="(Tensor a, Tensor b, Tensor? flow, Tensor? mask_a, Tensor? mask_b, int[] radius, int[] dilation, "
    "str sampling, str metric, int k, int budget, bool use_c) -> (Tensor, Tensor, Tensor)",
)
def _topk_op(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor | None,
    mask_a: torch.Tensor | None,
    mask_b: torch.Tensor | None,
    radius: list[int],
    dilation: list[int],
    sampling: str,
    metric: str,
    k: int,
    budget: int,
    use_c: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, W, k) values of each pixel's k best candidates, their (B, H, W, k, 2) offsets and
    validity; slots without a candidate are 0, (0, 0), False (the public call marks them). The
    values come first (opcheck sums the outputs into the first one's dtype)."""
    win, (ra, rb, moved) = _planned(a, b, flow, mask_a, mask_b, radius, dilation, sampling, metric, use_c)
    nb, h, w, _ = win.shape
    chosen, score, valid, _rows = rank(win, ra, rb, moved, k, get_metric(metric), budget)
    table = torch.tensor(win.offsets, dtype=torch.int64, device=a.device).reshape(-1, 2)
    offsets = a.new_zeros((nb, h, w, k, 2), dtype=torch.int64)
    offsets[:, :, :, : chosen.shape[3]] = table[chosen]
    full = score.new_zeros((nb, h, w, k))
    full[..., : chosen.shape[3]] = score.masked_fill(~valid, 0.0)  # whichever kernel valued the pair
    found = torch.zeros((nb, h, w, k), dtype=torch.bool, device=a.device)
    found[..., : chosen.shape[3]] = valid
    return full, offsets, found


@_topk_op.register_fake
def _topk_fake(
    a: torch.Tensor, b: torch.Tensor, flow: Any, mask_a: Any, mask_b: Any, radius: list[int], dilation: list[int],
    sampling: str, metric: str, k: int, *rest: Any,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    nb, h, w, _ = a.shape
    dtype = compute_dtype(a, b)
    return (
        a.new_empty((nb, h, w, k), dtype=dtype),
        a.new_empty((nb, h, w, k, 2), dtype=torch.int64),
        a.new_empty((nb, h, w, k), dtype=torch.bool),
    )


def _topk_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    a, b, flow, mask_a, mask_b, radius, dilation, sampling, metric, _k, budget, use_c = inputs
    _score, offsets, valid = output
    ctx.save_for_backward(a, b, flow, mask_a, mask_b, offsets, valid)
    ctx.settings = (radius, dilation, sampling, metric, budget, use_c)


def _topk_gradients(ctx: Any, g_score: torch.Tensor, _offsets: Any, _valid: Any) -> tuple[torch.Tensor | None, ...]:
    """The chosen values' gradients through the cost volume's backward operator: ``g_score``
    placed at each pick's slot of a (B, window, H, W) gradient, zero elsewhere."""
    a, b, flow, mask_a, mask_b, offsets, valid = ctx.saved_tensors
    radius, dilation = ctx.settings[:2]
    nb, h, w, _ = valid.shape
    slot = (
        (offsets[..., 0] // dilation[0] + radius[0]) * (2 * radius[1] + 1) + offsets[..., 1] // dilation[1] + radius[1]
    )
    g = torch.where(valid, g_score, 0.0).to(compute_dtype(a, b))
    window = (2 * radius[0] + 1) * (2 * radius[1] + 1)
    g_volume = g.new_zeros((nb, window, h * w)).scatter_add_(1, slot.flatten(1, 2).mT, g.flatten(1, 2).mT)
    ga, gb, gf = torch.ops.densematch.local_cost_volume_backward(
        g_volume.reshape(nb, window, h, w), a, b, flow, mask_a, mask_b, *ctx.settings
    )
    need = ctx.needs_input_grad
    return (ga if need[0] else None), (gb if need[1] else None), (gf if need[2] else None), *(None,) * 9


_topk_op.register_autograd(_topk_gradients, setup_context=_topk_setup)
_topk_op.register_vmap(lambda info, in_dims, *args: looped(_topk_op, in_dims, args))


def best(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_topk_op`'s (B, H, W, k, 2) offsets, their values (differentiable in a, b and a
    bilinear flow, through the cost volume's backward operator) and validity."""
    score, offsets, valid = torch.ops.densematch.local_topk(*args)
    return offsets, score, valid
