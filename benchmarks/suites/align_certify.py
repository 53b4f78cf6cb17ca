"""align's answers certified offline: :func:`densematch.certify_alignment` on each case,
a branch and bound over the whole search space showing that no fit better than align's answer
lies outside its neighbourhood.

Run: python benchmarks/suites/align_certify.py [--set photos|masks] [--cases 12] [--per-photo 1] [--photos P ...]
     [--budget 600] [--near DS DT] [--finest DS DT] [--threads 1] [--name NAME]

Cases: bench_align_global's (100x100 templates in 125x125 photographs, scales over 0.8..1.2, noise
0.01), one per photograph. For each, align's answer, then the certificate of the default l1
objective over the default ranges, in the neighbourhood ``--near`` (default 0.015 in scale and
1.5 px: bench_align's "loose" tolerance; with the strict one, 0.005 and 0.5 px, cells on the rim
of the answer's own basin, where the error rises only as fast as the noise lets it, can stay
within the bound). The time is the point: a certificate is an offline check, not part of a call. Either way it
shows how far from the answer a better fit can lie (``within``: scale_h, scale_w, shift_y, shift_x).
``--set masks``: binary masks instead (unions of random ellipses, issue 41's mask overlap use), the
three template sizes of :data:`densematch.app.synthetic.SIZES` with and without noise 0.02, scales
over 0.8..1.2. The last lines give the median and the longest certificate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import report
from suites.bench_align_global import cases, mask_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("photos", "masks"), default="photos")
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--per-photo", type=int, default=1, help="cases per photograph (bench_align_global's 4)")
    ap.add_argument("--photos", nargs="+", help="only these photographs' cases")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds per case")
    ap.add_argument("--near", type=float, nargs=2, default=(0.015, 1.5), metavar=("DS", "DT"))
    ap.add_argument("--finest", type=float, nargs=2, default=(0.00004, 0.004), metavar=("DS", "DT"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="align-certify")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    chosen = cases(args.per_photo, args.seed) if args.set == "photos" else mask_cases(args.cases, args.seed)
    for c in chosen[: args.cases]:
        if args.photos and c["photo"] not in args.photos:
            continue
        a = densematch.align(c["tpl"], c["img"])
        got = densematch.certify_alignment(
            c["tpl"], c["img"], a, near=tuple(args.near), finest=tuple(args.finest), time_limit=args.budget
        )
        rows.append(
            {
                "photo": c["photo"],
                "certified": "yes" if got.certified else f"no: {got.reason}",
                "better fits lie within": ", ".join(f"{v:.3g}" for v in got.within),
                "cells examined": got.cells_examined,
                "seconds": round(got.seconds, 3),
            }
        )
        print(rows[-1], flush=True)
    seconds = [r["seconds"] for r in rows]
    certified = sum(r["certified"] == "yes" for r in rows)
    summary = {
        "cases": len(rows),
        "certified": certified,
        "median s": statistics.median(seconds),
        "longest s": max(seconds),
    }
    report(args.name, rows, summary=summary)
    print(summary)


if __name__ == "__main__":
    main()
