"""The usual coarse-to-fine recipe for stretch-and-shift search (the benchmark's baseline).

Coarse grid: scales in 5% steps, shifts in 10-pixel steps, bilinear resampling, L1 error, all
candidates batched; keep the best 5; refine around each at 1% scale steps (+-2%) and 1-pixel
shifts (+-5 px). Its answer is never finer than 1% and one pixel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l1(t: torch.Tensor, x: torch.Tensor, params: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Mean absolute error of the template against the image warped by each parameter row,
    through grid_sample (bilinear), as the recipe writes it."""
    h, w = t.shape[-2:]
    hh, ww = x.shape[-2:]
    r = torch.arange(h, dtype=torch.float32)
    c = torch.arange(w, dtype=torch.float32)
    out = []
    for s in range(0, params.shape[0], chunk):
        p = params[s : s + chunk]
        m = p.shape[0]
        y = ((r + p[:, 2:3] + 0.5) / p[:, 0:1] - 0.5) * 2 / (hh - 1) - 1
        xx = ((c + p[:, 3:4] + 0.5) / p[:, 1:2] - 0.5) * 2 / (ww - 1) - 1
        grid = torch.stack((xx[:, None, :].expand(m, h, w), y[:, :, None].expand(m, h, w)), -1)
        warped = F.grid_sample(x.expand(m, 1, hh, ww), grid, mode="bilinear", padding_mode="border", align_corners=True)
        out.append((warped - t).abs().mean((1, 2, 3)))
    return torch.cat(out)


def _valid(p: torch.Tensor, h: int, w: int, hh: int, ww: int) -> torch.Tensor:
    return (p[:, 2] >= 0) & (p[:, 3] >= 0) & (p[:, 2] <= hh * p[:, 0] - h) & (p[:, 3] <= ww * p[:, 1] - w)


def baseline_align(template: torch.Tensor, image: torch.Tensor, keep: int = 5) -> tuple[float, float, float, float]:
    """(scale_h, scale_w, shift_y, shift_x) by the usual recipe, for 2-D float tensors."""
    t, x = template[None, None].float(), image[None, None].float()
    h, w = template.shape
    hh, ww = image.shape
    scales = torch.arange(0.8, 1.2001, 0.05)
    sy = torch.arange(0, int(hh * 1.2), 10.0)
    sx = torch.arange(0, int(ww * 1.2), 10.0)
    grid = torch.cartesian_prod(scales, scales, sy, sx)
    grid = grid[_valid(grid, h, w, hh, ww)]
    err = _l1(t, x, grid)
    best = grid[err.topk(min(keep, len(err)), largest=False).indices]
    fine = []
    d_s = torch.arange(-0.02, 0.0201, 0.01)
    d_p = torch.arange(-5, 6, 1.0)
    offsets = torch.cartesian_prod(d_s, d_s, d_p, d_p)
    for b in best:
        fine.append(b + offsets)
    fine = torch.cat(fine)
    fine = fine[_valid(fine, h, w, hh, ww)]
    err = _l1(t, x, fine)
    p = fine[err.argmin()]
    return tuple(float(v) for v in p)
