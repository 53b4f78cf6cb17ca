"""The certified search's C step alone, in ns per pair: every call of one search recorded, then
replayed timed.

Run: python benchmarks/studies/c_step_replay.py [--cases 96x96x64:cosine:1 ...] [--repeats 7]

One search (one thread, the certified bfloat16 search forced, same-scene features) runs with each
call of :class:`densematch.kernels.native.CertifiedStep` recorded: its score tile, reference
terms, bias and groups, and each step's running top-k and lists as they were before its first
call. The calls are then replayed in their order from those states, each tile first copied into
one buffer (in cache, as the product leaves it) and only the step timed; the median over repeats.
"scan" replays them with every floor raised out of reach: the chunk test and the bounds with no
pair taken (no merge, no listing). Product-free, so any CPU with the C kernels compares; the
figures depend on the CPU's vector units (`densematch info` names its level).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import report
from densematch import engine
from densematch.app.synthetic import same_scene_pair
from densematch.kernels import c_engine
from densematch.precision import Precision


def record(a: torch.Tensor, b: torch.Tensor, metric: str, k: int) -> tuple[list, dict]:
    """The step calls of one certified search (each with its own copies) and each step's state
    before its first call."""
    calls: list = []
    first: dict = {}
    real = c_engine.CertifiedStep.__call__

    def spy(self, h, offset, planes, bias=None, groups=None):  # type: ignore[no-untyped-def]
        if id(self) not in first:
            lists = self.listed
            first[id(self)] = (self, [t.clone() for t in self._held], [t.clone() for t in _lists(lists)])
        calls.append((id(self), h.clone(), offset, planes.clone(), None if bias is None else bias.clone(),
                      None if groups is None else tuple(g.clone() for g in groups)))  # fmt: skip
        return real(self, h, offset, planes, bias, groups)

    c_engine.CertifiedStep.__call__ = spy  # type: ignore[method-assign]
    try:
        engine.topk(a, b, metric=metric, k=k, budget=2**28, precision=Precision(half=torch.bfloat16))
    finally:
        c_engine.CertifiedStep.__call__ = real  # type: ignore[method-assign]
    return calls, first


def _lists(listed: c_engine.Candidates) -> tuple[torch.Tensor, ...]:
    return listed.cols, listed.vals, listed.counts, listed.over


@torch.inference_mode()
def replay(calls: list, first: dict, *, scan: bool) -> float:
    """Seconds inside the step calls, replayed from their first states (``scan``: floors out of
    reach)."""
    for step, held, lists in first.values():
        for t, saved in zip(step._held, held, strict=True):
            t.copy_(saved)
        if scan:
            step._held[0].fill_(torch.finfo(torch.float32).max)
        for t, saved in zip(_lists(step.listed), lists, strict=True):
            t.copy_(saved)
    buffer = torch.empty(max(call[1].numel() for call in calls), dtype=torch.bfloat16)
    total = 0.0
    for key, h, offset, planes, bias, groups in calls:
        tile = buffer[: h.numel()].view(h.shape)
        tile.copy_(h)
        t0 = time.perf_counter()
        first[key][0](tile, offset, planes, bias, groups)
        total += time.perf_counter() - t0
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", nargs="+", default=["96x96x64:cosine:1", "80x80x256:cosine:1", "96x96x64:l2:8", "56x56x768:cosine:8"]
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--name", default="c-step-replay")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for case in args.cases:
        size, metric, k = case.split(":")
        h, w, c = (int(x) for x in size.split("x"))
        fa, fb = same_scene_pair(h, w, c)
        calls, first = record(fa.reshape(-1, c), fb.reshape(-1, c), metric, int(k))
        pairs = sum(call[1].numel() for call in calls)
        got = {}
        for scan in (False, True):
            replay(calls, first, scan=scan)  # warm-up
            got[scan] = statistics.median(replay(calls, first, scan=scan) for _ in range(args.repeats))
        rows.append(
            {
                "case": case,
                "calls": len(calls),
                "pairs (M)": round(pairs / 1e6, 1),
                "step ms": round(1e3 * got[False], 1),
                "step ns/pair": round(1e9 * got[False] / pairs, 3),
                "scan ns/pair": round(1e9 * got[True] / pairs, 3),
            }
        )
        print(rows[-1], flush=True)
    report(args.name, rows)


if __name__ == "__main__":
    main()
