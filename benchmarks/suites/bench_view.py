"""The pages' size and how long they take to open: a 256x256 match with k=4 (the issue's bound: at
most 5 MB, under a second) and the demo's pages, in Debian's chromium through Playwright.

Run: python benchmarks/suites/bench_view.py [--repeats 5] [--name view]

"Open" is from the navigation to the page's script having drawn everything (``data-ready``),
offline; medians over the repeats, each in a fresh browser tab.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="view")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium: scripts/install-browser.sh installs Debian's")
    work = Path(tempfile.mkdtemp())
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        np.save(work / f"{name}.npy", torch.randn(256, 256, 8, generator=g).numpy())
    cli = [sys.executable, "-m", "densematch"]
    subprocess.run(
        [*cli, "match", work / "a.npy", work / "b.npy", "--k", "4", "--html", work / "m256.html"], check=True
    )
    subprocess.run([*cli, "demo", "--out", work / "demo", "--quiet"], check=True)
    pages = {
        "match 256x256, k=4 (features in false colour)": work / "m256.html",
        "demo match 96x96 against 110x118, k=1": work / "demo" / "match.html",
        "demo align 100x100 into 125x125": work / "demo" / "align.html",
        "demo distance 151x192, 12 prototypes": work / "demo" / "distance.html",
    }
    rows = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for label, path in pages.items():
            times = []
            for _ in range(args.repeats + 1):  # the first warms the browser's caches
                context = browser.new_context(offline=True)
                page = context.new_page()
                t0 = time.perf_counter()
                page.goto(path.as_uri())
                page.wait_for_selector("body[data-ready='1']", timeout=30_000)
                times.append(time.perf_counter() - t0)
                context.close()
            rows.append(
                {
                    "page": label,
                    "size MB": round(path.stat().st_size / 1e6, 2),
                    "open ms (median)": round(1e3 * statistics.median(times[1:]), 0),
                    "open ms (max)": round(1e3 * max(times[1:]), 0),
                }
            )
            print(rows[-1], flush=True)
        browser.close()
    print()
    report(args.name, rows)


if __name__ == "__main__":
    main()
