"""densematch.kornia against kornia.feature's matchers, and densematch.knn against FAISS and the
cdist recipes of memory-bank users: time and peak memory.

Run: python benchmarks/suites/bench_kornia.py [--repeats 3] [--quick] [--only kornia|knn]

Every (job, method) runs in two subprocesses of its own: one for its peak (the high-water mark
of one call after a warm-up call, VmHWM reset through /proc/self/clear_refs, above the RSS
before it, inputs already loaded) and one for its time (the median of ``repeats`` calls after a
warm-up).

- kornia: match_snn (th=0.8) and match_smnn (th=0.95), B1 = B2 = 5k, 20k, 50k, D=128: SIFT-like
  descriptors (Kornia's SIFTDescriptor of 32x32 patches of scikit-image photographs, perturbed by
  noise so that no two are identical). densematch with ``memory="256MiB"`` against Kornia's own.
  Kornia is not run where its distance matrix alone exceeds --kornia-limit (default 6 GiB).
- knn (the PatchCore case): 784 queries (one 28x28 feature map) of D=1536 against a bank of
  200,000 rows, and 784 queries of D=64 against 1,000,000 rows, l2, k=1: densematch.knn,
  densematch.KNNIndex (bank prepared once, outside the timing), FAISS IndexFlatL2, the chunked
  torch.cdist + topk loop (chunks of 10,000 bank rows, as anomaly-detection code writes it), and
  torch.cdist whole, and the bare products (torch.mm of the queries with every 512-row block of
  the bank, nothing else: the floor of any search built on torch's products).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save

CHILD = textwrap.dedent(
    """
    import json, statistics, time, torch
    data = torch.load({path!r})
    {setup}

    def status(field):
        with open("/proc/self/status") as fh:
            return next(int(l.split()[1]) * 1024 for l in fh if l.startswith(field))

    with torch.no_grad():
        once()
        if {measure_peak}:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            before = status("VmRSS:")
            once()
            print(json.dumps({{"peak_mib": (status("VmHWM:") - before) / 2**20}}))
        else:
            times = []
            for _ in range({repeats}):
                t0 = time.perf_counter()
                once()
                times.append(time.perf_counter() - t0)
            print(json.dumps({{"median_s": statistics.median(times)}}))
    """
)

KORNIA = {
    "densematch": (
        "from densematch.kornia import {fn} as fn\nonce = lambda: fn(data['a'], data['b'], {th}, memory='256MiB')"
    ),
    "kornia": "from kornia.feature import {fn} as fn\nonce = lambda: fn(data['a'], data['b'], {th})",
}
KNN = {
    "densematch.knn": "import densematch\nonce = lambda: densematch.knn(data['q'], data['bank'], k=1)",
    "densematch.KNNIndex.search": (
        "import densematch\nindex = densematch.KNNIndex(data['bank'])\nonce = lambda: index.search(data['q'], k=1)"
    ),
    "FAISS IndexFlatL2": (
        "import faiss\nindex = faiss.IndexFlatL2(data['bank'].shape[1])\nindex.add(data['bank'].numpy())\n"
        "once = lambda: index.search(data['q'].numpy(), 1)"
    ),
    "torch.cdist + topk, chunks of 10k": (
        "def once():\n"
        "    best = []\n"
        "    for s in range(0, len(data['bank']), 10_000):\n"
        "        d = torch.cdist(data['q'], data['bank'][s : s + 10_000])\n"
        "        v, i = d.topk(1, dim=1, largest=False)\n"
        "        best.append((v, i + s))\n"
        "    v = torch.cat([b[0] for b in best], 1)\n"
        "    return v.min(1)"
    ),
    "torch.cdist whole": "once = lambda: torch.cdist(data['q'], data['bank']).min(1)",
    # the floor of any search built on torch's products: the same products and nothing else
    "torch.mm alone (512-row blocks)": (
        "def once():\n"
        "    for s in range(0, len(data['bank']), 512):\n"
        "        torch.mm(data['q'], data['bank'][s : s + 512].T)"
    ),
}


def sift_like(n: int, seed: int):
    import numpy as np
    import torch
    from kornia.feature import SIFTDescriptor
    from skimage import data

    g = np.random.default_rng(seed)
    images = [data.camera(), data.coins(), data.astronaut()[..., 1], data.moon(), data.coffee()[..., 0]]
    out = []
    sift = SIFTDescriptor(32, rootsift=False)
    for start in range(0, n, 5000):
        patches = []
        for i in range(start, min(n, start + 5000)):
            img = images[i % len(images)]
            y, x = g.integers(0, img.shape[0] - 32), g.integers(0, img.shape[1] - 32)
            patches.append(img[y : y + 32, x : x + 32])
        x = torch.from_numpy(np.stack(patches)).float()[:, None] / 255.0
        x = x + 0.01 * torch.from_numpy(g.standard_normal(x.shape)).float()
        with torch.no_grad():
            out.append(sift(x))
    return torch.cat(out)


def child(path: str, setup: str, repeats: int, peak: bool = True) -> dict:
    """Time and peak of one method, each from its own process: the peak under a fixed mmap
    threshold (glibc then returns every large freed block at once, so the high-water mark is
    what the call holds), the time without it (with it, every large allocation is a fresh,
    page-faulting mmap, which would charge a tiled method for the measurement)."""
    result: dict = {}
    for measure_peak in (True, False) if peak else (False,):
        code = CHILD.format(path=path, setup=setup, repeats=repeats, measure_peak=measure_peak)
        env = dict(os.environ)
        if measure_peak:
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            return {"median_s": None, "error": out.stderr.strip().splitlines()[-1][:100]}
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return result


def interleaved(job: str, path: str, methods: list[str], rounds: int, repeats: int) -> list[dict]:
    """Each method's timing process run ``rounds`` times, the methods alternating (A B, then B A),
    so that drift of a shared machine falls on all; the median over rounds of the medians."""
    import statistics

    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(rounds):
        for method in methods if r % 2 == 0 else methods[::-1]:
            times[method].append(child(path, KNN[method], repeats, peak=False)["median_s"])
    rows = [{"job": job, "method": m, "median_s": statistics.median(t), "rounds": t} for m, t in times.items()]
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    p.add_argument("--only", choices=("kornia", "knn"), default=None)
    p.add_argument("--kornia-limit", type=float, default=6.0, help="GiB of distance matrix Kornia may build")
    p.add_argument("--sizes", type=int, nargs="+", default=[5000, 20000, 50000], help="descriptor counts")
    p.add_argument("--banks", type=int, nargs="+", default=None, help="knn: only these bank sizes")
    p.add_argument("--rounds", type=int, default=1, help="knn: time --methods alternately, this many rounds")
    p.add_argument("--methods", default="densematch.KNNIndex.search,FAISS IndexFlatL2", help="with --rounds")
    p.add_argument("--name", default="kornia")
    args = p.parse_args()
    repeats = 1 if args.quick else args.repeats
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "kornia"):
            for n in (2000,) if args.quick else args.sizes:
                path = os.path.join(tmp, f"desc{n}.pt")
                torch.save({"a": sift_like(n, 1), "b": sift_like(n, 2)}, path)
                for fn, th in (("match_snn", 0.8), ("match_smnn", 0.95)):
                    for method, setup in KORNIA.items():
                        label = {"job": f"{fn} {n // 1000}k x {n // 1000}k, D=128", "method": method}
                        need = n * n * 4 / 2**30
                        if method == "kornia" and need > args.kornia_limit:
                            rows.append(
                                {**label, "median_s": None, "error": f"not run: its matrix alone is {need:.1f} GiB"}
                            )
                        else:
                            rows.append({**label, **child(path, setup.format(fn=fn, th=th), repeats)})
                        print(rows[-1], flush=True)
        if args.only in (None, "knn"):
            cases = [(784, 64, 20_000)] if args.quick else [(784, 1536, 200_000), (784, 64, 1_000_000)]
            cases = [case for case in cases if args.banks is None or case[2] in args.banks]
            for nq, d, m in cases:
                g = torch.Generator().manual_seed(0)
                path = os.path.join(tmp, f"bank{m}.pt")
                torch.save({"q": torch.randn(nq, d, generator=g), "bank": torch.randn(m, d, generator=g)}, path)
                job = f"knn {nq} x {d} against {m:,} x {d}, l2, k=1"
                if args.rounds > 1:
                    rows += interleaved(job, path, args.methods.split(","), args.rounds, repeats)
                    continue
                for method, setup in KNN.items():
                    rows.append({"job": job, "method": method, **child(path, setup, repeats)})
                    print(rows[-1], flush=True)
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n\n| job | method | median s | peak MiB |\n|---|---|---|---|")
    for r in rows:
        t = f"{r['median_s']:.3f}" if r.get("median_s") is not None else r.get("error", "")
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else ""
        print(f"| {r['job']} | {r['method']} | {t} | {peak} |")


if __name__ == "__main__":
    main()
