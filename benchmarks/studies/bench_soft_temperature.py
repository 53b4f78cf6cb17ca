"""soft_match's temperature, judged by PCK on pairs with known warps.

Run: python benchmarks/studies/bench_soft_temperature.py

For each built-in feature (patch, color, dsift) and each pair of ``synthetic.match_pairs()``
(a shift, an affine warp, a homography), the PCK@1 and @3 of ``soft_match``'s expected
positions with temperature="auto" (the default), with fixed temperatures, and of the hard argmax
(``match``) beside them.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import machine, save, table
from densematch.app import synthetic
from densematch.app.features import dense_features

SETTINGS: list[str | float] = ["auto", 0.1, 0.02, 0.01, 0.005]


def main() -> None:
    torch.set_num_threads(2)
    pairs = synthetic.match_pairs()
    rows = []
    for name in ("patch", "color", "dsift"):
        feats = [(dense_features(p.a, name).detach(), dense_features(p.b, name).detach()) for p in pairs]
        for setting in [*SETTINGS, "hard argmax"]:
            row: dict[str, object] = {"features": name, "temperature": setting}
            for p, (fa, fb) in zip(pairs, feats, strict=True):
                if setting == "hard argmax":
                    coords = densematch.match(fa, fb).coords.float()
                else:
                    coords = densematch.soft_match(fa, fb, temperature=setting).coords
                at1, at3 = synthetic.pck(coords.numpy(), p.truth, p.inside, (1, 3))
                row[f"{p.name} PCK@1"] = round(at1, 3)
                row[f"{p.name} PCK@3"] = round(at3, 3)
            rows.append(row)
            print(row, flush=True)
    info = machine()
    path = save("soft-temperature", {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {path}\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
