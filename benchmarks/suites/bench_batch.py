"""The batch runner on many align pairs: pairs per second, time to the first result and overhead
per pair, against a loop of densematch.align calls.

Run: python benchmarks/suites/bench_batch.py [--pairs 1000] [--workers 2] [--methods loop,local,...]

The pairs: 100x100 templates cut from scikit-image photographs (camera, coins, moon, astronaut,
coffee, chelsea: 125x125 crops at varied offsets) stretched by scales drawn in [0.85, 1.15] per
axis, with shifts in [0, 4) pixels, saved as PNG with a manifest. Every method runs in its own
subprocess, one after another, on the same files:

- loop: a Python loop reading each pair's PNGs and calling ``densematch.align`` (2 threads);
- local: ``densematch batch align`` in one process (pairs of one shape aligned 16 at a time);
- local-workers: the same with ``--workers N`` processes (threads split among them);
- ray: ``--engine ray`` on a local Ray cluster of N CPUs started by the command (its start-up
  counted in the total and in the time to the first result).

For each: the wall time from the subprocess' first line to its last result (imports and, for
Ray, the cluster's start included), pairs per second over that, the time to the first result,
and the overhead per pair against the loop. Every method's answers are checked against the
loop's (largest difference of a shift, in pixels).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save

LOOP = textwrap.dedent(
    """
    import csv, json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    from PIL import Image
    import densematch
    out, first = [], None
    with open({manifest!r}) as fh:
        for row in csv.DictReader(fh):
            grey = lambda name: np.asarray(Image.open({folder!r} + "/" + name).convert("L"), np.float32) / 255
            a = densematch.align(grey(row["template"]), grey(row["image"]))
            out.append({{"id": row["id"], **a.as_dict()}})
            first = first or time.perf_counter() - t0
    print(json.dumps({{"seconds": time.perf_counter() - t0, "first": first, "results": out}}))
    """
)

RUNNER = textwrap.dedent(
    """
    import json, time
    t0 = time.perf_counter()
    from densematch.app.batch import read_manifest, run
    out, first = [], None
    for r in run("align", read_manifest({manifest!r}, "align"), engine={engine!r}, workers={workers}):
        out.append({{"id": r["id"], **(r["result"] or {{}})}})
        first = first or time.perf_counter() - t0
    print(json.dumps({{"seconds": time.perf_counter() - t0, "first": first, "results": out}}))
    """
)


def make_pairs(folder: Path, n: int) -> Path:
    import numpy as np
    import torch
    from PIL import Image
    from skimage import color, data

    import densematch

    photos = [data.camera(), data.coins(), data.moon(), data.astronaut(), data.coffee(), data.chelsea()]
    photos = [(color.rgb2gray(p) * 255 if p.ndim == 3 else p).astype(np.float32) / 255 for p in photos]
    g = np.random.default_rng(0)
    rows = []
    for i in range(n):
        p = photos[i % len(photos)]
        y, x = g.integers(0, p.shape[0] - 125), g.integers(0, p.shape[1] - 125)
        img = torch.from_numpy(np.ascontiguousarray(p[y : y + 125, x : x + 125]))
        sh, sw = g.uniform(0.85, 1.15, 2)
        sy, sx = g.uniform(0, 4, 2)
        tpl = densematch.warp(img, sh, sw, sy, sx, (100, 100))
        for name, a in ((f"t{i}.png", tpl), (f"i{i}.png", img)):
            Image.fromarray((a.numpy().clip(0, 1) * 255).round().astype(np.uint8)).save(folder / name)
        rows.append([str(i), f"t{i}.png", f"i{i}.png"])
    manifest = folder / "pairs.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "template", "image"])
        w.writerows(rows)
    return manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--methods", default="loop,local,local-workers,ray")
    p.add_argument("--name", default="batch")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        manifest = make_pairs(folder, args.pairs)
        codes = {
            "loop": LOOP.format(manifest=str(manifest), folder=str(folder)),
            "local": RUNNER.format(manifest=str(manifest), engine="local", workers=1),
            "local-workers": RUNNER.format(manifest=str(manifest), engine="local", workers=args.workers),
            "ray": RUNNER.format(manifest=str(manifest), engine="ray", workers=args.workers),
        }
        answers = {}
        for method in args.methods.split(","):
            done = subprocess.run([sys.executable, "-c", codes[method]], capture_output=True, text=True)
            if done.returncode != 0:
                rows.append({"method": method, "error": done.stderr.strip().splitlines()[-1][:200]})
                print(rows[-1], flush=True)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            answers[method] = {a["id"]: a for a in r["results"]}
            rows.append(
                {
                    "method": method,
                    "seconds": r["seconds"],
                    "pairs_per_s": len(r["results"]) / r["seconds"],
                    "first_s": r["first"],
                    "ok": sum("shift_y" in a for a in r["results"]),
                }
            )
            print(rows[-1], flush=True)
    loop = next((r for r in rows if r["method"] == "loop" and "seconds" in r), None)
    for r in rows:
        if loop is not None and "seconds" in r:
            r["overhead_ms_per_pair"] = (r["seconds"] - loop["seconds"]) / args.pairs * 1e3
            if r["method"] != "loop":
                mine, theirs = answers[r["method"]], answers["loop"]
                r["max_shift_difference_px"] = max(
                    abs(mine[i][k] - theirs[i][k]) for i in theirs for k in ("shift_y", "shift_x") if k in mine[i]
                )
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "pairs": args.pairs, "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    print("| method | total s | pairs/s | first result s | overhead ms/pair | max shift diff px |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "seconds" not in r:
            print(f"| {r['method']} | {r.get('error')} | | | | |")
            continue
        print(
            f"| {r['method']} | {r['seconds']:.1f} | {r['pairs_per_s']:.2f} | {r['first_s']:.2f} | "
            f"{r.get('overhead_ms_per_pair', 0):.1f} | {r.get('max_shift_difference_px', 0):.2g} |"
        )


if __name__ == "__main__":
    main()
