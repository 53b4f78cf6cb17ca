"""The built-in features judged by figures: PCK@1/3/5 and time on real pairs with known warps.

Run: python benchmarks/suites/bench_features.py [--repeats 3] [--size 96]

Pairs (densematch.app.synthetic.match_pairs): a pure integer shift (chelsea), an affine warp
(astronaut: rotation 8 degrees, scales 1.1 and 0.95, shear 3 degrees) and a homography (coffee),
a 96x96 crop against the photograph resampled through the warp (112x112). For each feature type
(patch, color, dsift): PCK (the fraction of a's pixels whose best match, cosine, k=1, lies within
1, 3 and 5 pixels of the truth, over the pixels whose truth lies inside b), with and without the
mutual check (valid pixels only), and the median time of describing both images and matching.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save


def main() -> None:
    import warnings

    import densematch
    from densematch.app.features import FEATURES, dense_features
    from densematch.app.synthetic import match_pairs, pck

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--name", default="features")
    args = p.parse_args()
    rows = []
    for pair in match_pairs(args.size):
        for name in FEATURES:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fa, fb = dense_features(pair.a, name), dense_features(pair.b, name)
                m = densematch.match(fa, fb, mutual=True)
                times.append(time.perf_counter() - t0)
            coords, valid = m.coords.numpy(), m.valid.numpy()
            rows.append(
                {
                    "pair": pair.name,
                    "features": name,
                    "channels": int(fa.shape[-1]),
                    "pck": pck(coords, pair.truth, pair.inside),
                    "mutual_valid": float(valid[pair.inside].mean()),
                    "pck_mutual": pck(coords, pair.truth, pair.inside & valid),
                    "median_s": statistics.median(times),
                }
            )
            print(rows[-1], flush=True)
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    print("| pair | features | C | PCK@1 / @3 / @5 | mutual: valid, PCK@1 / @3 / @5 | median s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fmt = " / ".join(f"{v:.3f}" for v in r["pck"])
        mut = " / ".join(f"{v:.3f}" for v in r["pck_mutual"])
        print(
            f"| {r['pair']} | {r['features']} | {r['channels']} | {fmt} | {r['mutual_valid']:.2f}, {mut} | "
            f"{r['median_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
