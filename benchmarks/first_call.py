"""What a fresh process pays for each public function's first call, against its second, for one
or more densematch source trees side by side (each call in its own process, the trees alternated
round by round).

Run: python benchmarks/first_call.py SRC [SRC ...] [--labels A,B] [--rounds 5] [--name NAME]

SRC is a src/ folder: this checkout's, or an earlier revision's (``git worktree add DIR REV``,
then DIR/src). Each process imports torch, then densematch (timed), then calls one function twice
on small inputs (timed each), and reports whether torch._dynamo was imported on the way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CALLS = {
    "match": "densematch.match(a, b, mutual=True)",
    "pairwise_distance + backward": "densematch.pairwise_distance(a, p).sum().backward()",
    "nearest_prototype": "densematch.nearest_prototype(a, p)",
    "soft_match": "densematch.soft_match(a, b, mode='dual_softmax')",
    "local_cost_volume": "densematch.local_cost_volume(a, b, 3)",
}

PROGRAM = """
import json, sys, time
import torch
t = time.perf_counter()
import densematch
imported = time.perf_counter() - t
g = torch.Generator().manual_seed(0)
a, b = torch.randn(1, 32, 48, 48, generator=g), torch.randn(1, 32, 48, 48, generator=g)
p = torch.randn(16, 32, generator=g, requires_grad=True)
times = []
for _ in range(2):
    t = time.perf_counter()
    {call}
    times.append(time.perf_counter() - t)
print(json.dumps({{"import_s": imported, "first_s": times[0], "second_s": times[1],
                  "dynamo": "torch._dynamo" in sys.modules}}))
"""


def one(src: str, call: str) -> dict[str, float | bool]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(call=call)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+")
    p.add_argument("--labels")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default="first-call")
    args = p.parse_args()
    labels = args.labels.split(",") if args.labels else args.trees
    runs: dict[tuple[str, str], list[dict[str, float | bool]]] = {}
    for _ in range(args.rounds):
        for name, call in CALLS.items():
            for label, src in zip(labels, args.trees, strict=True):
                runs.setdefault((label, name), []).append(one(os.path.abspath(src), call))
    rows = []
    print(f"{'tree':>10} {'function':>30} {'import s':>9} {'first s':>8} {'second s':>9} {'first-second':>13} dynamo")
    for (label, name), got in runs.items():
        med = {key: statistics.median(float(r[key]) for r in got) for key in ("import_s", "first_s", "second_s")}
        extra = statistics.median(float(r["first_s"]) - float(r["second_s"]) for r in got)
        dynamo = all(bool(r["dynamo"]) for r in got)
        rows.append({"tree": label, "function": name, **med, "first_minus_second_s": extra, "dynamo": dynamo})
        print(
            f"{label:>10} {name:>30} {med['import_s']:9.2f} {med['first_s']:8.3f} {med['second_s']:9.3f} "
            f"{extra:13.3f} {dynamo}"
        )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"{args.name}.json"), "w") as fh:
        json.dump({"rounds": args.rounds, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
