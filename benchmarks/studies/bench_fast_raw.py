"""precision="fast" and "exact" on raw (uncentred) patch features, half precision forced.

Raw 7x7 patches of camera: every cosine is near 0.9999, the hardest case for half precision.
Prints how many pixels get another index than float32, and for "exact" how far its differing
picks are from the float64 best (ties when within float32's own rounding).

Usage: python benchmarks/studies/bench_fast_raw.py
"""

from __future__ import annotations

import torch
from skimage import data

import densematch


def raw_patches(img: torch.Tensor, size: int = 7) -> torch.Tensor:
    x = img.float()[None, None] / 255.0
    p = torch.nn.functional.unfold(x, size, padding=size // 2)[0]
    return p.T.reshape(img.shape[0], img.shape[1], size * size)


def main() -> None:
    cam = torch.from_numpy(data.camera())
    a, b = raw_patches(cam[100:228, 100:228]), raw_patches(cam[104:232, 97:225])
    want = densematch.match(a, b, precision="float32")
    fa, fb = (torch.nn.functional.normalize(x.reshape(-1, 49).double(), dim=1) for x in (a, b))
    best = (fa @ fb.T).amax(1)
    print("| operands | fast: other index | exact: other index | exact: largest gap to the float64 best |")
    print("|---|---|---|---|")
    for half in ("bfloat16", "float16"):
        with densematch.config_context(half=half):
            fast = densematch.match(a, b, precision="fast")
            exact = densematch.match(a, b)
        differ = exact.index.reshape(-1) != want.index.reshape(-1)
        gap = (
            (best[differ] - (fa[differ] * fb[exact.index.reshape(-1)[differ]]).sum(1)).max().item()
            if differ.any()
            else 0.0
        )
        print(
            f"| {half} | {(fast.index != want.index).float().mean().item():.1%} | "
            f"{differ.float().mean().item():.1%} | {gap:.1e} |"
        )


if __name__ == "__main__":
    main()
