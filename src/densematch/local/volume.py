"""The values of local matching, one band of rows and one offset at a time, differentiable.

The backward recomputes each (band, offset) and differentiates it alone, its inputs cut loose as
leaves: memory never holds a copy of a per offset, as the unfold recipe does, and no slice's
gradient is spread over a zero tensor of the whole input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..budget import chunk_rows
from ..kernels import native
from .windows import Offsets, Window

__all__ = ["band", "band_rows", "values"]

# bytes per (pixel, offset) of the ranking's bookkeeping: value, score, validity, index
_BOOK_BYTES = 24


def band_rows(win: Window, ra: torch.Tensor, budget: int) -> int:
    """Rows of a per band: one offset's working copies (the candidates read, the metric's
    temporary and its gradient; for a flow the gathered copies, four and their blend for
    bilinear sampling) plus the band's values and validity at every offset."""
    nb, h, w, c = win.shape
    copies = {None: 3, "nearest": 4, "bilinear": 9}[win.flow_kind]
    per_pixel = copies * c * ra.element_size() + _BOOK_BYTES * len(win.offsets)
    return min(h, chunk_rows(budget, nb * w * per_pixel, "one row of windows"))


class _Values(torch.autograd.Function):
    """(B, m, H, W) values of m offsets per pixel, ``fill`` where a pixel has no candidate; with
    ``slots`` (the place of each offset among ``total``), (B, total, H, W) with ``fill`` at the
    other places, written in place. The backward recomputes each (band, offset) and
    differentiates it alone."""

    @staticmethod
    def forward(
        ra: torch.Tensor,
        rb: torch.Tensor,
        flow: torch.Tensor | None,
        win: Window,
        offsets: Offsets,
        rows: int,
        fill: float,
        slots: tuple[list[int], int] | None,
    ) -> torch.Tensor:
        nb, h, w, _ = win.shape
        out, places = None, None
        if slots is not None:
            places = torch.tensor(slots[0], dtype=torch.long, device=ra.device)
            out = ra.new_full((nb, slots[1], h, w), fill)
        for y0 in range(0, h, rows):
            y1 = min(h, y0 + rows)
            v, ok = band(win, ra, rb, flow, y0, y1, offsets(y0, y1))
            v.masked_fill_(~ok, fill)
            if out is None and rows >= h:  # one band: it is the output
                out = v
                break
            if out is None:
                out = ra.new_empty((nb, v.shape[1], h, w))
            if places is None:
                out[:, :, y0:y1] = v
            else:
                out[:, places, y0:y1] = v
        assert out is not None
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        # apart from forward, as torch.func.grad wants it
        ra, rb, flow, win, offsets, rows, _fill, slots = inputs
        ctx.save_for_backward(ra, rb, flow)
        places = None if slots is None else torch.tensor(slots[0], dtype=torch.long, device=ra.device)
        ctx.win, ctx.offsets, ctx.rows, ctx.places = win, offsets, rows, places

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ra, rb, flow = ctx.saved_tensors
        track = tuple(ctx.needs_input_grad[:3])
        grads = value_grads(ctx.win, ra, rb, flow, ctx.offsets, ctx.rows, ctx.places, grad, track)
        return (*grads, None, None, None, None, None)


def value_grads(
    win: Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    offsets: Offsets,
    rows: int,
    places: torch.Tensor | None,
    grad: torch.Tensor,
    track: Sequence[bool],
) -> list[torch.Tensor | None]:
    """The gradients for (ra, rb, flow) (None where ``track`` does not ask) of the values
    :class:`_Values` computed, given theirs (``grad``): each (band, offset) recomputed and
    differentiated alone."""
    ra, rb = ra.contiguous(), rb.contiguous()  # channels last for the backward's kernels and gathers
    # accumulators made from the incoming gradient, so that under torch.func (jacrev's vmap
    # over the backward) they are batched as it is and take its slices in place
    grads = [
        grad.new_zeros(t.shape) if need and t is not None else None
        for t, need in zip((ra, rb, flow), track, strict=True)
    ]
    h, c = win.shape[1], win.shape[3]
    for y0 in range(0, h, rows):
        y1 = min(h, y0 + rows)
        band_offsets = offsets(y0, y1)
        g_band = grad[:, :, y0:y1] if places is None else grad[:, places, y0:y1]  # (B, m, rows, W)
        if _dot_grad_in_c(win, band_offsets):
            _grad_c(win, ra, rb, flow, y0, y1, band_offsets, g_band, grads)
            continue
        for j, (oy, ox) in enumerate(band_offsets):
            read = win.read(y0, y1, oy, ox, flow)
            if read.out is None:
                continue
            g = g_band[:, j][read.out] * read.valid[read.out]
            got_a, got_parts, got_flow = win.value_grads(read, *win.sources(read, ra, rb, flow), g)
            if grads[0] is not None:
                grads[0][read.a] += got_a
            if grads[1] is not None:
                for k, got in enumerate(got_parts):
                    if read.b is not None:
                        grads[1][read.b] += got
                    else:
                        grads[1].view(-1, c).index_add_(0, read.index[k], got.reshape(-1, c))
            if grads[2] is not None and got_flow is not None:
                grads[2][:, y0:y1] += got_flow
    return grads


def values(
    win: Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    offsets: Offsets,
    rows: int,
    fill: float,
    slots: tuple[list[int], int] | None = None,
) -> torch.Tensor:
    out = _Values.apply(ra, rb, flow, win, offsets, rows, fill, slots)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def band(
    win: Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    y0: int,
    y1: int,
    offsets: Sequence[tuple[Any, Any]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, m, y1 - y0, W) values of rows y0:y1 of a at each of m offsets, NaN where a pixel has
    no candidate, and where it has one."""
    nb, _, w, _ = win.shape
    whole_window = all(isinstance(oy, int) for oy, _ in offsets)  # not per-pixel picks
    if win.kernel is not None and whole_window:
        return _band_c(win, ra, rb, flow, y0, y1, offsets)
    vals = ra.new_full((nb, len(offsets), y1 - y0, w), math.nan)
    valid = torch.zeros(vals.shape, dtype=torch.bool, device=vals.device)
    for j, (oy, ox) in enumerate(offsets):
        read = win.read(y0, y1, oy, ox, flow)
        if read.out is not None:
            vals[:, j][read.out] = win.value(read, *win.sources(read, ra, rb, flow))
            valid[:, j] = read.valid
    return vals, valid


def _band_c(
    win: Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    y0: int,
    y1: int,
    offsets: Sequence[tuple[Any, Any]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`band` through the C kernels: one pass over the band per batch item, every
    offset's pairs reduced in registers, with no product tensor or gathered copy per offset."""
    assert win.kernel is not None
    table = torch.tensor(offsets, dtype=torch.int64).reshape(-1, 2)
    nb = ra.shape[0]
    vals = ra.new_empty((nb, len(offsets), y1 - y0, ra.shape[2]))
    if flow is None:
        for i in range(nb):
            native.local_values(ra[i].detach(), rb[i].detach(), table, y0, y1, win.kernel, out=vals[i])
        valid = torch.stack([win.read(y0, y1, int(oy), int(ox), None).valid for oy, ox in offsets], 1)
    else:
        found = []
        for i in range(nb):
            mask = None if win.mask_b is None else win.mask_b[i]
            _, ok = native.local_flow_values(
                ra[i].detach(), rb[i].detach(), flow[i].detach(), table, y0, y1, win.kernel,
                bilinear=win.flow_kind == "bilinear", linear=win.linear, mask_b=mask, out=vals[i],
            )  # fmt: skip
            found.append(ok)
        valid = torch.stack(found)
        if win.mask_a is not None:
            valid &= win.mask_a[:, None, y0:y1]
    if win.finish is not None:
        vals = win.finish(vals)
    return vals, valid


def _dot_grad_in_c(win: Window, offsets: Sequence[tuple[Any, Any]]) -> bool:
    """Whether a band's backward runs in C: dot products (dot, cosine of unit rows) of whole
    windows (not per-pixel picks), shifted or moved by a flow."""
    return win.kernel == "dot" and all(isinstance(oy, int) for oy, _ in offsets)


def _grad_c(
    win: Window,
    ra: torch.Tensor,
    rb: torch.Tensor,
    flow: torch.Tensor | None,
    y0: int,
    y1: int,
    offsets: Sequence[tuple[Any, Any]],
    grad: torch.Tensor,
    grads: list[torch.Tensor | None],
) -> None:
    """The band's gradients (``grad``: the band's own, (B, m, y1 - y0, W)) through
    :func:`densematch.kernels.native.local_flow_grad`, into ``grads`` (for a, b and the flow,
    each None where not wanted); shifted windows are windows moved by a flow of zeros."""
    table = torch.tensor(offsets, dtype=torch.int64).reshape(-1, 2)
    if flow is None:
        flow = ra.new_zeros((ra.shape[0], ra.shape[1], ra.shape[2], 2))
    g = grad
    if win.mask_a is not None:  # masked-out pixels of a have no windows
        g = g * win.mask_a[:, None, y0:y1]
    for i in range(ra.shape[0]):
        native.local_flow_grad(
            ra[i].detach(), rb[i].detach(), flow[i].detach(), table, y0, y1, g[i],
            bilinear=win.flow_kind == "bilinear", mask_b=None if win.mask_b is None else win.mask_b[i],
            ga=None if grads[0] is None else grads[0][i], gb=None if grads[1] is None else grads[1][i],
            gf=None if grads[2] is None or win.flow_kind != "bilinear" else grads[2][i],
        )  # fmt: skip
