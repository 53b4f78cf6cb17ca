"""The plain recipes people write instead of densematch, timed beside it by ``densematch bench``
and benchmarks/: each is the short torch code a user would reach for first, not a straw man.

Inputs follow the recipes' own habits: (H, W, C) or (N, C, H, W) features as stated, float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "blockwise_argmax",
    "coarse_to_fine_align",
    "dense_dual_softmax",
    "shifted_top1",
    "shifted_volume",
]


def blockwise_argmax(a: torch.Tensor, b: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The usual dense-matching loop: L2-normalise, (block x N) similarities, argmax per block.

    a (..., C), b (..., C) -> (Na,) flat indices into b's pixels."""
    a = F.normalize(a.reshape(-1, a.shape[-1]), dim=1)
    b = F.normalize(b.reshape(-1, b.shape[-1]), dim=1)
    out = torch.empty(a.shape[0], dtype=torch.int64, device=a.device)
    for i in range(0, a.shape[0], block):
        out[i : i + block] = (a[i : i + block] @ b.T).argmax(1)
    return out


def shifted_volume(a: torch.Tensor, b: torch.Tensor, radius: int) -> torch.Tensor:
    """PWC-Net's and RAFT's Python fall-back for a local cost volume: b padded by the radius, a
    times each shifted b, reduced over C: (2r+1)^2 products.

    a, b (N, C, H, W) -> (N, 2r+1, 2r+1, H, W) dot products (0 outside b)."""
    n, _c, h, w = a.shape
    p = 2 * radius + 1
    bp = F.pad(b, (radius,) * 4)
    out = [(a * bp[:, :, i : i + h, j : j + w]).sum(1) for i in range(p) for j in range(p)]
    return torch.stack(out, 1).view(n, p, p, h, w)


def shifted_top1(a: torch.Tensor, b: torch.Tensor, radius: int) -> torch.Tensor:
    """Each pixel's best offset by cosine similarity, from :func:`shifted_volume` of the
    normalised maps: (N, H, W) indices into the (2r+1)^2 offsets, row-major."""
    return shifted_volume(F.normalize(a, dim=1), F.normalize(b, dim=1), radius).flatten(1, 2).argmax(1)


def dense_dual_softmax(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """LoFTR's dual softmax written densely: every pair's cosine similarity over the temperature,
    softmax along both axes, their product, each row renormalised, and the expected position in
    b. a, b (H, W, C) -> (H * W, 2) (row, col) positions."""
    c = a.shape[-1]
    q, k = F.normalize(a.reshape(-1, c), dim=1), F.normalize(b.reshape(-1, c), dim=1)
    s = q @ k.T / temperature
    p = s.softmax(1) * s.softmax(0)
    grid = torch.meshgrid(*(torch.arange(n, dtype=a.dtype, device=a.device) for n in b.shape[:2]), indexing="ij")
    return (p / p.sum(1, keepdim=True)) @ torch.stack(grid, -1).reshape(-1, 2)


def _l1_at(t: torch.Tensor, x: torch.Tensor, params: torch.Tensor, chunk: int = 512) -> torch.Tensor:
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


def _inside(p: torch.Tensor, h: int, w: int, hh: int, ww: int) -> torch.Tensor:
    return (p[:, 2] >= 0) & (p[:, 3] >= 0) & (p[:, 2] <= hh * p[:, 0] - h) & (p[:, 3] <= ww * p[:, 1] - w)


def coarse_to_fine_align(
    template: torch.Tensor, image: torch.Tensor, keep: int = 5
) -> tuple[float, float, float, float]:
    """The usual coarse-to-fine search for a stretch and shift, in :func:`densematch.align`'s
    convention: a coarse grid (scales 0.8..1.2 in 5% steps, shifts in 10-pixel steps), the best
    ``keep`` refined on a finer grid around each (1% and 1 pixel, +-2% and +-5 px), by the mean
    absolute error. Never finer than 1% and one pixel.

    template (h, w), image (H, W) -> (scale_h, scale_w, shift_y, shift_x)."""
    t, x = template[None, None].float(), image[None, None].float()
    h, w = template.shape
    hh, ww = image.shape
    scales = torch.arange(0.8, 1.2001, 0.05)
    sy = torch.arange(0, int(hh * 1.2), 10.0)
    sx = torch.arange(0, int(ww * 1.2), 10.0)
    grid = torch.cartesian_prod(scales, scales, sy, sx)
    grid = grid[_inside(grid, h, w, hh, ww)]
    err = _l1_at(t, x, grid)
    best = grid[err.topk(min(keep, len(err)), largest=False).indices]
    d_s = torch.arange(-0.02, 0.0201, 0.01)
    d_p = torch.arange(-5, 6, 1.0)
    offsets = torch.cartesian_prod(d_s, d_s, d_p, d_p)
    fine = torch.cat([b + offsets for b in best])
    fine = fine[_inside(fine, h, w, hh, ww)]
    p = fine[_l1_at(t, x, fine).argmin()]
    return (float(p[0]), float(p[1]), float(p[2]), float(p[3]))
