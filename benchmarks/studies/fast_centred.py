"""precision="fast" on same-scene features, with and without its query tiles centred.

Two crops of the astronaut as raw colour patches (:func:`densematch.app.synthetic.same_scene_pair`),
bfloat16 forced, k=1: the share of pixels where "fast" picks another index than float32, with
``HalfSearch.centre_queries`` switched off and on in one run.

Usage: python benchmarks/studies/fast_centred.py [--sizes 96x96x64 56x56x768] [--metrics cosine l2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save, table
from densematch import engine
from densematch.app.synthetic import same_scene_pair
from densematch.engine.half import HalfSearch
from densematch.precision import Precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["96x96x64", "56x56x768"])
    p.add_argument("--metrics", nargs="+", default=["cosine", "l2"])
    args = p.parse_args()
    fast = Precision("fast", half=torch.bfloat16, certify=False)
    rows = []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        fa, fb = same_scene_pair(h, w, c)
        a, b = fa.reshape(-1, c), fb.reshape(-1, c)
        for metric in args.metrics:
            _, want = engine.topk(a, b, metric=metric, k=1, budget=2**28)
            row: dict[str, object] = {"size": size, "metric": metric}
            for centre, name in ((False, "not centred"), (True, "centred")):
                HalfSearch.centre_queries = centre
                _, got = engine.topk(a, b, metric=metric, k=1, budget=2**28, precision=fast)
                row[f"{name}: other index %"] = round(100 * float((got != want).float().mean()), 1)
            HalfSearch.centre_queries = True
            rows.append(row)
            print(row, flush=True)
    info = machine()
    path = save("fast-centred", {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {path}\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
