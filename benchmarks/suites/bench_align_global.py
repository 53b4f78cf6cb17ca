"""align against OpenCV's ECC on one thread: is the global minimum found, and how fast.

Run: python benchmarks/suites/bench_align_global.py [--set photos|masks] [--per-photo 4] [--certify] [--threads 1]
     [--batch 32] [--repeats 3] [--name NAME]

Cases (densematch.app.synthetic.alignment_cases, each photograph in turn): 125x125 crops of 12 of
scikit-image's photographs (grey, 2x2 average-pooled, scaled to 0..1), a 100x100 template warped
in align's convention with scales uniform over align's whole default range (0.8..1.2 per axis)
and a fractional shift anywhere it fits, plus Gaussian noise of sigma 0.01. "strict": both
scales within 0.005 and both shifts within 0.5 px. "truth better": the truth's L1 error is below
the answer's, so a search that kept the global minimum would have found the truth's basin (the
misses that count). OpenCV's findTransformECC (affine motion, a 3-level pyramid, started from
the identity, as its examples do) is local: its time is the speed class, not a recovery peer.
Batches: the same pairs in one call of ``align`` against one call each.
``--set masks``: 48 binary masks instead (unions of random ellipses: issue 41's mask overlap use),
the three template sizes of :data:`densematch.app.synthetic.SIZES`, noise 0 and 0.02, scales over
0.8..1.2 (no batch row: the sizes differ). ``--certify``: ``align(certify=True)`` timed beside
them, each answer certified global (and, where the certificate finds a better fit, refined from
it and certified again): how many it certified, and how many answers it moved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import machine, save, table
from densematch.app.synthetic import PHOTOS, alignment_cases

STRICT = (0.005, 0.5)


def cases(per_photo: int, seed: int) -> list[dict]:
    made = alignment_cases(
        per_photo * len(PHOTOS),
        seed=seed,
        kinds=("photo",),
        sizes=(((100, 100), (125, 125)),),
        noise=(0.01,),
        scale_range=(0.8, 1.2),
        pooled=2,
        cycle=True,
    )
    return [
        {"photo": c.source, "tpl": c.template, "img": c.image, "truth": (c.scale_h, c.scale_w, c.shift_y, c.shift_x)}
        for c in made
    ]


def mask_cases(n: int, seed: int) -> list[dict]:
    made = alignment_cases(n, seed=seed, kinds=("mask",), noise=(0.0, 0.02), scale_range=(0.8, 1.2))
    return [
        {
            "photo": f"mask {tuple(c.template.shape)} noise {c.noise}",
            "tpl": c.template,
            "img": c.image,
            "truth": (c.scale_h, c.scale_w, c.shift_y, c.shift_x),
        }
        for c in made
    ]


def l1_at(c: dict, p: tuple[float, ...]) -> float:
    return float((densematch.warp(c["img"], *p, tuple(c["tpl"].shape)) - c["tpl"]).abs().mean())


def strict(p: tuple[float, ...], truth: tuple[float, ...]) -> bool:
    e = [abs(a - b) for a, b in zip(p, truth, strict=True)]
    return e[0] <= STRICT[0] and e[1] <= STRICT[0] and e[2] <= STRICT[1] and e[3] <= STRICT[1]


def ecc(tpl: np.ndarray, img: np.ndarray) -> tuple[float, ...]:
    """findTransformECC, affine, coarse to fine over 3 levels from the identity, mapped to
    align's convention (template pixel c looks at image (c + shift + 0.5) / scale - 0.5)."""
    import cv2

    crit = (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, 50, 1e-4)
    levels_t, levels_i = [tpl], [img]
    for _ in range(2):
        levels_t.append(cv2.pyrDown(levels_t[-1]))
        levels_i.append(cv2.pyrDown(levels_i[-1]))
    m = np.eye(2, 3, dtype=np.float32)
    for lt, li in zip(levels_t[::-1], levels_i[::-1], strict=True):
        if lt is not levels_t[-1]:
            m[:, 2] *= 2
        try:
            _, m = cv2.findTransformECC(lt, li, m, cv2.MOTION_AFFINE, crit, None, 1)
        except cv2.error:
            pass
    sw, sh = 1 / m[0, 0], 1 / m[1, 1]
    return (float(sh), float(sw), float((m[1, 2] + 0.5) * sh - 0.5), float((m[0, 2] + 0.5) * sw - 0.5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("photos", "masks"), default="photos")
    ap.add_argument("--per-photo", type=int, default=4)
    ap.add_argument("--certify", action="store_true", help="time align(certify=True) beside")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="pairs in the batch row; 0: none")
    ap.add_argument("--no-ecc", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="times each case is timed (its median is kept)")
    ap.add_argument("--name", default="align-global")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    torch.set_num_threads(args.threads)
    if not args.no_ecc:
        import cv2

        cv2.setNumThreads(args.threads)
    cs = cases(args.per_photo, args.seed) if args.set == "photos" else mask_cases(48, args.seed)
    densematch.align(cs[0]["tpl"], cs[0]["img"])  # warm-up
    certified = "densematch.align certify=True"
    found: dict[str, list] = {"densematch.align": [], certified: [], "OpenCV ECC": []}
    times: dict[str, list[float]] = {"densematch.align": [], certified: [], "OpenCV ECC": []}
    verdicts, moved = [], 0
    misses = []
    for i, c in enumerate(cs):
        # alternated, one case at a time, so that a busy spell slows both; each case's time is the
        # median of its repeats
        spent: dict[str, list[float]] = {method: [] for method in times}
        tn, xn = c["tpl"].numpy(), c["img"].numpy()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            a = densematch.align(c["tpl"], c["img"])
            spent["densematch.align"].append(time.perf_counter() - t0)
            if args.certify:
                t0 = time.perf_counter()
                b = densematch.align(c["tpl"], c["img"], certify=True)
                spent[certified].append(time.perf_counter() - t0)
            if not args.no_ecc:
                t0 = time.perf_counter()
                q = ecc(tn, xn)
                spent["OpenCV ECC"].append(time.perf_counter() - t0)
        for method, got in spent.items():
            if got:
                times[method].append(statistics.median(got))
        p = (a.scale_h, a.scale_w, a.shift_y, a.shift_x)
        found["densematch.align"].append(p)
        if args.certify:
            found[certified].append((b.scale_h, b.scale_w, b.shift_y, b.shift_x))
            verdicts.append(b.certificate.certified)
            moved += not strict(found[certified][-1], p)
        if not args.no_ecc:
            found["OpenCV ECC"].append(q)
        if not strict(p, c["truth"]):
            truth_l1, got_l1 = l1_at(c, c["truth"]), l1_at(c, p)
            misses.append(
                {
                    "case": i,
                    "photo": c["photo"],
                    "truth": [round(v, 4) for v in c["truth"]],
                    "found": [round(v, 4) for v in p],
                    "truth_l1": round(truth_l1, 5),
                    "found_l1": round(got_l1, 5),
                    "truth_better": truth_l1 < got_l1,
                }
            )
    rows = []
    for method, got in found.items():
        if not got:
            continue
        ok = sum(strict(p, c["truth"]) for p, c in zip(got, cs, strict=True))
        rows.append(
            {
                "method": method,
                "cases": len(cs),
                "strict": ok,
                "median ms": round(1e3 * statistics.median(times[method]), 2),
                "max ms": round(1e3 * max(times[method]), 2),
            }
        )
        if method == certified:
            rows[-1]["method"] += f" ({sum(verdicts)} certified, {moved} answers moved)"
    against = {}  # align's time over ECC's, case by case in the same seconds: the figure a busy host moves least
    if times["OpenCV ECC"]:
        per_case = [a / e for a, e in zip(times["densematch.align"], times["OpenCV ECC"], strict=True)]
        against = {
            "median of the per-case ratios": round(statistics.median(per_case), 3),
            "ratio of the medians": round(
                statistics.median(times["densematch.align"]) / statistics.median(times["OpenCV ECC"]), 3
            ),
        }
    batch: dict = {}
    if args.batch > 0 and len({tuple(c["tpl"].shape) for c in cs}) == 1:
        batch = batch_rates(cs, args.batch)
    info = machine()
    path = save(
        args.name,
        {
            "machine": info,
            "command": " ".join(sys.argv),
            "rows": rows,
            "align / ECC": against,
            "batch": batch,
            "misses": misses,
        },
    )
    print(f"machine: {info}\n")
    print(table(rows, ["method", "cases", "strict", "median ms", "max ms"]))
    print(f"\nalign / ECC: {against}\nbatch: {batch}")
    print(f"align's misses ({len(misses)}; truth better in {sum(m['truth_better'] for m in misses)}):")
    for m in misses:
        print(f"  {m}")
    print(f"saved {path}")


def batch_rates(cs: list[dict], most: int) -> dict:
    """Pairs per second, the first ``most`` pairs one call each against one batched call."""
    n_b = min(most, len(cs))
    tb = torch.stack([c["tpl"] for c in cs[:n_b]])
    xb = torch.stack([c["img"] for c in cs[:n_b]])
    densematch.align(tb[:2], xb[:2])
    one, many = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n_b):
            densematch.align(tb[i], xb[i])
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        densematch.align(tb, xb)
        many.append(time.perf_counter() - t0)
    return {
        "pairs": n_b,
        "one call each, pairs/s": round(n_b / statistics.median(one), 1),
        "one batched call, pairs/s": round(n_b / statistics.median(many), 1),
        "ratio": round(statistics.median(one) / statistics.median(many), 2),
    }


if __name__ == "__main__":
    main()
