"""Alignment cases with a known answer, from real photographs and random binary masks, and
same-scene feature pairs for matching (:func:`same_scene_pair`).

Used by the tests and benchmarks/suites/bench_align.py; photographs come from scikit-image's bundled
samples (no network), so this module needs scikit-image for kind="photo".
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "AlignmentCase",
    "MatchPair",
    "alignment_cases",
    "match_pairs",
    "pck",
    "reference_warp",
    "same_scene_pair",
]

PHOTOS = (
    "camera",
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "coins",
    "moon",
    "immunohistochemistry",
    "hubble_deep_field",
    "grass",
    "gravel",
    "brick",
)
SIZES = (((100, 100), (125, 125)), ((64, 80), (80, 100)), ((90, 120), (120, 150)))


@dataclass
class AlignmentCase:
    """One template and image with the warp that made the template."""

    template: torch.Tensor
    image: torch.Tensor
    scale_h: float
    scale_w: float
    shift_y: float
    shift_x: float
    source: str
    noise: float


def reference_warp(
    image: torch.Tensor, scale_h: float, scale_w: float, shift_y: float, shift_x: float, size: tuple[int, int]
) -> torch.Tensor:
    """:func:`densematch.warp`'s convention (docs/align.md) through ``grid_sample``: an
    implementation independent of align's own, for checking it."""
    hh, ww = image.shape[-2:]
    r = torch.arange(size[0], dtype=torch.float64)
    c = torch.arange(size[1], dtype=torch.float64)
    y = ((r + shift_y + 0.5) / scale_h - 0.5).clamp(0, hh - 1)
    x = ((c + shift_x + 0.5) / scale_w - 0.5).clamp(0, ww - 1)
    # grid_sample with align_corners=True maps -1..1 onto pixel centres 0..n-1
    gy = (2 * y / max(hh - 1, 1) - 1)[:, None].expand(size)
    gx = (2 * x / max(ww - 1, 1) - 1)[None, :].expand(size)
    grid = torch.stack((gx, gy), -1)[None]
    out = F.grid_sample(image[None, None].double(), grid, mode="bilinear", align_corners=True)
    return out[0, 0].to(image.dtype)


@functools.cache
def _photo(name: str) -> np.ndarray:
    from skimage import color, data

    img = getattr(data, name)()
    if img.ndim == 3:
        img = color.rgb2gray(img[..., :3])
    img = img.astype(np.float64)
    return (img - img.min()) / max(np.ptp(img), 1e-12)


@functools.cache
def _pooled_photo(name: str, factor: int) -> np.ndarray:
    img = _photo(name)
    if factor == 1:
        return img
    img = F.avg_pool2d(torch.from_numpy(img)[None, None], factor)[0, 0].numpy()
    return (img - img.min()) / max(np.ptp(img), 1e-12)


def _ellipses(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    hh, ww = shape
    yy, xx = np.mgrid[:hh, :ww]
    out = np.zeros(shape, dtype=bool)
    for _ in range(rng.integers(3, 9)):
        cy, cx = rng.uniform(0, hh), rng.uniform(0, ww)
        ay, ax = rng.uniform(0.08, 0.35) * hh, rng.uniform(0.08, 0.35) * ww
        theta = rng.uniform(0, np.pi)
        dy, dx = yy - cy, xx - cx
        u = dy * np.cos(theta) + dx * np.sin(theta)
        v = -dy * np.sin(theta) + dx * np.cos(theta)
        out |= (u / ay) ** 2 + (v / ax) ** 2 <= 1
    return out.astype(np.float64)


def alignment_cases(
    n: int,
    *,
    seed: int = 0,
    kinds: tuple[str, ...] = ("photo", "mask"),
    sizes: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = SIZES,
    scale_range: tuple[float, float] = (0.82, 1.18),
    noise: tuple[float, ...] = (0.0, 0.02),
    photos: tuple[str, ...] = PHOTOS,
    pooled: int = 1,
    cycle: bool = False,
) -> Iterator[AlignmentCase]:
    """Yield `n` cases cycling through kinds, sizes and noise levels, with continuous scales in
    `scale_range` and fractional shifts anywhere the template fits. Photographs are picked at
    random, or in turn with `cycle`; `pooled`: average-pooled by that factor first (and scaled
    back to 0..1), as images shrunk for a search are."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        kind = kinds[i % len(kinds)]
        (h, w), (hh, ww) = sizes[(i // len(kinds)) % len(sizes)]
        sigma = noise[(i // (len(kinds) * len(sizes))) % len(noise)]
        if kind == "photo":
            name = photos[(i // len(kinds)) % len(photos)] if cycle else photos[rng.integers(len(photos))]
            src = _pooled_photo(name, pooled)
            y0, x0 = rng.integers(0, src.shape[0] - hh + 1), rng.integers(0, src.shape[1] - ww + 1)
            image = src[y0 : y0 + hh, x0 : x0 + ww]
        else:
            name = "ellipses"
            image = _ellipses(rng, (hh, ww))
        sh, sw = rng.uniform(*scale_range, size=2)
        sy = rng.uniform(0, hh * sh - h)
        sx = rng.uniform(0, ww * sw - w)
        img = torch.from_numpy(image).float()
        tpl = reference_warp(img, sh, sw, sy, sx, (h, w))
        if sigma:
            tpl = tpl + sigma * torch.from_numpy(rng.standard_normal((h, w))).float()
        yield AlignmentCase(tpl, img, float(sh), float(sw), float(sy), float(sx), name, sigma)


@dataclass
class MatchPair:
    """Two views of one photograph with the true position in ``b`` of every pixel of ``a``.

    Attributes
    ----------
    name : str
        The warp: "shift", "affine" or "homography".
    a, b : ndarray of shape (h, w, 3) and (H, W, 3)
        Colour images in [0, 1].
    truth : ndarray of shape (h, w, 2)
        Where each pixel of ``a`` lies in ``b`` (row, col), float.
    inside : ndarray of shape (h, w), bool
        The pixels of ``a`` whose true position lies inside ``b``.
    """

    name: str
    a: np.ndarray
    b: np.ndarray
    truth: np.ndarray
    inside: np.ndarray


def match_pairs(size: int = 96) -> list[MatchPair]:
    """Three pairs with known warps, for judging features by PCK: a pure integer shift
    (chelsea), an affine warp (rotation 8 degrees, scales 1.1 and 0.95, astronaut) and a
    homography (coffee). ``a`` is a size x size crop of the photograph (halved), ``b`` the
    photograph resampled (bilinear) through the warp, of size + 16 pixels a side. Needs
    scikit-image.
    """
    from skimage import data

    transform: Any = importlib.import_module("skimage.transform")  # partly annotated: used as Any
    out = []
    height = size + 16
    for name, photo in (("shift", "chelsea"), ("affine", "astronaut"), ("homography", "coffee")):
        s = getattr(data, photo)()[::2, ::2].astype(np.float64) / 255
        y0, x0 = (s.shape[0] - size) // 2, (s.shape[1] - size) // 2
        # t maps b's (x, y) to the photograph's (x, y)
        centre = np.array([x0 + size / 2, y0 + size / 2])
        to_b_centre = transform.AffineTransform(translation=-np.array([height / 2, height / 2]))
        if name == "shift":
            t = transform.AffineTransform(translation=(x0 - 9, y0 + 12))
        elif name == "affine":
            local = transform.AffineTransform(scale=(1.1, 0.95), rotation=np.deg2rad(8), shear=np.deg2rad(3))
            t = transform.AffineTransform(
                matrix=transform.AffineTransform(translation=centre).params @ local.params @ to_b_centre.params
            )
        else:
            h = np.array([[1.05, 0.08, 0.0], [-0.05, 0.98, 0.0], [4e-4, -3e-4, 1.0]])
            t = transform.ProjectiveTransform(
                matrix=transform.AffineTransform(translation=centre).params @ h @ to_b_centre.params
            )
        b = transform.warp(s, t, output_shape=(height, height), order=1, mode="reflect")
        a = s[y0 : y0 + size, x0 : x0 + size]
        rows, cols = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
        xy = t.inverse(np.stack([cols.ravel() + x0, rows.ravel() + y0], 1))
        truth = np.stack([xy[:, 1], xy[:, 0]], 1).reshape(size, size, 2)
        inside = (truth >= 0).all(-1) & (truth[..., 0] <= height - 1) & (truth[..., 1] <= height - 1)
        out.append(MatchPair(name, a.astype(np.float32), b.astype(np.float32), truth, inside))
    return out


def pck(
    coords: np.ndarray, truth: np.ndarray, keep: np.ndarray, thresholds: tuple[float, ...] = (1, 3, 5)
) -> list[float]:
    """Percentage of correct keypoints: the fraction of the ``keep`` pixels whose match
    ``coords`` (h, w, 2) lies within each threshold (pixels, Euclidean) of ``truth``."""
    err = np.linalg.norm(np.asarray(coords, dtype=np.float64) - truth, axis=-1)[keep]
    return [float((err <= t).mean()) if err.size else float("nan") for t in thresholds]


def same_scene_pair(
    h: int,
    w: int,
    c: int,
    *,
    photo: str = "astronaut",
    shift: tuple[int, int] = (6, -3),
    noise: float = 0.02,
    origin: tuple[int, int] = (100, 150),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w, c) float32 features of two overlapping crops of one photograph, as a new user
    makes them: raw colour patches (not normalised) reduced to ``c`` channels by PCA.

    The second crop is moved by ``shift`` (rows, columns) and given Gaussian noise of
    ``noise``. Patches are the smallest odd size whose three channels hold at least ``c``
    values (5x5 for c=64, 23x23 for c=1536), reflected at the border, projected onto the top
    ``c`` principal axes of the first crop's patches without removing their mean. Smooth regions
    keep their common component, so each of their pixels has dozens of references within
    bfloat16's resolution of its best: the hard case for a half-precision certificate. Needs
    scikit-image.
    """
    from skimage import data

    photo_rgb = getattr(data, photo)().astype(np.float64) / 255
    if photo_rgb.ndim == 2:
        photo_rgb = np.repeat(photo_rgb[..., None], 3, axis=2)
    top, left = origin
    crops = [
        photo_rgb[top : top + h, left : left + w, :3],
        photo_rgb[top + shift[0] : top + shift[0] + h, left + shift[1] : left + shift[1] + w, :3],
    ]
    if any(x.shape[:2] != (h, w) for x in crops):
        raise ValueError(f"h and w must fit inside {photo!r} from {origin} moved by {shift}, got {h} x {w}")
    rng = np.random.default_rng(0)
    crops[1] = crops[1] + rng.normal(0.0, noise, crops[1].shape)
    size = max(1, int(np.ceil((c / 3) ** 0.5))) | 1
    pad = size // 2
    patches = []
    for crop in crops:
        img = torch.from_numpy(np.ascontiguousarray(crop, dtype=np.float32)).permute(2, 0, 1)[None]
        img = F.pad(img, (pad, pad, pad, pad), mode="reflect" if min(h, w) > pad else "replicate")
        patches.append(F.unfold(img, size)[0].T.double())  # (h*w, 3*size*size)
    first = patches[0]
    _, _, v = torch.linalg.svd(first - first.mean(0), full_matrices=False)
    axes = v[:c].T
    if axes.shape[1] < c:  # fewer pixels than channels: pad the projection with zero columns
        axes = F.pad(axes, (0, c - axes.shape[1]))
    return tuple((p @ axes).float().reshape(h, w, c) for p in patches)
