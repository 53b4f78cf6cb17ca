"""soft_match with its default (automatic) temperature, forward and forward + backward, for one
source tree: run it for each tree, alternating, to compare revisions.

Run: python benchmarks/studies/soft_default_temperature.py SRC [SIDE ...], where SRC is a src/ folder
(this checkout's, or an earlier revision's from ``git archive REV src | tar -x -C DIR``); sides
default to 32 and 64, C=64 random features, one thread, medians of 5 after a warm-up.
"""

from __future__ import annotations

import statistics
import sys
import time


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    import torch

    import densematch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for side in [int(v) for v in sys.argv[2:]] or [32, 64]:
        a, b = (torch.randn(side, side, 64, generator=g) for _ in range(2))
        times: dict[bool, list[float]] = {}
        for r in range(6):
            for grad in (False, True):
                x, y = a.clone().requires_grad_(grad), b.clone().requires_grad_(grad)
                t0 = time.perf_counter()
                m = densematch.soft_match(x, y)
                if grad:
                    m.coords.sum().backward()
                if r:  # the first round warms up
                    times.setdefault(grad, []).append(time.perf_counter() - t0)
        shown = {"fwd+bwd" if k else "fwd": round(statistics.median(v) * 1e3, 1) for k, v in times.items()}
        print(sys.argv[1], side, shown, flush=True)


if __name__ == "__main__":
    main()
