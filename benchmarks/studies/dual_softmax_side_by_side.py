"""The dual (or plain) softmax of one densematch source tree against the dense recipe, in one process.

Run: python benchmarks/studies/dual_softmax_side_by_side.py SRC SIDE [MODE [C]], where SRC is a src/
folder (this checkout's, or an earlier revision's from ``git archive REV src | tar -x -C DIR``),
SIDE the maps' side, MODE dual_softmax (default) or softmax and C the channels (default 64;
temperature 0.1, one thread). Run it for each tree, alternating: it prints the median of 3
rounds, in ms, of soft_match's forward and forward+backward and the dense recipe's.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    import torch
    import torch.nn.functional as F

    import densematch

    torch.set_num_threads(1)
    side = int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "dual_softmax"
    c = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(side, side, c, generator=g) for _ in range(2))
    grid = torch.meshgrid(torch.arange(side * 1.0), torch.arange(side * 1.0), indexing="ij")
    positions = torch.stack(grid, -1).reshape(-1, 2)

    def ours(backward: bool) -> None:
        x, y = a.clone().requires_grad_(backward), b.clone().requires_grad_(backward)
        r = densematch.soft_match(x, y, temperature=0.1, mode=mode)
        if backward:
            r.coords.sum().backward()

    def dense(backward: bool) -> None:
        x, y = a.clone().requires_grad_(backward), b.clone().requires_grad_(backward)
        q, k = F.normalize(x.reshape(-1, c), dim=1), F.normalize(y.reshape(-1, c), dim=1)
        s = q @ k.T / 0.1
        if mode == "dual_softmax":
            p = s.softmax(1) * s.softmax(0)
            out = (p / p.sum(1, keepdim=True)) @ positions
        else:
            out = s.softmax(1) @ positions
        if backward:
            out.sum().backward()

    runs: dict[str, Callable[[], None]] = {
        "fwd": lambda: ours(False),
        "fwd+bwd": lambda: ours(True),
        "dense fwd": lambda: dense(False),
        "dense fwd+bwd": lambda: dense(True),
    }
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    print(sys.argv[1], mode, side, c, {name: round(statistics.median(t) * 1e3) for name, t in times.items()})


if __name__ == "__main__":
    main()
