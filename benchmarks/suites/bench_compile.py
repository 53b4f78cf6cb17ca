"""torch.compile against eager (issue 40, goal 2): a model head of prototype distances, eager
and compiled (inductor, fullgraph), beside the same head written with torch.cdist, forward and
forward + backward.

Run: python benchmarks/suites/bench_compile.py [--repeats 7] [--rounds 3] [--sizes 4x64x48x48x32]

Sizes are NxDxHxWxF. The four variants of one case alternate round after round in one process
(compiled once before timing); each figure is the median over rounds of the median of
``--repeats`` calls. "compiled / eager" < 1 means the compiled head is faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import report, timeit


def cdist_head(x: torch.Tensor, p: torch.Tensor, metric: str) -> torch.Tensor:
    n, _d, h, w = x.shape
    rows = x.flatten(2).transpose(1, 2)  # (N, HW, D)
    out = torch.cdist(rows, p[None].expand(n, -1, -1), p=1.0 if metric == "l1" else 2.0)
    return out.transpose(1, 2).reshape(n, p.shape[0], h, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["4x64x48x48x32", "2x256x32x32x64"])
    ap.add_argument("--metrics", nargs="+", default=["l2", "l1"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="compile")
    args = ap.parse_args()
    rows = []
    for size in args.sizes:
        n, d, h, w, f = (int(v) for v in size.split("x"))
        x0 = torch.randn(n, d, h, w)
        for metric in args.metrics:
            layer = densematch.PrototypeDistance(f, d, metric=metric)
            heads = {
                "densematch": lambda x, m=metric, layer=layer: layer(x),
                "cdist": lambda x, m=metric, layer=layer: cdist_head(x, layer.prototypes, m),
            }
            for passes in ("fwd", "fwd+bwd"):
                variants = {}
                for name, head in heads.items():
                    torch._dynamo.reset()
                    compiled = torch.compile(head, fullgraph=True)
                    variants[(name, "eager")] = head
                    variants[(name, "compiled")] = compiled
                calls = {}
                for key, fn in variants.items():
                    if passes == "fwd":
                        calls[key] = lambda fn=fn, x0=x0: fn(x0)
                    else:
                        xg = x0.clone().requires_grad_()

                        def step(fn=fn, xg=xg, layer=layer) -> None:
                            fn(xg).sum().backward()
                            xg.grad = None
                            layer.zero_grad()

                        calls[key] = step
                    calls[key]()  # compile (and warm) before timing
                medians: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
                for _ in range(args.rounds):
                    for key, call in calls.items():
                        medians[key].append(timeit(call, repeats=args.repeats)["median"])
                ms = {k: 1000 * statistics.median(v) for k, v in medians.items()}
                rows.append(
                    {
                        "size": size,
                        "metric": metric,
                        "pass": passes,
                        "densematch eager ms": round(ms[("densematch", "eager")], 2),
                        "densematch compiled ms": round(ms[("densematch", "compiled")], 2),
                        "compiled / eager": round(ms[("densematch", "compiled")] / ms[("densematch", "eager")], 3),
                        "cdist eager ms": round(ms[("cdist", "eager")], 2),
                        "cdist compiled ms": round(ms[("cdist", "compiled")], 2),
                    }
                )
                print(rows[-1], flush=True)
    report(args.name, rows, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
