"""The certificate's own cost, this checkout against an earlier revision, side by side.

Run: python benchmarks/studies/certify_versions.py --against REV [--cases 96x96x64:l2:1 ...]
     [--threads 1 2] [--rounds 3]

The certified bfloat16 search (forced) with its products recorded and replayed, over float32's
search run in turns with it (:func:`bench_certify.replayed_rest`), on same-scene features: what
does not depend on the product's speed, so any CPU compares two revisions. Every (case, threads,
version) runs in its own subprocess with that version's ``src`` first on ``sys.path``
(REV's exported with ``git archive``, as in ``suites/bench_versions.py``); the versions
alternate within each round (A B, then B A). The table gives the medians over rounds of each
run's "replayed / float32" and, with several threads, "replayed less copies / float32"."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suites"))
from bench_versions import export  # REV's src/, exported

from _common import machine, save

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {src!r})
    sys.path.insert(1, {studies!r})
    import torch, densematch
    assert densematch.__file__.startswith({src!r}), densematch.__file__
    import bench_certify
    from densematch import engine
    from densematch.app.synthetic import same_scene_pair
    from densematch.precision import Precision
    torch.set_num_threads({threads})
    h, w, c = {size}
    fa, fb = same_scene_pair(h, w, c)
    a, b = fa.reshape(-1, c).contiguous(), fb.reshape(-1, c).contiguous()
    kw = dict(metric={metric!r}, k={k}, budget=2**28)
    bf16 = Precision(half=torch.bfloat16)
    got = bench_certify.replayed_rest(
        lambda: engine.topk(a, b, **kw, precision=bf16), lambda: engine.topk(a, b, **kw), {repeats}
    )
    print(json.dumps(None if got is None else list(got)))
    """
)


def run_case(src: Path, case: tuple[tuple[int, int, int], str, int], threads: int, repeats: int) -> list[float]:
    size, metric, k = case
    code = CHILD.format(
        src=str(src), studies=str(HERE), threads=threads, size=size, metric=metric, k=k, repeats=repeats
    )
    env = {key: v for key, v in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=HERE)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got is None:
        raise RuntimeError(f"{case}: the recorded tiles pass bench_certify.REPLAY_BYTES")
    return got


def parse_case(text: str) -> tuple[tuple[int, int, int], str, int]:
    size, metric, k = text.split(":")
    h, w, c = (int(x) for x in size.split("x"))
    return (h, w, c), metric, int(k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="the git revision to compare with")
    p.add_argument(
        "--cases",
        nargs="+",
        default=["96x96x64:cosine:1", "96x96x64:l2:1", "80x80x256:cosine:1", "80x80x256:l2:1", "48x48x1536:l2:1"],
        help="HxWxC:metric:k",
    )
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="replayed turns within one subprocess")
    p.add_argument("--name", default="certify-versions")
    args = p.parse_args()
    this = ROOT / "src"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = export(args.against, Path(tmp))
        for text in args.cases:
            case = parse_case(text)
            for threads in args.threads:
                got: dict[str, list[list[float]]] = {"this": [], "old": []}
                for r in range(args.rounds):
                    order = [("this", this), ("old", old)] if r % 2 == 0 else [("old", old), ("this", this)]
                    for label, src in order:
                        got[label].append(run_case(src, case, threads, args.repeats))
                row: dict[str, object] = {"case": text, "threads": threads}
                for label in ("this", "old"):
                    row[f"{label} replayed / float32"] = round(statistics.median(g[1] for g in got[label]), 3)
                    if threads > 1:
                        less = statistics.median(g[2] for g in got[label])
                        row[f"{label} less copies / float32"] = round(less, 3)
                rows.append(row)
                print(row, flush=True)
    info = machine()
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "against": args.against, "rows": rows})
    print(f"\nmachine: {info}\nsaved {path}")
    print(f"\n| case | threads | this | {args.against} | this, less copies | {args.against}, less copies |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['case']} | {row['threads']} | {row['this replayed / float32']} | {row['old replayed / float32']} "
            f"| {row.get('this less copies / float32', '')} | {row.get('old less copies / float32', '')} |"
        )


if __name__ == "__main__":
    main()
