"""match under small memory budgets, for one or more densematch source trees side by side: each
tree in its own process, the trees alternated round by round, the median of the rounds.

Run: python benchmarks/small_budgets.py SRC [SRC ...] [--labels A,B] [--rounds 3]

SRC is a src/ folder (``git worktree add DIR REV``, then DIR/src for an earlier revision). Cases:
Gaussian features of (side, side, C) against their flip, l2, k=3 (the shape of
tests/test_match.py's tiny-budget test), under each memory setting; one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [(40, 25, "300KiB"), (40, 25, "1MiB"), (40, 25, "16MiB"), (96, 64, "1MiB"), (96, 64, "4MiB"), (96, 64, "64MiB")]

PROGRAM = """
import json, time, torch
torch.set_num_threads(1)
import densematch
out = []
for side, c, memory in {cases!r}:
    f = torch.randn(side, side, c, generator=torch.Generator().manual_seed(0))
    densematch.match(f[:8, :8], f[:8, :8], metric="l2", k=3, memory=memory)  # warm-up
    t = time.perf_counter()
    densematch.match(f, f.flip(0), metric="l2", k=3, memory=memory)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+")
    p.add_argument("--labels")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default="small-budgets")
    args = p.parse_args()
    labels = args.labels.split(",") if args.labels else args.trees
    times: dict[str, list[list[float]]] = {label: [] for label in labels}
    for _ in range(args.rounds):
        for label, src in zip(labels, args.trees, strict=True):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            done = subprocess.run(
                [sys.executable, "-c", PROGRAM.format(cases=CASES)], env=env, capture_output=True, text=True, check=True
            )
            times[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    print(f"{'case':>24} " + " ".join(f"{label + ' s':>12}" for label in labels))
    for n, (side, c, memory) in enumerate(CASES):
        med = {label: statistics.median(r[n] for r in times[label]) for label in labels}
        rows.append({"side": side, "c": c, "memory": memory, **{f"{label}_s": v for label, v in med.items()}})
        print(f"{f'{side}x{side}x{c} {memory}':>24} " + " ".join(f"{med[label]:12.3f}" for label in labels))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"{args.name}.json"), "w") as fh:
        json.dump({"rounds": args.rounds, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
