"""Pictures of results (needs matplotlib; imported only here)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .io import FIGURE_OUTPUTS, check_output, save_with

__all__ = ["align_figure", "distance_figure", "flow_colors", "match_figure", "save_figure"]


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("pictures need matplotlib: pip install 'densematch[viz]'") from err
    return plt


def flow_colors(coords: np.ndarray, grid_b: tuple[int, int], valid: np.ndarray | None = None) -> np.ndarray:
    """RGB (H, W, 3) in [0, 1]: each pixel coloured by where it lands in b, on a colour wheel
    centred on b (hue: direction from b's centre, saturation: distance); black where invalid."""
    from matplotlib.colors import hsv_to_rgb

    hb, wb = grid_b
    dy = (coords[..., 0] - (hb - 1) / 2) / max(hb / 2, 1)
    dx = (coords[..., 1] - (wb - 1) / 2) / max(wb / 2, 1)
    hue = (np.arctan2(dy, dx) / (2 * np.pi)) % 1.0
    sat = np.clip(np.hypot(dy, dx) / np.sqrt(2), 0, 1)
    rgb = hsv_to_rgb(np.stack([hue, sat, np.ones_like(hue)], -1))
    if valid is not None:
        rgb[~valid] = 0
    return rgb


def _show(ax: Any, image: np.ndarray, title: str, **kw: Any) -> None:
    ax.imshow(image, **({"cmap": "gray"} if image.ndim == 2 else {}) | kw)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


def match_figure(
    a: np.ndarray, b: np.ndarray, coords: np.ndarray, score: np.ndarray, valid: np.ndarray, metric: str
) -> Any:
    """A, B with its colour key, the match field, B pulled back onto A's grid, and the score."""
    plt = _plt()
    hb, wb = b.shape[:2]
    fig, axes = plt.subplots(2, 3, figsize=(11, 7.5))
    _show(axes[0, 0], a, "A")
    _show(axes[0, 1], b, "B")
    key = np.stack(np.meshgrid(np.arange(hb), np.arange(wb), indexing="ij"), -1)
    _show(axes[0, 2], flow_colors(key, (hb, wb)), "colour key: position in B")
    _show(axes[1, 0], flow_colors(coords, (hb, wb), valid), f"match field ({valid.mean():.0%} valid)")
    pulled = b[coords[..., 0].clip(0), coords[..., 1].clip(0)]
    pulled[~valid] = 0
    _show(axes[1, 1], pulled, "B pulled back onto A's grid")
    im = axes[1, 2].imshow(np.where(valid, score, np.nan), cmap="viridis")
    axes[1, 2].set_title(f"score ({metric})", fontsize=9)
    axes[1, 2].axis("off")
    fig.colorbar(im, ax=axes[1, 2], fraction=0.046)
    fig.tight_layout()
    return fig


def align_figure(
    template: np.ndarray,
    warped: np.ndarray,
    landscape: np.ndarray,
    scales_h: np.ndarray,
    scales_w: np.ndarray,
    answer: dict[str, float],
) -> Any:
    """Template, warped image, their difference, and the error landscape over the scales."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    _show(axes[0], template, "template")
    _show(axes[1], warped, "image, stretched and cropped")
    diff = np.abs(warped - template)
    # a fixed scale, so that a perfect fit looks black rather than amplified rounding noise
    _show(
        axes[2],
        diff if diff.ndim == 2 else diff.mean(-1),
        f"|difference| (mean {diff.mean():.4f})",
        cmap="magma",
        vmin=0.0,
        vmax=max(0.1, float(diff.max())),
    )
    extent = (scales_w[0], scales_w[-1], scales_h[-1], scales_h[0])
    im = axes[3].imshow(landscape, extent=extent, aspect="auto", cmap="viridis")
    axes[3].plot(answer["scale_w"], answer["scale_h"], "r+", ms=12, mew=2)
    axes[3].set_xlabel("scale_w")
    axes[3].set_ylabel("scale_h")
    axes[3].set_title("search error over the scales", fontsize=9)
    fig.colorbar(im, ax=axes[3], fraction=0.046)
    fig.suptitle(
        "scale_h={scale_h:.4f}  scale_w={scale_w:.4f}  shift_y={shift_y:.2f}  shift_x={shift_x:.2f}".format(**answer),
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def distance_figure(image: np.ndarray, index: np.ndarray, distance: np.ndarray, metric: str) -> Any:
    """An image, the nearest prototype of each pixel, and its distance."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    _show(axes[0], image, "image")
    _show(axes[1], index, "nearest prototype", cmap="tab20", interpolation="nearest")
    im = axes[2].imshow(distance, cmap="viridis")
    axes[2].set_title(f"distance ({metric})", fontsize=9)
    axes[2].axis("off")
    fig.colorbar(im, ax=axes[2], fraction=0.046)
    fig.tight_layout()
    return fig


def save_figure(fig: Any, path: str | os.PathLike[str]) -> None:
    """Write a figure atomically in the format its extension names (PNG, JPEG, PDF or SVG), then
    close it."""
    plt = _plt()
    kind = check_output(path, "--viz", FIGURE_OUTPUTS).suffix.lower()[1:]
    try:
        save_with(path, lambda f: fig.savefig(f, format=kind, dpi=110))
    finally:
        plt.close(fig)
