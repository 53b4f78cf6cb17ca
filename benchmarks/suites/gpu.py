"""One short GPU run that checks and times everything (for a session that is lent a GPU).

Run: python benchmarks/suites/gpu.py [--device cuda] [--small]   (--small --device cpu smoke-tests it)

Checks first (CUDA answers against the CPU's), then times, each side by side in one run:
- match, 800x800xC for C in 64, 256, 1024 (cosine, k=1) and a k=4 case: precision "exact" (the
  fused Triton kernel with the certificate), "fast", "float32" (the kernel in IEEE float32, C=64
  only), the torch engine (kernel="torch"), and the blockwise loop in torch (on a slice of the
  queries beyond C=64, scaled up); torch's own bfloat16 matmul rate at the same C and at 8192^3;
  ms, TFLOP/s and the fraction of that rate; the certificate's candidate counts and fallback
  rate; exactness of "exact" against float64 on 2000 sampled rows;
- pairwise_distance l2 / l1, forward and forward+backward, against torch.cdist;
- align: one 100x100-into-125x125 pair (target < 5 ms), the same with certify=True (the
  certificate on the CPU's C kernels) and a batch of 256 (target > 2000 pairs/s);
- local_match: the cost volume at 96x128, C=64, r=4 (dot), forward and forward+backward, against
  the unfold/pad recipe; soft_match at 128x128, C=64, against the dense recipe.
Writes benchmarks/results/gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import machine, save, table, timeit
from densematch.app.recipes import blockwise_argmax
from densematch.app.synthetic import alignment_cases


def matmul_tflops(dev: torch.device, n: int, c: int) -> float:
    """torch's bfloat16 (n x c) @ (c x n) rate, median of 5."""
    x = torch.randn(n, c, device=dev, dtype=torch.bfloat16)
    y = torch.randn(c, n, device=dev, dtype=torch.bfloat16)
    t = timeit(lambda: x @ y, repeats=5)
    return 2 * n * n * c / t["median"] / 1e12


def exactness(fa: torch.Tensor, fb: torch.Tensor, index: torch.Tensor, rows: int = 2000) -> float:
    """Fraction of sampled query rows whose cosine match is worse than the float64 best by more
    than float32 rounding (0 when exact, ties counted as ties)."""
    c = fa.shape[-1]
    a = fa.reshape(-1, c).double()
    b = fb.reshape(-1, c).double()
    a, b = a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True)
    pick = torch.randperm(a.shape[0], device=a.device)[:rows]
    s = a[pick] @ b.T
    got = s.gather(1, index.reshape(-1)[pick, None]).squeeze(1)
    return float((s.amax(1) - got > 2e-6 * c**0.5 + 1e-6).float().mean())


def match_rows(dev: torch.device, *, small: bool, checks: dict[str, bool]) -> list[dict]:
    """The fused kernel's table: 800x800xC (cosine), every precision and the baselines."""
    from densematch import engine
    from densematch.precision import resolve_precision

    rows: list[dict] = []
    cases = (
        [(48, 48, 64, 1)] if small else [(800, 800, 64, 1), (800, 800, 256, 1), (800, 800, 1024, 1), (800, 800, 64, 4)]
    )
    for h, w, c, k in cases:
        g = torch.Generator(device=dev).manual_seed(c + k)
        fa = torch.randn(h, w, c, device=dev, generator=g)
        fb = torch.randn(h, w, c, device=dev, generator=g)
        n = h * w
        flops = 2 * n * n * c
        rate = matmul_tflops(dev, 8192, c) if dev.type == "cuda" else float("nan")
        job = f"match {h}x{w}x{c} k={k}"
        methods = {
            "exact (kernel)": ({"precision": "exact"}, "auto"),
            "fast (kernel)": ({"precision": "fast"}, "auto"),
            "exact (torch engine)": ({"precision": "exact"}, "torch"),
        }
        if c == 64:
            methods["float32 (kernel)"] = ({"precision": "float32"}, "auto")
        for name, (kw, kernel) in methods.items():
            with densematch.config_context(kernel=kernel):
                t = timeit(lambda fa=fa, fb=fb, kw=kw, k=k: densematch.match(fa, fb, k=k, **kw), repeats=3)
                out = densematch.match(fa, fb, k=k, **kw)
            row = {
                "job": job,
                "method": name,
                "median_s": round(t["median"], 4),
                "tflops": round(flops / t["median"] / 1e12, 1),
                "of_matmul": round(flops / t["median"] / 1e12 / rate, 2),
            }
            if k == 1 and kw["precision"] == "exact":
                row["inexact_rows"] = exactness(fa, fb, out.index)
                checks[f"{job} {name} exact"] = row["inexact_rows"] == 0.0
            rows.append(row)
            print(row, flush=True)
        # the certificate's counts (the kernel on CUDA, else the torch engine with bfloat16)
        stats: dict[str, int] = {}
        with densematch.config_context(half="auto" if dev.type == "cuda" else "bfloat16"):
            prec = resolve_precision("exact", dev, "cosine")
        engine.topk(
            fa.reshape(-1, c), fb.reshape(-1, c), metric="cosine", k=k, budget=8 * 2**30, precision=prec, stats=stats
        )
        rows.append(
            {
                "job": job,
                "method": "certificate",
                "candidates_per_row": round(stats["candidates"] / n, 2),
                "fallback_rate": round(stats["fallback"] / n, 5),
                "most": stats["most"],
            }
        )
        print(rows[-1], flush=True)
        # the blockwise loop: the whole map at C=64, else a slice of the queries, scaled up
        part = n if c == 64 or small else n // 8
        qa, rb = fa.reshape(-1, c)[:part], fb.reshape(-1, c)
        t = timeit(lambda qa=qa, rb=rb: blockwise_argmax(qa, rb), repeats=2)
        sec = t["median"] * n / part
        rows.append(
            {
                "job": job,
                "method": "blockwise torch" + ("" if part == n else " (1/8, scaled)"),
                "median_s": round(sec, 4),
                "tflops": round(flops / sec / 1e12, 1),
                "of_matmul": round(flops / sec / 1e12 / rate, 2),
            }
        )
        print(rows[-1], flush=True)
        rows.append({"job": job, "method": f"torch bf16 matmul 8192x8192x{c}", "tflops": round(rate, 1)})
    if dev.type == "cuda":
        rows.append(
            {"job": "peak", "method": "torch bf16 matmul 8192^3", "tflops": round(matmul_tflops(dev, 8192, 8192), 1)}
        )
    return rows


def window_rows(dev: torch.device, *, small: bool) -> list[dict]:
    """local_match's volume against the unfold/pad recipe, soft_match against the dense recipe."""
    import torch.nn.functional as F

    rows: list[dict] = []
    h, w, c, r = (24, 32, 16, 2) if small else (96, 128, 64, 4)
    a = torch.randn(1, c, h, w, device=dev, requires_grad=True)
    b = torch.randn(1, c, h, w, device=dev, requires_grad=True)

    def unfold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(F.pad(b, (r, r, r, r)), 2 * r + 1).view(1, c, 2 * r + 1, 2 * r + 1, h, w)
        return (a[:, :, None, None] * patches).sum(1)

    def ours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return densematch.local_cost_volume(a, b, r, metric="dot", layout="chw")

    side = 32 if small else 128
    qa = torch.randn(side, side, 64, device=dev, requires_grad=True)
    qb = torch.randn(side, side, 64, device=dev, requires_grad=True)
    pos = torch.stack(torch.meshgrid(*(torch.arange(side * 1.0, device=dev),) * 2, indexing="ij"), -1).reshape(-1, 2)

    def dense(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        q, k = (F.normalize(x.reshape(-1, 64), dim=1) for x in (a, b))
        return (q @ k.T / 0.1).softmax(1) @ pos

    def soft(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return densematch.soft_match(a, b).coords

    for job, inputs, methods in (
        (f"local volume {h}x{w} C={c} r={r}", (a, b), (("densematch", ours), ("unfold/pad recipe", unfold))),
        (f"soft_match {side}x{side} C=64", (qa, qb), (("densematch", soft), ("dense recipe", dense))),
    ):
        for name, fn in methods:
            fwd = timeit(lambda fn=fn, x=inputs: fn(*x).detach(), repeats=5)
            both = timeit(lambda fn=fn, x=inputs: fn(*x).sum().backward(), repeats=3)
            rows.append(
                {"job": job, "method": name, "median_s": round(fwd["median"], 5), "fwd+bwd_s": round(both["median"], 5)}
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    g = torch.Generator().manual_seed(0)

    # correctness on the device against the CPU
    a, b = torch.randn(40, 50, 32, generator=g), torch.randn(45, 41, 32, generator=g)
    for metric in ("cosine", "l2", "l1"):
        ref = densematch.match(a, b, metric=metric, k=3)
        got = densematch.match(a.to(dev), b.to(dev), metric=metric, k=3, memory="2MiB")
        checks[f"match {metric}"] = bool(torch.allclose(got.score.cpu(), ref.score, atol=1e-4))
    x, p = torch.randn(2, 16, 20, 20, generator=g), torch.randn(30, 16, generator=g)
    for metric in ("l2", "l1", "cosine"):
        ref = densematch.pairwise_distance(x, p, metric=metric)
        got = densematch.pairwise_distance(x.to(dev), p.to(dev), metric=metric)
        checks[f"distance {metric}"] = bool(torch.allclose(got.cpu(), ref, atol=1e-4))
    case = next(alignment_cases(1, seed=0, sizes=(((100, 100), (125, 125)),)))
    al = densematch.align(case.template.to(dev), case.image.to(dev))
    checks["align"] = abs(al.scale_h - case.scale_h) < 0.005 and abs(al.shift_x - case.shift_x) < 0.5
    sure = densematch.align(case.template.to(dev), case.image.to(dev), certify=True)  # issue 41, goal 5
    checks["align certify=True"] = bool(sure.certificate.certified) and sure.scale_h == al.scale_h
    fa, fb = torch.randn(2, 20, 24, 16, generator=g), torch.randn(2, 20, 24, 16, generator=g)
    flow = 3 * torch.randn(2, 20, 24, 2, generator=g)
    for sampling in ("nearest", "bilinear"):
        kw = dict(flow=flow, sampling=sampling, metric="l2", fill=0.0)
        ref = densematch.local_cost_volume(fa, fb, 3, **kw)
        got = densematch.local_cost_volume(fa.to(dev), fb.to(dev), 3, **{**kw, "flow": flow.to(dev)})
        checks[f"local_match volume {sampling}"] = bool(torch.allclose(got.cpu(), ref, atol=1e-4))
    ref_soft, got_soft = densematch.soft_match(fa, fb), densematch.soft_match(fa.to(dev), fb.to(dev))
    for field in ("coords", "spread", "max_weight"):  # max_weight: the fused kernel's log-sum-exp
        checks[f"soft_match {field}"] = bool(
            torch.allclose(getattr(got_soft, field).cpu(), getattr(ref_soft, field), atol=1e-3)
        )
    print("checks:", checks, flush=True)

    rows += match_rows(dev, small=args.small, checks=checks)

    n, d, hw, f = (2, 32, 32, 64) if args.small else (8, 128, 96, 512)
    xd = torch.randn(n, d, hw, hw, device=dev, requires_grad=True)
    pd = torch.randn(f, d, device=dev, requires_grad=True)
    for metric, order in (("l2", 2.0), ("l1", 1.0)):
        for name, fn in (
            ("densematch", lambda m=metric: densematch.pairwise_distance(xd, pd, metric=m, check_finite=False)),
            ("torch.cdist", lambda o=order: torch.cdist(xd.flatten(2).transpose(1, 2), pd, p=o)),
        ):
            fwd = timeit(lambda fn=fn: fn().detach(), repeats=5)
            both = timeit(lambda fn=fn: fn().sum().backward(), repeats=3)
            rows.append(
                {
                    "job": f"distance {metric} N={n} D={d} {hw}x{hw} F={f}",
                    "method": name,
                    "median_s": round(fwd["median"], 4),
                    "fwd+bwd_s": round(both["median"], 4),
                }
            )
            print(rows[-1], flush=True)

    t = timeit(lambda: densematch.align(case.template.to(dev), case.image.to(dev)), repeats=10)
    rows.append({"job": "align 1 pair 100/125", "method": "densematch", "median_s": round(t["median"], 5)})
    t = timeit(lambda: densematch.align(case.template.to(dev), case.image.to(dev), certify=True), repeats=3)
    rows.append({"job": "align 1 pair, certify=True", "method": "densematch", "median_s": round(t["median"], 4)})
    nb = 16 if args.small else 256
    bc = list(alignment_cases(nb, seed=1, sizes=(((100, 100), (125, 125)),)))
    tb = torch.stack([c.template for c in bc]).to(dev)
    xb = torch.stack([c.image for c in bc]).to(dev)
    t = timeit(lambda: densematch.align(tb, xb), repeats=3)
    rows.append(
        {
            "job": f"align batch of {nb}",
            "method": "densematch",
            "median_s": round(t["median"], 4),
            "pairs_per_s": round(nb / t["median"], 1),
        }
    )
    print(rows[-1], flush=True)

    rows += window_rows(dev, small=args.small)

    info = machine()
    path = save(
        "gpu" if cuda else "gpu-smoke-cpu",
        {"machine": info, "command": " ".join(sys.argv), "checks": checks, "rows": rows},
    )
    print(f"\nmachine: {info}\nchecks: {checks}\n")
    columns = ["job", "method", "median_s", "fwd+bwd_s", "tflops", "of_matmul", "inexact_rows"]
    columns += ["candidates_per_row", "fallback_rate", "most", "pairs_per_s"]
    print(table(rows, columns))
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
