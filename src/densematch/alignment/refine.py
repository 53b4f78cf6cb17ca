"""Step 3 of :func:`densematch.align`: each candidate refined continuously (Levenberg-Marquardt
on the four warp parameters, with gain and bias for NCC), and the objective at a warp."""

from __future__ import annotations

import torch

from ..kernels import native
from .warp import sampling_matrix, warp_batch

__all__ = ["objective_at", "refine"]

_ITERATIONS = 25


def refine(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    start: torch.Tensor,
    range_h: tuple[float, float],
    range_w: tuple[float, float],
    photometric: bool,
    *,
    tolerance: float = 1e-3,
    in_c: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt on (scale_h, scale_w, shift_y, shift_x) [+ gain, bias], batched.

    Candidate i starts at ``start[i]`` (M, 4) and fits template ``owner[i]`` into its image.
    Returns the warps (M, 4) and, at each, the weighted sums of squared and of absolute residuals
    (M, 2) of the model fitted (after gain and bias where ``photometric``). A candidate is done
    once a step moves no template pixel by ``tolerance`` pixels or more. ``in_c``: each
    candidate in C (kernels/align.c, the same iteration), as the public call resolved it
    (:func:`densematch.kernels.ops_for`); torch's batched steps otherwise (and on a GPU)."""
    if in_c:
        return _refine_c(t, x, mask, owner, start, range_h, range_w, photometric, tolerance)
    m = owner.numel()
    h, w = t.shape[-2:]
    hh, ww = x.shape[-2:]
    r_idx = torch.arange(h, dtype=x.dtype, device=x.device)
    c_idx = torch.arange(w, dtype=x.dtype, device=x.device)
    n_par = 6 if photometric else 4
    p = torch.zeros(m, n_par, dtype=x.dtype, device=x.device)
    p[:, :4] = start
    if photometric:
        p[:, 4] = 1.0
    lam = torch.full((m,), 1e-3, dtype=x.dtype, device=x.device)
    sqrt_w = mask.sqrt()

    def project(q: torch.Tensor) -> torch.Tensor:
        q = q.clone()
        q[:, 0] = q[:, 0].clamp(*range_h)
        q[:, 1] = q[:, 1].clamp(*range_w)
        q[:, 2] = torch.minimum(q[:, 2].clamp_min(0), hh * q[:, 0] - h)
        q[:, 3] = torch.minimum(q[:, 3].clamp_min(0), ww * q[:, 1] - w)
        return q

    def residual(q: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cost (n,), J^T J (n, P, P) and J^T r (n, P) of the candidates ``sel`` at ``q``."""
        pair = owner[sel]
        xs, ts, ws = x[pair], t[pair], sqrt_w[pair]
        n = q.shape[0]
        ry = sampling_matrix(h, hh, q[:, 0], q[:, 2])
        rx = sampling_matrix(w, ww, q[:, 1], q[:, 3])
        dry = sampling_matrix(h, hh, q[:, 0], q[:, 2], derivative=True)
        drx = sampling_matrix(w, ww, q[:, 1], q[:, 3], derivative=True)
        a = ry[:, None] @ xs  # (n, c, h, W)
        warped = a @ rx[:, None].transpose(-1, -2)
        gy = (dry[:, None] @ xs) @ rx[:, None].transpose(-1, -2)  # d warped / d row coordinate
        gx = a @ drx[:, None].transpose(-1, -2)  # d warped / d column coordinate
        if photometric:
            gain, bias = q[:, 4, None, None, None], q[:, 5, None, None, None]
            model, gy, gx = warped * gain + bias, gy * gain, gx * gain
        else:
            model = warped
        res = (ws * (model - ts)).reshape(n, -1)
        dy_dsh = -(r_idx + q[:, 2, None] + 0.5) / q[:, 0, None] ** 2  # (n, h)
        dx_dsw = -(c_idx + q[:, 3, None] + 0.5) / q[:, 1, None] ** 2
        cols = [
            gy * dy_dsh[:, None, :, None],
            gx * dx_dsw[:, None, None, :],
            gy / q[:, 0, None, None, None],
            gx / q[:, 1, None, None, None],
        ]
        if photometric:
            cols += [warped, torch.ones_like(warped)]
        j = torch.stack([(ws * col).reshape(n, -1) for col in cols], dim=-1)
        return res.square().sum(1), j.transpose(1, 2) @ j, (j.transpose(1, 2) @ res[..., None])[..., 0]

    every = torch.arange(m, device=x.device)
    p = project(p)
    cost, jtj, jtr = residual(p, every)
    eye = torch.eye(n_par, dtype=x.dtype, device=x.device)
    scale = torch.tensor([h, w, 1.0, 1.0], dtype=x.dtype, device=x.device)
    active = every
    for _ in range(_ITERATIONS):
        # only candidates still moving are computed: batches stop paying for the slowest
        lam_a = lam[active]
        system = jtj[active] + (jtj[active] * eye) * lam_a[:, None, None] + eye * 1e-12
        step = torch.linalg.solve(system, -jtr[active][..., None])[..., 0]
        trial = project(p[active] + step)
        cost_t, jtj_t, jtr_t = residual(trial, active)
        moved = (step[:, :4].abs() * scale).amax(1)
        old = cost[active]
        better = cost_t < old
        gain = torch.where(better, (old - cost_t) / old.clamp_min(1e-30), 0.0)
        keep = better[:, None]
        p[active] = torch.where(keep, trial, p[active])
        jtj[active] = torch.where(keep[..., None], jtj_t, jtj[active])
        jtr[active] = torch.where(keep, jtr_t, jtr[active])
        cost[active] = torch.where(better, cost_t, old)
        lam[active] = torch.where(better, lam_a * 0.3, lam_a * 10).clamp(1e-9, 1e9)
        # done: a step under the tolerance (taken or not: any later one, damped more, is shorter),
        # stopped improving, or gave up
        done = (moved < tolerance) | (better & (gain < 1e-9)) | (~better & (lam_a * 10 >= 1e6))
        active = active[~done]
        if active.numel() == 0:
            break
    # cost holds each candidate's squared sum at p already; the absolute one takes one warp
    model = warp_batch(x[owner], p[:, 0], p[:, 1], p[:, 2], p[:, 3], (h, w))
    if photometric:
        model = model * p[:, 4, None, None, None] + p[:, 5, None, None, None]
    absolute = (mask[owner] * (model - t[owner]).abs()).sum((1, 2, 3))
    return p[:, :4], torch.stack((cost, absolute), 1)


def _refine_c(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    start: torch.Tensor,
    range_h: tuple[float, float],
    range_w: tuple[float, float],
    photometric: bool,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    used, owner = torch.unique(owner, return_inverse=True)  # only the pairs these candidates fit
    every = used.numel() == t.shape[0]  # unique sorts: then used is 0, 1, ..., B - 1
    t64, x64 = ((v if every else v[used]).double().contiguous() for v in (t, x))
    # uniform weights (a broadcast view) go once, shared by every pair
    w64 = mask[:1, 0] if mask.stride(0) == 0 else mask[:, 0] if every else mask[used, 0]
    w64 = w64.double().contiguous()
    start = start.double()
    if photometric:
        start = torch.cat((start, torch.ones_like(start[:, :1]), torch.zeros_like(start[:, :1])), 1)
    box = (*range_h, *range_w)
    p, sums = native.align_refine(t64, x64, w64, owner, start.contiguous(), box, _ITERATIONS, tolerance)
    return p[:, :4].to(x.dtype), sums.to(x.dtype)


def objective_at(
    t: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    owner: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    objective: str,
) -> torch.Tensor:
    """The objective (M,) of candidates (template ``owner[i]``) at the parameters."""
    t, x, mask = t[owner], x[owner], mask[owner]
    warped = warp_batch(x, *params, (t.shape[-2], t.shape[-1]))
    total = mask.sum((1, 2, 3)) * t.shape[1]
    diff = warped - t
    if objective == "l1":
        return (mask * diff.abs()).sum((1, 2, 3)) / total
    if objective == "l2":
        return (mask * diff.square()).sum((1, 2, 3)) / total
    mw = (mask * warped).sum((1, 2, 3)) / total
    mt = (mask * t).sum((1, 2, 3)) / total
    dw = warped - mw[:, None, None, None]
    dt = t - mt[:, None, None, None]
    cov = (mask * dw * dt).sum((1, 2, 3))
    var = ((mask * dw * dw).sum((1, 2, 3)) * (mask * dt * dt).sum((1, 2, 3))).sqrt().clamp_min(1e-12)
    return 1 - cov / var
