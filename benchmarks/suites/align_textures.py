"""align on the inputs where its coarse level loses the template: fine periodic textures and
texture over a large level, beside the photographs it was tuned on, for one or more source trees.

Run: python benchmarks/suites/align_textures.py [SRC ...] [--labels A,B] [--rounds 1]

Each SRC is a checkout's src/ folder (default: this one's), run in its own process in turn.
Families (a template warped from the image in align's convention, default scale ranges):
- "periodic": sin(2 pi x / p) + sin(2 pi y / p) and their product, p in 3..11, templates of
  64, 100 and 120 px in images 1.25x larger, 4 random warps each (168 cases);
- "noise on a level": uniform noise in [0, 1) plus 0, 100 or 500 (8 warps each);
- "camera on a level": 125x125 crops of scikit-image's camera plus 0, 100 or 1000 (10 each);
- "photos": bench_align_global's photographs (2 per photograph), the cases align was tuned on.
A case is hit when the answer's own error is at most 1e-3 above the truth's (a periodic image
is fitted as well one whole period away). Times: the median seconds per call, one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import alternate_trees, report

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")


def families() -> dict[str, list[tuple]]:
    import torch
    from skimage import data

    from densematch.app.synthetic import PHOTOS, alignment_cases

    g = torch.Generator().manual_seed(1)

    def truth(image: tuple[int, int], size: tuple[int, int]) -> tuple[float, ...]:
        """A warp under which the template lies wholly inside the stretched image, as align
        searches (0 <= shift <= H * scale - h): shifts past that are moved to it. Drawn without
        that rule (before 2026-12-05), 3 of the 54 non-periodic cases asked align for a
        template reaching up to 2 px past the image, and counted its best fit inside as a miss."""
        u = torch.rand(4, generator=g).tolist()
        sh, sw = 0.85 + 0.3 * u[0], 0.85 + 0.3 * u[1]
        sy = min(2 + 8 * u[2], image[0] * sh - size[0])
        sx = min(2 + 8 * u[3], image[1] * sw - size[1])
        return (sh, sw, sy, sx)

    out: dict[str, list[tuple]] = {"periodic": [], "noise on a level": [], "camera on a level": [], "photos": []}
    for side, big in ((100, 125), (64, 80), (120, 150)):
        yy, xx = torch.meshgrid(torch.arange(float(big)), torch.arange(float(big + 10)), indexing="ij")
        for p in (3, 4, 5, 6, 7, 8, 11):
            sx, sy = torch.sin(2 * math.pi * xx / p), torch.sin(2 * math.pi * yy / p)
            for image in (sx + sy, sx * sy):
                out["periodic"] += [(image, truth(image.shape, (side, side)), (side, side)) for _ in range(4)]
    noise = torch.rand(125, 125, generator=g)
    out["noise on a level"] = [
        (noise + level, truth(noise.shape, (100, 100)), (100, 100)) for level in (0, 100, 500) for _ in range(8)
    ]
    camera = torch.from_numpy(data.camera()).float() / 255
    out["camera on a level"] = [
        (camera[40 * i : 40 * i + 125, 30 * i : 30 * i + 125] + level, truth((125, 125), (100, 100)), (100, 100))
        for level in (0, 100, 1000)
        for i in range(10)
    ]
    for c in alignment_cases(2 * len(PHOTOS), seed=0, kinds=("photo",), sizes=(((100, 100), (125, 125)),),
                             noise=(0.01,), scale_range=(0.8, 1.2), pooled=2, cycle=True):  # fmt: skip
        warp_args = (c.scale_h, c.scale_w, c.shift_y, c.shift_x)
        out["photos"].append((c.image, warp_args, tuple(c.template.shape), c.template))
    return out


def child(src: str) -> None:
    sys.path.insert(0, src)
    import warnings

    import torch

    import densematch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    got = {}
    for name, cases in families().items():
        hits, seconds = 0, []
        for image, truth, size, *given in cases:
            tpl = given[0] if given else densematch.warp(image, *truth, size)
            started = time.perf_counter()
            a = densematch.align(tpl, image)
            seconds.append(time.perf_counter() - started)
            best = float((densematch.warp(image, *truth, size) - tpl).abs().mean())
            hits += a.error <= best + 1e-3
        got[name] = {"hits": hits, "cases": len(cases), "median s": statistics.median(seconds)}
    print(json.dumps(got))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("srcs", nargs="*", default=[HERE])
    parser.add_argument("--labels")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.srcs[0])
        return
    runs = alternate_trees(__file__, args.srcs, args.labels, args.rounds)
    rows = []
    for tree, results in runs.items():
        for name in results[0]:
            rows.append({
                "tree": tree,
                "family": name,
                "hit": f"{results[0][name]['hits']} / {results[0][name]['cases']}",
                "median ms": round(1000 * statistics.median(r[name]["median s"] for r in results), 2),
            })  # fmt: skip
    report("align-textures", rows)


if __name__ == "__main__":
    main()
