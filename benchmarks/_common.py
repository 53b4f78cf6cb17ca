"""Shared benchmark plumbing: timing with warm-up and medians, the machine, JSON results."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# where results/NAME.json go (DENSEMATCH_BENCH_RESULTS: elsewhere, as the scripts' smoke tests run them)
RESULTS = Path(os.environ.get("DENSEMATCH_BENCH_RESULTS") or Path(__file__).parent / "results")


def sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timeit(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median and spread of ``repeats`` timed calls after ``warmup`` untimed ones, in seconds."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "repeats": repeats}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def matmul_gflops(device: str = "cpu", n: int = 2048, repeats: int = 15) -> float:
    """This machine's float32 matmul rate, measured on (n x n) @ (n x n): the median of
    ``repeats`` (the machine is shared, so single runs swing by a factor of two)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    t = timeit(lambda: a @ b, repeats=repeats)["median"]
    return 2 * n**3 / t / 1e9


def measure_in_child(
    fn: Callable[..., torch.Tensor],
    inputs: Callable[[bool], list[torch.Tensor]],
    *,
    backward: bool,
    repeats: int,
    threads: int,
) -> None:
    """The body of a child process of :func:`peak_and_time`: warm up on ``inputs(True)`` (small),
    then print JSON with ``peak`` (bytes of VmHWM above the warm RSS over the first call on
    ``inputs(False)``) and ``seconds`` (the median of ``repeats`` more calls). With
    ``backward``, each call also takes the gradient of the output's sum."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def run(args: list[torch.Tensor]) -> None:
        for x in args:
            x.grad = None
        out = fn(*args)
        if backward:
            out.float().sum().backward()

    torch.set_num_threads(threads)
    run(inputs(True))
    args = inputs(False)
    before = status("VmRSS:")
    run(args)
    peak = status("VmHWM:") - before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(args)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": statistics.median(times), "peak": peak}))


def peak_and_time(code: str, keys: tuple[str, str] = ("peak", "seconds")) -> dict[str, Any]:
    """Run ``code`` (a script whose last line of output is JSON with ``peak`` bytes and
    ``seconds``) twice, in fresh processes: the peak from one whose glibc mmap threshold is
    fixed, so that freed blocks leave at once and RSS measures what is held; the time from a
    plain one, as users run (that threshold turns every large temporary into a fresh mapping,
    which penalises code that allocates many). ``{"error": last line of stderr}`` on failure."""
    import subprocess
    import sys

    found: dict[str, Any] = {}
    for key, extra in ((keys[0], {"MALLOC_MMAP_THRESHOLD_": "131072"}), (keys[1], {})):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **extra}, timeout=1800
        )
        if out.returncode:
            return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
        found[key] = json.loads(out.stdout.strip().splitlines()[-1])[key]
    return found


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
    return path


def report(name: str, rows: list[dict[str, Any]], command: str | None = None, **extra: Any) -> Path:
    """Save ``rows`` (and ``extra``) with the machine and the command (default: this one's argv)
    as results/NAME.json, and print the machine, the rows as a table and where they went."""
    info = machine()
    path = save(name, {"machine": info, "command": command or " ".join(sys.argv), "rows": rows, **extra})
    print(f"machine: {info}\n")
    print(table(rows, list(rows[0])))
    print(f"saved {path}")
    return path


def alternate_trees(
    script: str, srcs: list[str], labels: str | None, rounds: int, child_args: list[str] | None = None
) -> dict[str, list[Any]]:
    """Run ``script SRC *child_args --child`` for each source tree in turn, ``rounds`` times over
    (so a busy spell hits every tree alike), each in its own process; per tree (named by the
    comma-separated ``labels``, else "tree 1", ...) the JSON of each run's last line."""
    names = labels.split(",") if labels else [f"tree {i + 1}" for i in range(len(srcs))]
    if len(names) != len(srcs):
        raise SystemExit(f"--labels must name each of the {len(srcs)} trees, got {len(names)} names")
    got: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        for src, name in zip(srcs, names, strict=True):
            done = subprocess.run(
                [sys.executable, script, src, *(child_args or []), "--child"],
                capture_output=True,
                text=True,
                check=True,
            )
            got[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}", name, flush=True)
    return got


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def photo_features(h: int, w: int, c: int, *, photo: str = "astronaut", shift: tuple[int, int] = (6, -3)):
    """Real (h, w, c) features of a photo and of a shifted, noisy crop of it (scikit-image's
    samples): zero-mean unit-norm grey patches of the smallest odd size with at least c pixels,
    turned into c channels by a fixed orthonormal projection (which keeps their correlations)."""
    import numpy as np
    from skimage import data

    from densematch.app.features import patch_descriptor

    img = getattr(data, photo)().astype(np.float32) / 255
    if img.ndim == 3:
        img = img[..., :3].mean(-1)
    size = int(np.ceil(c**0.5)) | 1
    top, left = 100, 150
    crops = [
        img[top : top + h, left : left + w],
        img[top + shift[0] : top + shift[0] + h, left + shift[1] : left + shift[1] + w],
    ]
    crops[1] = crops[1] + np.random.default_rng(0).normal(0, 0.02, crops[1].shape).astype(np.float32)
    proj, _ = torch.linalg.qr(torch.randn(size * size, c, generator=torch.Generator().manual_seed(1)))
    return tuple(patch_descriptor(torch.from_numpy(np.ascontiguousarray(x)), size) @ proj for x in crops)


# Loads that other programs put on the machine while a benchmark runs (benchmarks/suites/bench_load.py
# says why these two): another PyTorch program with its own OpenMP pool plus a busy loop, or two
# plain busy loops.
TORCH_LOAD = "import torch\nx = torch.randn(384, 384)\nwhile True:\n    x = torch.tanh(x @ x)\n"
BUSY_LOOP = "while True:\n    pass\n"
LOADS = {"quiet": [], "torch": [TORCH_LOAD, BUSY_LOOP], "busy": [BUSY_LOOP, BUSY_LOOP]}


@contextlib.contextmanager
def under_load(load: str) -> Iterator[None]:
    """Run the block while the programs of ``LOADS[load]`` run beside it (started 2 s before)."""
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in LOADS[load]]
    try:
        time.sleep(2.0 if procs else 0.0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
