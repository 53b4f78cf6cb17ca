"""Pictures of results (needs matplotlib; imported only here)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .io import FIGURE_OUTPUTS, check_output, save_with
from .summary import REASONS

__all__ = [
    "align_figure",
    "alignment_difference",
    "distance_figure",
    "flow_colors",
    "invalid_note",
    "match_figure",
    "save_figure",
]


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


def _invalid_key(ax: Any) -> None:
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="black", label="invalid")], loc="lower right", fontsize=7, framealpha=0.8)


def invalid_note(summary: dict[str, Any]) -> str | None:
    """Why a match picture shows many invalid pixels, from its :func:`.summary.match_summary`:
    each reason that counts a pixel, most first, as :data:`.summary.REASONS` explains it."""
    if summary["valid_fraction"] >= 0.9 or not summary["pixels"]:
        return None
    counted = sorted(((n, why) for why, n in summary["invalid"].items() if n), reverse=True)
    parts = [f"{n / summary['pixels']:.0%} {REASONS[why]}" for n, why in counted]
    return (
        f"{1 - summary['valid_fraction']:.0%} of A's pixels invalid (black), by their best match: "
        + "; ".join(parts)
        + "."
    )


def match_figure(
    a: np.ndarray,
    b: np.ndarray,
    coords: np.ndarray,
    score: np.ndarray,
    valid: np.ndarray,
    metric: str,
    note: str | None = None,
) -> Any:
    """A, B with its colour key, the match field, B pulled back onto A's grid, and the score;
    invalid pixels black (with a key), and ``note`` under the panels."""
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
    for ax in (axes[1, 0], axes[1, 1]):
        _invalid_key(ax)
    im = axes[1, 2].imshow(np.where(valid, score, np.nan), cmap="viridis")
    axes[1, 2].set_title(f"score ({metric}; invalid blank)", fontsize=9)
    axes[1, 2].axis("off")
    fig.colorbar(im, ax=axes[1, 2], fraction=0.046)
    fig.tight_layout()
    if note:
        fig.subplots_adjust(bottom=0.09)
        fig.text(0.5, 0.015, note, ha="center", fontsize=8.5, wrap=True)
    return fig


def _standardised(v: np.ndarray) -> np.ndarray:
    return (v - v.mean()) / max(float(v.std()), 1e-12)


def alignment_difference(template: np.ndarray, warped: np.ndarray, objective: str) -> tuple[np.ndarray, str, float]:
    """|warped - template| (h, w) under ``objective`` (for "ncc", of the two standardised: gain
    and bias removed), its label, and the top of its colour scale: a fixed floor of 0.1, so
    that a perfect fit looks black rather than amplified noise. The picture's and the page's."""
    if objective == "ncc":
        diff, what = np.abs(_standardised(warped) - _standardised(template)), "|difference| after gain and bias (ncc)"
    else:
        diff, what = np.abs(warped - template), f"|difference| ({objective})"
    diff = diff if diff.ndim == 2 else diff.mean(-1)
    return diff, what, max(0.1, float(np.percentile(diff, 99.5)))


def align_figure(
    template: np.ndarray,
    warped: np.ndarray,
    landscape: np.ndarray,
    scales_h: np.ndarray,
    scales_w: np.ndarray,
    answer: dict[str, Any],
    objective: str = "l1",
) -> Any:
    """Template, warped image, their difference under ``objective`` (for "ncc", of the two
    standardised, gain and bias removed) with its colour bar, and the search's error landscape
    over the scales with the answer marked."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.9))
    _show(axes[0], template, "template")
    _show(axes[1], warped, "image, stretched and cropped")
    diff, what, top = alignment_difference(template, warped, objective)
    im = axes[2].imshow(diff, cmap="magma", vmin=0.0, vmax=top)
    axes[2].set_title(f"{what}, mean {diff.mean():.4f}", fontsize=9)
    axes[2].axis("off")
    fig.colorbar(im, ax=axes[2], fraction=0.046)
    # pixel edges half a step beyond the first and last scales: the answer's marker stays inside
    step_w = (scales_w[-1] - scales_w[0]) / max(len(scales_w) - 1, 1) / 2
    step_h = (scales_h[-1] - scales_h[0]) / max(len(scales_h) - 1, 1) / 2
    extent = (scales_w[0] - step_w, scales_w[-1] + step_w, scales_h[-1] + step_h, scales_h[0] - step_h)
    im = axes[3].imshow(landscape, extent=extent, aspect="auto", cmap="viridis")
    axes[3].plot(answer["scale_w"], answer["scale_h"], "r+", ms=12, mew=2, clip_on=False, label="answer")
    axes[3].legend(loc="upper right", fontsize=7, framealpha=0.8)
    axes[3].set_xlabel("scale_w")
    axes[3].set_ylabel("scale_h")
    axes[3].set_title("grid search's best error per (scale_h, scale_w)", fontsize=9)
    bar = fig.colorbar(im, ax=axes[3], fraction=0.046)
    bar.set_label("1 - NCC" if objective == "ncc" else "mean squared error", fontsize=8)
    title = "scale_h={scale_h:.4f}  scale_w={scale_w:.4f}  shift_y={shift_y:.2f}  shift_x={shift_x:.2f}".format(
        **answer
    )
    if answer.get("at_bound"):
        title += f"   (at the end of the range: {', '.join(answer['at_bound'])})"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def distance_figure(image: np.ndarray, index: np.ndarray, distance: np.ndarray, metric: str) -> Any:
    """An image, the nearest prototype of each pixel (a key per prototype), and its distance."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from .view import prototype_colors

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.9))
    _show(axes[0], image, "image")
    count = int(index.max()) + 1 if index.size else 1
    # the pages' colours (colour-blind safe up to eight prototypes): one legend for both
    cmap = ListedColormap(prototype_colors(max(count, 2)))
    _show(axes[1], index, "nearest prototype", cmap=cmap, vmin=-0.5, vmax=max(count, 2) - 0.5, interpolation="nearest")
    if count <= 20:
        handles = [Patch(color=cmap(i), label=f"prototype {i}") for i in range(count)]
        axes[1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    im = axes[2].imshow(distance, cmap="viridis")
    axes[2].set_title(f"distance ({metric}) to it", fontsize=9)
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
