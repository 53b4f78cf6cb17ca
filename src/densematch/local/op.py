"""densematch::local_cost_volume: the windows' values as one PyTorch operator, with its backward
an operator of its own, so that torch.compile, torch.export and torch.jit.trace see one node of
known shape (its fake kernel) at any size, instead of the Python that plans bands and offsets.

The operator takes what the public call validated: a and b as (B, H, W, C), the flow as (B, H,
W, 2) (int64 for nearest sampling, float for bilinear), masks as (B, H, W), and the settings as
plain values. Inside it, :func:`.windows.prepare` plans the call as eager does.
"""

from __future__ import annotations

from typing import Any

import torch

from .._oprules import differentiable, looped
from ..checks import compute_dtype
from ..metrics import get_metric, unit_rows_grad
from .volume import band_rows, value_grads, values
from .windows import Window, prepare

__all__ = ["volume"]


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
    ry, rx = radius
    dy, dx = dilation
    win, rows, _ = prepare(
        a, b, (ry, rx), (dy, dx), flow, sampling, get_metric(metric), "hwc", mask_a, mask_b, use_c=use_c
    )
    return win, rows


def _slots(win: Window) -> tuple[list[int], int] | None:
    """Where each reachable offset sits in the whole window (None: every offset is reachable)."""
    return None if win.slots is None else (win.slots, win.window[0] * win.window[1])


@torch.library.custom_op(
    "densematch::local_cost_volume",
    mutates_args=(),
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


@torch.library.custom_op(
    "densematch::local_cost_volume_backward",
    mutates_args=(),
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
