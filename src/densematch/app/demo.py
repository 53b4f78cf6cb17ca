"""``densematch demo``: the main jobs on bundled sample images."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..alignment import align, shift_landscape, warp
from ..distances.prototypes import nearest_prototype, pairwise_distance
from ..matching.dense import match
from ..matching.options import MatchOptions
from .features import dense_features
from .recipes import blockwise_argmax  # its home before app.recipes, still importable from here
from .synthetic import pck
from .tasks import verdicts

__all__ = ["blockwise_argmax", "run_demo"]


def _sample(name: str) -> np.ndarray:
    try:
        from skimage import color, data
    except ImportError as err:
        raise ImportError("the demo's sample images come with scikit-image: pip install 'densematch[cli]'") from err
    img = getattr(data, name)()
    if img.ndim == 3:
        img = color.rgb2gray(img[..., :3])
    img = img.astype(np.float32)
    return (img - img.min()) / max(float(np.ptp(img)), 1e-6)


def _downsize(img: np.ndarray, factor: int) -> np.ndarray:
    t = torch.from_numpy(img)[None, None]
    return torch.nn.functional.avg_pool2d(t, factor)[0, 0].numpy()


def run_demo(out: Path, *, quiet: bool = False, progress: bool = False, parents: bool = False) -> int:
    """Match, align and distance on scikit-image's sample photographs; pictures into `out`.
    As ``mkdir`` does, `out` itself is created but not its missing parents, unless ``parents``:
    a mistyped absolute path must not become a tree at the file system's root."""
    say = (lambda *a: None) if quiet else print
    if not parents and not out.parent.is_dir():
        raise FileNotFoundError(
            f"--out {str(out)!r}: its folder {str(out.parent)!r} does not exist; create it, or pass --parents"
        )
    out.mkdir(parents=parents, exist_ok=True)
    from .summary import match_summary
    from .view import align_page, distance_page, match_page, write_page
    from .viz import align_figure, distance_figure, invalid_note, match_figure, save_figure

    # 1. dense matching: a photo against a zoomed, shifted view of itself
    cam = _downsize(_sample("camera"), 4)  # 128 x 128
    a_img = cam[8:104, 12:108]
    b_img = warp(torch.from_numpy(cam), 1.05, 1.05, 2.0, 6.0, (110, 118)).numpy()
    fa, fb = dense_features(a_img, "patch"), dense_features(b_img, "patch")
    t0 = time.perf_counter()
    r = match(fa, fb, mutual=True, ratio=0.9, progress=progress)
    seconds = time.perf_counter() - t0
    # where each pixel of A truly lands in B
    rows = (np.arange(96) + 8 + 0.5) * 1.05 - 0.5 - 2.0
    cols = (np.arange(96) + 12 + 0.5) * 1.05 - 0.5 - 6.0
    landing = np.stack(np.meshgrid(rows, cols, indexing="ij"), -1)
    valid = r.valid.numpy()
    everywhere = np.ones_like(valid)
    say(f"match: 96x96 against 110x118 patch features (C=49), mutual + ratio 0.9, {seconds * 1e3:.0f} ms")
    say(
        "       PCK@1/3/5 (within 1, 3, 5 px of the truth): every pixel "
        + " / ".join(f"{v:.2f}" for v in pck(r.coords.numpy(), landing, everywhere))
        + f"; the {valid.mean():.0%} valid ones "
        + " / ".join(f"{v:.2f}" for v in pck(r.coords.numpy(), landing, valid))
    )
    # the picture and the page explain each pixel's verdict, from one summary: the reverse pass
    # and the ratio of its best two
    reverse, ratio_value = verdicts(fa, fb, MatchOptions(mutual=True, ratio=0.9))
    summary = match_summary(r.numpy(), mutual=True, ratio=0.9, reverse=reverse, ratio_value=ratio_value)
    note = invalid_note(summary)
    save_figure(match_figure(a_img, b_img, r.coords.numpy(), r.score.numpy(), valid, "cosine", note), out / "match.png")
    write_page(
        out / "match.html",
        match_page(a_img, b_img, r.numpy(), metric="cosine", mutual=True, ratio=0.9, reverse=reverse,
                   ratio_value=ratio_value, summary=summary,
                   title="demo: camera against a zoomed, shifted view of itself"),
    )  # fmt: skip

    # 2. alignment: a template cut from a stretched photo, resampled by scikit-image (bicubic,
    # not densematch's own bilinear warp) with a little noise: the fit is close, not exact
    ast = _downsize(_sample("astronaut"), 4)[:125, :125]
    truth = {"scale_h": 1.07, "scale_w": 0.93, "shift_y": 7.3, "shift_x": 4.6}
    tpl = torch.from_numpy(_resampled(ast, truth, (100, 100)))
    t0 = time.perf_counter()
    a = align(tpl, ast)
    seconds = time.perf_counter() - t0
    found = a.as_dict()
    say(f"align: 100x100 into 125x125 in {seconds * 1e3:.0f} ms")
    say("       found " + "  ".join(f"{k} {found[k]:.4f}" for k in truth) + f"  (error {a.error:.2e})")
    say("       truth " + "  ".join(f"{k} {v:.4f}" for k, v in truth.items()))
    shown = (tpl.numpy(), a.warped.numpy(), a.landscape[0].numpy(), a.scales_h.numpy(), a.scales_w.numpy(), found)
    save_figure(align_figure(*shown), out / "align.png")
    around = shift_landscape(tpl, ast, float(a.scale_h), float(a.scale_w)).numpy()
    page = align_page(
        *shown, "l1", title="demo: a stretched crop of astronaut", shifts=a.landscape_shifts[0].numpy(), around=around
    )
    write_page(out / "align.html", page)

    # 3. prototypes: every pixel's nearest of 12 patch prototypes
    coins = _downsize(_sample("coins"), 2)
    x = dense_features(coins, "patch").permute(2, 0, 1)[None]  # (1, 49, H, W)
    g = torch.Generator().manual_seed(0)
    pick = torch.randperm(x.shape[2] * x.shape[3], generator=g)[:12]
    protos = x.flatten(2)[0, :, pick].T.contiguous()
    t0 = time.perf_counter()
    d, i = nearest_prototype(x, protos, metric="l2")
    full = pairwise_distance(x, protos, metric="l2")
    seconds = time.perf_counter() - t0
    agree = torch.equal(full.argmin(1), i)
    say(
        f"distance: {tuple(x.shape)} against 12 prototypes in {seconds * 1e3:.0f} ms; "
        f"nearest agrees with the full tensor's argmin: {agree}"
    )
    save_figure(distance_figure(coins, i[0].numpy(), d[0].numpy(), "l2"), out / "distance.png")
    d3, i3 = nearest_prototype(x, protos, metric="l2", k=3)
    write_page(
        out / "distance.html",
        distance_page(
            coins, i3[0].numpy(), d3[0].numpy(), "l2", 12, "demo: coins against 12 patch prototypes", full[0].numpy()
        ),
    )
    say(f"pictures: {out / 'match.png'}, {out / 'align.png'}, {out / 'distance.png'}")
    say(f"pages: {out / 'match.html'}, {out / 'align.html'}, {out / 'distance.html'} (open them in a browser)")
    return 0


def _resampled(image: np.ndarray, warp_: dict[str, float], size: tuple[int, int]) -> np.ndarray:
    """The template ``align`` should find, made by scikit-image's bicubic warp in align's
    convention (template pixel (r, c) shows the image at ((r + shift_y + 0.5) / scale_h - 0.5,
    (c + shift_x + 0.5) / scale_w - 0.5)), plus Gaussian noise of sigma 0.01."""
    transform: Any = importlib.import_module("skimage.transform")  # partly annotated: used as Any
    sh, sw, sy, sx = (warp_[k] for k in ("scale_h", "scale_w", "shift_y", "shift_x"))
    # scikit-image maps output (x, y) = (col, row) to input coordinates
    shift = ((sx + 0.5) / sw - 0.5, (sy + 0.5) / sh - 0.5)
    to_image = transform.AffineTransform(scale=(1 / sw, 1 / sh), translation=shift)
    out = transform.warp(image.astype(np.float64), to_image, output_shape=size, order=3, mode="edge")
    noise = np.random.default_rng(0).normal(0.0, 0.01, size)
    return (out + noise).astype(np.float32)
