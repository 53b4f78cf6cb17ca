"""densematch's operators replaced by plain torch operators, for exporters that do not know them.

``torch.export`` keeps ``densematch::pairwise_distance``, ``densematch::topk``,
``densematch::soft_moments``, ``densematch::local_cost_volume`` and ``densematch::local_topk`` as
single nodes: the exported program runs them as eager does, on inputs of any size. ONNX has no
such operators, so :func:`decompose` rewrites them into torch operators that every ONNX runtime has,
computed whole (no tiles, no C kernels)::

    program = torch.export.export(model, (x,), dynamic_shapes=...)
    onnx_program = torch.onnx.export(densematch.onnx.decompose(program), dynamo=True)

The whole form holds what the tiles avoid: the (N, F, H, W) distances and, for l1 and linf, the
(N, HW, F, D) differences; the (Na, Nb) scores of a search and, for l1 and linf, their (Na, Nb,
C) differences; soft_match's (Na, Nb) weights; a local cost volume's candidates, gathered from
b for every offset at once, (B, window, H, W, C) (four of them for bilinear sampling). Values follow the direct forms of
:mod:`densematch.metrics` (equal to the operators' up to rounding); a search's ties go to ONNX
TopK's order, not always the lower index.
"""

from __future__ import annotations

import math

import torch

from .matching.soft import AUTO_SHARPNESS
from .metrics import get_metric

__all__ = ["decompose"]


def _whole_distance(
    x: torch.Tensor, p: torch.Tensor, metric: str, budget: int, use_c: bool, compiled: bool, check_finite: bool
) -> torch.Tensor:
    m = get_metric(metric)
    n, _d, h, w = x.shape
    dtype = torch.promote_types(torch.promote_types(x.dtype, p.dtype), torch.float32)
    rows = x.flatten(2).transpose(1, 2).to(dtype)[:, :, None, :]  # (N, HW, 1, D)
    value = m.distance(m.pair_value(rows, p.to(dtype)[None, None]))  # (N, HW, F)
    return value.transpose(1, 2).reshape(n, p.shape[0], h, w).to(x.dtype)


def _whole_topk(
    a: torch.Tensor,
    b: torch.Tensor,
    metric: str,
    k: int,
    budget: int,
    precision: str,
    dtype: torch.dtype,
    half: str,
    certify: bool,
    backend: str,
    candidates: int | None,
    rows_a: torch.Tensor | None,
    rows_b: torch.Tensor | None,
    reserved: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = get_metric(metric)
    q = (a if rows_a is None else a.index_select(0, rows_a)).to(dtype)
    r = b.to(dtype)
    score = m.direct_score(q[:, None, :], r[None, :, :])  # (na, Nb), higher is better
    if rows_b is not None:
        allowed = torch.zeros(r.shape[0], dtype=torch.bool, device=r.device).index_fill(0, rows_b, True)
        score = score.masked_fill(~allowed, -math.inf)
    _top, index = score.topk(k, dim=1)
    value = m.pair_value(q[:, None, :], r[index])
    return value, index


def _whole_soft(
    a: torch.Tensor,
    b: torch.Tensor,
    mask_b: torch.Tensor | None,
    values: torch.Tensor,
    scale: float,
    dual: bool,
    auto: bool,
    budget: int,
) -> tuple[torch.Tensor, ...]:
    cos = torch.nn.functional.normalize(a, dim=2) @ torch.nn.functional.normalize(b, dim=2).transpose(1, 2)
    allowed = None if mask_b is None else mask_b[:, None, :]
    if auto:  # AUTO_SHARPNESS / (best cosine - mean cosine) per row, over the allowed columns
        best = cos if allowed is None else cos.masked_fill(~allowed, -math.inf)
        mean = cos.mean(2) if allowed is None else (cos * allowed).sum(2) / allowed.sum(2)
        lead = best.amax(2) - mean
        row_scale = torch.where(lead > 0, AUTO_SHARPNESS / lead.clamp_min(torch.finfo(a.dtype).tiny), 1.0)
    else:
        row_scale = torch.ones_like(cos[..., 0])
    logits = cos * (scale * row_scale)[..., None]
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    plain_lse = torch.logsumexp(logits, 2)
    col_lse = torch.logsumexp(logits, 1) if dual else logits.new_empty((a.shape[0], 0))
    weighted = 2 * logits - col_lse[:, None, :] if dual else logits
    if dual and allowed is not None:
        weighted = weighted.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(weighted, 2)
    moments = torch.exp(weighted - lse[..., None]).double() @ values
    top = torch.exp(weighted.amax(2) - plain_lse)
    return moments, top, lse, col_lse, row_scale


def _whole_local(
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
    m = get_metric(metric)
    nb, h, w, c = a.shape
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    blended = flow is not None and flow.is_floating_point()
    ra, rb = (
        x.to(dtype) if mk is None else torch.where(mk[..., None], x.to(dtype), 0.0)
        for x, mk in ((a, mask_a), (b, mask_b))
    )
    if m.name == "cosine":  # unit rows, as the operator's preparation makes them (b raw under a blend)
        ra = _unit(ra)
        rb = rb if blended else _unit(rb)
    win = (2 * radius[0] + 1, 2 * radius[1] + 1)
    # every offset at once (P = the window's size): one graph of fixed size whatever the radius
    oy = (torch.arange(win[0], device=a.device) - radius[0]) * dilation[0]
    ox = (torch.arange(win[1], device=a.device) - radius[1]) * dilation[1]
    oy, ox = oy[:, None].expand(win).reshape(1, -1, 1, 1), ox[None, :].expand(win).reshape(1, -1, 1, 1)
    y = torch.arange(h, device=a.device, dtype=dtype)[None, None, :, None].expand(nb, 1, h, w)
    x = torch.arange(w, device=a.device, dtype=dtype)[None, None, None, :].expand(nb, 1, h, w)
    if flow is not None:
        y, x = y + flow[:, None, :, :, 0].to(dtype), x + flow[:, None, :, :, 1].to(dtype)
    top, left = y.floor(), x.floor()
    wy, wx = y - top, x - left
    corners: list[tuple[int, int, torch.Tensor | None]] = [(0, 0, None)]
    if blended:
        corners = [(0, 0, (1 - wy) * (1 - wx)), (0, 1, (1 - wy) * wx), (1, 0, wy * (1 - wx)), (1, 1, wy * wx)]
    ok = torch.ones((nb, 1, h, w), dtype=torch.bool, device=a.device) if mask_a is None else mask_a[:, None]
    flat, blend = rb.reshape(nb, h * w, c), None
    for cy, cx, weight in corners:
        qy, qx = top.long() + oy + cy, left.long() + ox + cx  # (B, P, H, W)
        inside = (qy >= 0) & (qy < h) & (qx >= 0) & (qx < w)
        q = (qy.clamp(0, h - 1) * w + qx.clamp(0, w - 1)).reshape(nb, -1, 1)
        if mask_b is not None:
            inside = inside & torch.gather(mask_b.reshape(nb, h * w, 1), 1, q).reshape(inside.shape)
        read = torch.gather(flat, 1, q.expand(-1, -1, c)).reshape(*inside.shape, c)
        if weight is not None:  # a corner of weight 0 may be missing
            inside = inside | (weight == 0)
            read = weight[..., None] * read
        ok = ok & inside
        blend = read if blend is None else blend + read
    assert blend is not None
    rows = ra[:, None]
    value = (rows * blend).sum(-1) if m.name == "cosine" and not blended else m.pair_value(rows, blend)
    return torch.where(ok, value, fill).reshape(nb, *win, h, w)


def _whole_local_topk(
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
    m = get_metric(metric)
    settings = (radius, dilation, sampling, metric, math.nan, budget, use_c)
    vol = _whole_local(a, b, flow, mask_a, mask_b, *settings).flatten(1, 2)  # (B, P, H, W), NaN: missing
    ranked = (vol if m.higher_is_better else -vol).nan_to_num(-math.inf, math.inf, -math.inf)
    _top, slot = ranked.topk(k, dim=1)
    value = vol.gather(1, slot)
    found = value.isnan().logical_not()
    value = torch.where(found, value, 0.0)
    cols = 2 * radius[1] + 1
    offsets = torch.stack(((slot // cols - radius[0]) * dilation[0], (slot % cols - radius[1]) * dilation[1]), -1)
    return value.permute(0, 2, 3, 1), offsets.permute(0, 2, 3, 1, 4), found.permute(0, 2, 3, 1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x / torch.where(norm > 0, norm, 1.0)


def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with densematch's operators rewritten into plain torch operators (see the
    module's notes for the memory this costs), for ``torch.onnx.export(..., dynamo=True)``.

    Parameters
    ----------
    program : torch.export.ExportedProgram
        What :func:`torch.export.export` made of a model holding densematch's functions or
        modules.

    Returns
    -------
    torch.export.ExportedProgram
        The same program, decomposed (also torch's own core-ATen decompositions).
    """
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(
            f"program must be a torch.export.ExportedProgram (from torch.export.export), got {type(program).__name__}"
        )
    table = torch.export.default_decompositions()
    table[torch.ops.densematch.pairwise_distance.default] = _whole_distance
    table[torch.ops.densematch.topk.default] = _whole_topk
    table[torch.ops.densematch.soft_moments.default] = _whole_soft
    table[torch.ops.densematch.local_cost_volume.default] = _whole_local
    table[torch.ops.densematch.local_topk.default] = _whole_local_topk
    return program.run_decompositions(table)
