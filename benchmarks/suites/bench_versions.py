"""This checkout against an earlier revision, side by side: the match and distance tables.

Run: python benchmarks/suites/bench_versions.py --against REV [--rounds 3] [--repeats 5] [--threads T]

REV's src/ is exported with ``git archive`` into a temporary folder. Every (case, version) runs
in its own subprocess with its own ``src`` first on ``sys.path``, so each imports its own
densematch; the versions alternate within each round (A B, then B A) so that drift of the shared
machine falls on both. A subprocess times ``repeats`` calls after a warm-up call; the table
gives, per case, the median over rounds of those medians, and the ratio this / REV (below 1:
this checkout is faster). Only the public API is called, so any two revisions compare.
"scene" cases match two overlapping crops of one photograph
(:func:`densematch.app.synthetic.same_scene_pair`: the hard case for the certified search) with
``match``'s defaults; ``--threads`` sets torch's thread count in each subprocess (default: torch's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, statistics, sys, time
    sys.path.insert(0, {src!r})
    import torch, densematch
    assert densematch.__file__.startswith({src!r}), densematch.__file__
    kind, args, repeats, threads = {kind!r}, {args!r}, {repeats}, {threads}
    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    wrong = None
    if kind == "match":
        h, w, c, metric, k, mutual = args
        a, b = torch.randn(h, w, c, generator=g), torch.randn(h, w, c, generator=g)
        run = lambda: densematch.match(a, b, metric=metric, k=k, mutual=mutual)
    elif kind == "scene":
        from densematch.app.synthetic import same_scene_pair
        h, w, c, metric, k = args
        a, b = same_scene_pair(h, w, c)
        run = lambda: densematch.match(a, b, metric=metric, k=k)
    elif kind == "rows":
        # flat rows of a kind (noise, photo patches, clusters far from the mean, small integers)
        # and the rows whose picks score worse than the float64 direct form's k-th best
        data, na, nb, c, metric, k = args
        if data == "clustered":
            centres = torch.randn(8, c, generator=g) * 10
            a = centres[torch.randint(0, 8, (na,), generator=g)] + 0.05 * torch.randn(na, c, generator=g)
            b = centres[torch.randint(0, 8, (nb,), generator=g)] + 0.05 * torch.randn(nb, c, generator=g)
        elif data == "integers":
            a = torch.randint(0, 3, (na, c), generator=g).float()
            b = torch.randint(0, 3, (nb, c), generator=g).float()
        elif data == "photo":
            from skimage import data as sk
            img = torch.as_tensor(sk.camera(), dtype=torch.float32)[None, None] / 255
            side = int(c**0.5)
            f = torch.nn.functional.unfold(img, side, padding=side // 2)[0].T.reshape(512, 512, c)
            h = int(na**0.5)
            a, b = f[100 : 100 + h, 100 : 100 + h].reshape(-1, c), f[104 : 104 + h, 97 : 97 + h].reshape(-1, c)
            a = a + 0.01 * torch.randn(a.shape, generator=g)
        else:
            a, b = torch.randn(na, c, generator=g), torch.randn(nb, c, generator=g)
        run = lambda: densematch.match(a, b, metric=metric, k=k, layout="flat", precision="float32")
        index = run().index.reshape(-1, k)
        wrong = 0
        for s in range(0, na, 512):
            ad, bd = a[s : s + 512].double(), b.double()  # float64's expansion: far inside float32's tolerance
            sq = (ad.square().sum(1)[:, None] + bd.square().sum(1)[None] - 2 * ad @ bd.T).clamp_min(0)
            want = sq.topk(k, dim=1, largest=False).values[:, -1:].sqrt()
            sq = sq.sqrt()
            tol = 4e-6 * c**0.5 * float(a.double().norm(dim=1).max() + b.double().norm(dim=1).max()) + 1e-6
            wrong += int((sq.gather(1, index[s : s + 512]) > want + tol).any(1).sum())
    else:
        n, d, h, w, f, metric, what = args
        grad = what == "fwd+bwd"
        x = torch.randn(n, d, h, w, generator=g).requires_grad_(grad)
        p = torch.randn(f, d, generator=g).requires_grad_(grad)
        if what.startswith("nearest"):
            k = int(what.split("k=")[1])
            run = lambda: densematch.nearest_prototype(x, p, metric, k=k, check_finite=False)
        elif grad:
            run = lambda: densematch.pairwise_distance(x, p, metric, check_finite=False).sum().backward()
        else:
            run = lambda: densematch.pairwise_distance(x, p, metric, check_finite=False)
    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    print(json.dumps({{"seconds": statistics.median(times), "wrong": wrong}}))
    """
)

MATCH = [
    ("match", (160, 160, 64, "cosine", 1, False)),
    ("match", (80, 80, 384, "cosine", 1, False)),
    ("match", (160, 160, 64, "l2", 4, False)),
    ("match", (128, 128, 64, "cosine", 1, True)),
    ("match", (96, 96, 32, "l1", 1, False)),
    ("match", (160, 160, 64, "l1", 1, False)),
]
# same-scene features (raw colour patches of two overlapping crops), match's defaults
SCENE = [
    ("scene", (96, 96, 64, "cosine", 1)),
    ("scene", (96, 96, 64, "l2", 8)),
    ("scene", (80, 80, 256, "l2", 8)),
    ("scene", (56, 56, 768, "cosine", 8)),
]
# flat rows through match(precision="float32"), with the rows answered wrongly: ordinary inputs,
# and those whose candidates outgrow the near-tie cap (issue 27)
ROWS = [
    ("rows", ("noise", 8192, 8192, 64, "l2", 1)),
    ("rows", ("noise", 8192, 8192, 64, "l2", 8)),
    ("rows", ("photo", 8192, 8192, 49, "l2", 1)),
    ("rows", ("clustered", 8192, 8192, 64, "l2", 1)),
    ("rows", ("integers", 4096, 8192, 6, "l2", 8)),
]
DISTANCE = [
    ("distance", (4, 64, 96, 96, 256, "l2", "fwd")),
    ("distance", (4, 64, 96, 96, 256, "l2", "fwd+bwd")),
    ("distance", (4, 64, 96, 96, 256, "cosine", "fwd+bwd")),
    ("distance", (4, 64, 96, 96, 256, "l1", "fwd")),
    ("distance", (4, 64, 96, 96, 256, "l1", "fwd+bwd")),
    ("distance", (4, 64, 96, 96, 256, "linf", "fwd")),
    ("distance", (4, 64, 96, 96, 256, "linf", "fwd+bwd")),
    ("distance", (4, 64, 96, 96, 256, "l2", "nearest k=1")),
    ("distance", (4, 64, 96, 96, 256, "cosine", "nearest k=4")),
]


def export(rev: str, into: Path) -> Path:
    """REV's src/ under ``into``; returns the src folder."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    path = into / "archive.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def run_case(src: Path, kind: str, args: tuple, repeats: int, threads: int = 0) -> dict:
    code = CHILD.format(src=str(src), kind=kind, args=args, repeats=repeats, threads=threads)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir()
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(kind: str, args: tuple) -> str:
    if kind == "match":
        h, w, c, metric, k, mutual = args
        return f"match {h}x{w}x{c} {metric} k={k}" + (" mutual" if mutual else "")
    if kind == "scene":
        h, w, c, metric, k = args
        return f"match same-scene {h}x{w}x{c} {metric} k={k}"
    if kind == "rows":
        data, na, nb, c, metric, k = args
        return f"rows {data} {na}x{nb}x{c} {metric} k={k} float32"
    n, d, h, w, f, metric, what = args
    name = "nearest_prototype" if what.startswith("nearest") else "pairwise_distance"
    detail = what.split(" ", 1)[1] if what.startswith("nearest") else what
    return f"{name} N={n} D={d} {h}x{w} F={f} {metric} {detail}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the git revision to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one match and one distance case")
    p.add_argument("--only", default="", help="only the cases whose name contains this")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each subprocess (0: torch's default)")
    p.add_argument("--name", default="versions")
    args = p.parse_args()
    cases = [MATCH[0], DISTANCE[0]] if args.quick else MATCH + SCENE + ROWS + DISTANCE
    cases = [(kind, case) for kind, case in cases if args.only in describe(kind, case)]
    this = ROOT / "src"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = export(args.against, Path(tmp))
        for kind, case in cases:
            times: dict[str, list[float]] = {"this": [], "old": []}
            wrong: dict[str, int | None] = {}
            for r in range(args.rounds):
                order = [("this", this), ("old", old)] if r % 2 == 0 else [("old", old), ("this", this)]
                for label, src in order:
                    got = run_case(src, kind, case, args.repeats, args.threads)
                    times[label].append(got["seconds"])
                    wrong[label] = got["wrong"]
            new_s, old_s = statistics.median(times["this"]), statistics.median(times["old"])
            row = {"case": describe(kind, case), "this_s": new_s, "old_s": old_s, "ratio": new_s / old_s}
            row.update(this_wrong=wrong["this"], old_wrong=wrong["old"])
            rows.append(row)
            print(
                f"{row['case']:<60} this {new_s:.4f} s  {args.against} {old_s:.4f} s  ratio {row['ratio']:.2f}  "
                f"wrong rows {wrong['this']} / {wrong['old']}"
            )
    info = machine()
    if args.threads:
        info["torch_threads"] = args.threads
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "against": args.against, "rows": rows})
    print(f"\nmachine: {info}\nsaved {path}")
    print(
        f"\n| case | this checkout s | {args.against} s | this / {args.against} | rows wrong (this / {args.against}) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        wrong = "" if row["this_wrong"] is None else f"{row['this_wrong']} / {row['old_wrong']}"
        print(f"| {row['case']} | {row['this_s']:.4f} | {row['old_s']:.4f} | {row['ratio']:.2f} | {wrong} |")


if __name__ == "__main__":
    main()
