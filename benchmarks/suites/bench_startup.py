"""Start-up and small budgets: what a command-line user pays, and how a tight budget degrades.

1. The first match in a fresh process against the second (demo shapes: 96x96 against 110x118
   patch features of a photo, C=49), in several fresh processes.
2. ``densematch match a.png b.png -o m.npz`` on two 128x128 photos, against
   ``python -c "import densematch"``, median of several runs.
3. 128x128x64 against 128x128x64 patch-like features under memory=16MiB and 256MiB, k=1 and 8,
   cosine and l2, side by side in one process, median of repeats.
4. What settling near-ties costs: the engine's plain float32 search with and without it
   (``certify=False`` turns it off), on 7x7 patch features of camera, 128x128 against a shifted
   128x128 crop (C=49), k=1 and 8, cosine and l2, 256 MiB.

Usage: python benchmarks/suites/bench_startup.py [--repeats N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

FIRST_CALL = textwrap.dedent(
    """
    import json, time
    import numpy as np
    import densematch
    from densematch.app.features import dense_features
    from skimage import data
    img = data.camera().astype(np.float32) / 255
    a = dense_features(img[100:196, 100:196], "patch")
    b = dense_features(img[90:200, 95:213], "patch")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        densematch.match(a, b)
        times.append(time.perf_counter() - t)
    print(json.dumps(times))
    """
)


def first_call(repeats: int) -> dict[str, float]:
    ratios, firsts, seconds = [], [], []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, check=True)
        t = json.loads(out.stdout.strip().splitlines()[-1])
        firsts.append(t[0])
        seconds.append(t[1])
        ratios.append(t[0] / t[1])
    return {
        "first_s": statistics.median(firsts),
        "second_s": statistics.median(seconds),
        "ratio": statistics.median(ratios),
    }


def command_time(repeats: int) -> dict[str, float]:
    import numpy as np
    from PIL import Image
    from skimage import data

    cam = data.camera()
    with tempfile.TemporaryDirectory() as d:
        Image.fromarray(cam[100:228, 100:228]).save(Path(d) / "a.png")
        Image.fromarray(cam[104:232, 97:225]).save(Path(d) / "b.png")
        exe = Path(sys.executable).with_name("densematch")
        cmd = [str(exe), "match", f"{d}/a.png", f"{d}/b.png", "--features", "patch", "-o", f"{d}/m.npz", "--quiet"]
        imp = [sys.executable, "-c", "import densematch"]
        t_cmd, t_imp = [], []
        for _ in range(repeats):
            for argv, into in ((imp, t_imp), (cmd, t_cmd)):
                t = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True)
                into.append(time.perf_counter() - t)
        assert np.load(f"{d}/m.npz")["coords"].shape == (128, 128, 2)
    return {"command_s": statistics.median(t_cmd), "import_s": statistics.median(t_imp)}


def budgets(repeats: int) -> list[dict[str, object]]:
    import torch

    import densematch

    g = torch.Generator().manual_seed(0)
    # smooth random fields: neighbouring pixels alike, as in real feature maps
    base = torch.nn.functional.avg_pool2d(torch.randn(1, 64, 132, 132, generator=g), 5, 1, padding=2)[0]
    a = base[:, :128, :128].permute(1, 2, 0).contiguous()
    b = base[:, 1:129, 2:130].permute(1, 2, 0).contiguous() + 0.05 * torch.randn(128, 128, 64, generator=g)
    rows = []
    for metric in ("cosine", "l2"):
        for k in (1, 8):
            times: dict[str, list[float]] = {"16MiB": [], "256MiB": []}
            for _ in range(repeats):
                for memory, into in times.items():
                    t = time.perf_counter()
                    densematch.match(a, b, metric=metric, k=k, memory=memory)
                    into.append(time.perf_counter() - t)
            small, big = (statistics.median(times[m]) for m in ("16MiB", "256MiB"))
            rows.append({"metric": metric, "k": k, "16MiB_s": small, "256MiB_s": big, "ratio": small / big})
    return rows


def settling(repeats: int) -> list[dict[str, object]]:
    import torch
    from skimage import data

    from densematch import engine
    from densematch.precision import Precision

    def patches(img: torch.Tensor) -> torch.Tensor:
        p = torch.nn.functional.unfold(img.float()[None, None] / 255, 7, padding=3)[0]
        return (p - p.mean(0, keepdim=True)).T.contiguous()

    cam = torch.from_numpy(data.camera())
    a, b = patches(cam[100:228, 100:228]), patches(cam[104:232, 97:225])
    rows = []
    for metric in ("cosine", "l2"):
        for k in (1, 8):
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for settle, into in times.items():
                    t = time.perf_counter()
                    engine.topk(a, b, metric=metric, k=k, budget=256 * 2**20, precision=Precision(certify=settle))
                    into.append(time.perf_counter() - t)
            plain, settled = (statistics.median(times[x]) for x in (False, True))
            rows.append({"metric": metric, "k": k, "plain_s": plain, "settled_s": settled, "ratio": settled / plain})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    result = {"first_call": first_call(args.repeats), "command": command_time(args.repeats)}
    f = result["first_call"]
    print(f"first match {f['first_s']:.3f} s, second {f['second_s']:.3f} s, ratio {f['ratio']:.2f} (median)")
    c = result["command"]
    print(
        f"densematch match on 128x128 PNGs {c['command_s']:.2f} s; import densematch {c['import_s']:.2f} s; "
        f"difference {c['command_s'] - c['import_s']:.2f} s"
    )
    result["budgets"] = budgets(args.repeats)
    print("| metric | k | 16MiB (s) | 256MiB (s) | ratio |\n|---|---|---|---|---|")
    for r in result["budgets"]:
        print(f"| {r['metric']} | {r['k']} | {r['16MiB_s']:.2f} | {r['256MiB_s']:.2f} | {r['ratio']:.2f} |")
    result["settling"] = settling(args.repeats)
    print("| metric | k | plain (s) | with near-ties settled (s) | ratio |\n|---|---|---|---|---|")
    for r in result["settling"]:
        print(f"| {r['metric']} | {r['k']} | {r['plain_s']:.3f} | {r['settled_s']:.3f} | {r['ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
