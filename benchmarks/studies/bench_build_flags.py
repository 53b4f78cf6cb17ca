"""The C kernels built with different flags, side by side in one process: an l1 tile
(dm_minkowski) and a batch of l2 pairs (dm_pair_values), each build loaded by ctypes and called
in turn, 15 alternating rounds, medians.

Run: python benchmarks/studies/bench_build_flags.py [--channels 32]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from densematch.kernels import build

VARIANTS = {
    "-march=native (the old run-time build)": ("-march=native",),
    "x86-64-v4, -ffp-contract=off (shipped)": ("-march=x86-64-v4", "-ffp-contract=off"),
    "x86-64-v4, -ffp-contract=off, -mtune=native (run-time)": (
        "-march=x86-64-v4",
        "-ffp-contract=off",
        "-mtune=native",
    ),
    "x86-64-v3, -ffp-contract=off (shipped)": ("-march=x86-64-v3", "-ffp-contract=off"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    base = tuple(f for f in build.FLAGS if f != "-ffp-contract=off")
    n, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(VARIANTS.items()):
            path = Path(tmp) / f"v{i}.so"
            subprocess.run(["cc", *base, *extra, "-o", str(path), str(build.SOURCE)], check=True)
            lib = ctypes.CDLL(str(path))
            mink, pairs = lib.dm_minkowski_f32, lib.dm_pair_values_f32
            mink.argtypes, mink.restype = [ptr, n, ptr, n, ptr, n, n, n, n, n, flag, ctypes.c_double], flag
            pairs.argtypes, pairs.restype = [ptr, n, ptr, ptr, n, ptr, n, n, n, flag, ptr], None
            calls[name] = (mink, pairs)
        c = args.channels
        x, yt, out = torch.randn(4096, c), torch.randn(c, 512), torch.empty(4096, 512)
        q, r = torch.randn(20000, c), torch.randn(20000, c)
        idx, values = torch.randint(0, 20000, (20000, 8)), torch.empty(20000, 8)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(15):
            for name, (mink, pairs) in calls.items():
                t0 = time.perf_counter()
                mink(x.data_ptr(), c, yt.data_ptr(), 512, out.data_ptr(), 512, 1, 4096, c, 512, 0, -1.0)
                times.setdefault((name, "l1 tile 4096 x 512"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                pairs(q.data_ptr(), c, None, r.data_ptr(), c, idx.data_ptr(), 20000, 8, c, 1, values.data_ptr())
                times.setdefault((name, "l2 pairs 20000 x 8"), []).append(time.perf_counter() - t0)
    print(f"C={args.channels}, one thread, medians of 15 alternating rounds\n")
    print("| build | kernel | ms |\n|---|---|---|")
    for (name, kernel), t in times.items():
        print(f"| {name} | {kernel} | {statistics.median(t) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
