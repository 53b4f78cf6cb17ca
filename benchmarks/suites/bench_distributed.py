"""densematch.distributed on gloo: 1 and 2 processes (1 thread each) against FAISS IndexShards.

Run: python benchmarks/suites/bench_distributed.py [--repeats 3] [--quick]

Jobs: match 160x160x64 (cosine, k=1; shard="queries" and "references"), and nearest_prototype of
128x128 pixels (D=64) against a bank of 200,000 prototypes (l2, k=1; shard="prototypes" and
"pixels"). Each run of a job spawns its processes (gloo over a file store, one thread each),
times `repeats` calls after a warm-up on every rank, and reports the slowest rank's median, with
the time spent in collectives and the bytes each rank sent (densematch's ``stats``). FAISS runs
in this process, one thread per shard: IndexFlatIP (cosine on unit rows) or IndexFlatL2, whole
and as IndexShards of 2 (its shards searched in parallel threads), on the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save

JOBS = {
    "match 160x160x64 cosine": dict(kind="match", size=(160, 160, 64)),
    "nearest 128x128 D=64, F=200000 l2": dict(kind="nearest", size=(128, 128, 64, 200_000)),
}
QUICK = {
    "match 64x64x32 cosine": dict(kind="match", size=(64, 64, 32)),
    "nearest 32x32 D=16, F=5000 l2": dict(kind="nearest", size=(32, 32, 16, 5000)),
}


def data(kind: str, size: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "match":
        h, w, c = size
        return torch.randn(h, w, c, generator=g), torch.randn(h, w, c, generator=g)
    h, w, d, f = size
    return torch.randn(1, d, h, w, generator=g), torch.randn(f, d, generator=g)


def worker(rank: int, world: int, init: str, out: str, kind: str, size: tuple[int, ...], shard: str, repeats: int):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    import densematch.distributed as dm

    a, b = data(kind, size)
    share = slice(rank * b.shape[0] // world, (rank + 1) * b.shape[0] // world)
    mine = b[share] if shard in ("references", "prototypes") else b

    def call(stats: dict) -> None:
        if kind == "match":
            dm.match(a, mine, shard=shard, stats=stats)
        else:
            dm.nearest_prototype(a, mine, metric="l2", shard=shard, stats=stats)

    call({})
    times, comm, sent = [], [], []
    for _ in range(repeats):
        stats: dict = {}
        torch.distributed.barrier()
        t = time.perf_counter()
        call(stats)
        times.append(time.perf_counter() - t)
        comm.append(stats["seconds_communicating"])
        sent.append(stats["bytes_sent"])
    result = {"median_s": statistics.median(times), "comm_s": statistics.median(comm), "bytes_sent": sent[-1]}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def run_processes(world: int, kind: str, size: tuple[int, ...], shard: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, os.path.join(tmp, "init"), tmp, kind, size, shard, repeats)
        torch.multiprocessing.start_processes(worker, args=args, nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    slowest = max(ranks, key=lambda r: r["median_s"])
    return {**slowest, "bytes_sent_per_rank": max(r["bytes_sent"] for r in ranks)}


def run_faiss(kind: str, size: tuple[int, ...], shards: int, repeats: int) -> float:
    import faiss
    import numpy as np

    faiss.omp_set_num_threads(1)
    a, b = data(kind, size)
    if kind == "match":
        q = torch.nn.functional.normalize(a.reshape(-1, a.shape[-1]), dim=1).numpy()
        base = torch.nn.functional.normalize(b.reshape(-1, b.shape[-1]), dim=1).numpy()
        flat = faiss.IndexFlatIP
    else:
        q = np.ascontiguousarray(a[0].flatten(1).T.numpy())
        base = b.numpy()
        flat = faiss.IndexFlatL2
    d = base.shape[1]
    if shards == 1:
        index = flat(d)
        index.add(base)
    else:
        index = faiss.IndexShards(d, True, True)  # threaded, successive ids
        parts = []
        for s in range(shards):
            part = flat(d)
            part.add(base[s * len(base) // shards : (s + 1) * len(base) // shards])
            parts.append(part)
            index.add_shard(part)
    index.search(q, 1)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        index.search(q, 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    p.add_argument("--name", default="distributed")
    args = p.parse_args()
    rows = []
    for job, spec in (QUICK if args.quick else JOBS).items():
        kind, size = spec["kind"], spec["size"]
        shards = ("queries", "references") if kind == "match" else ("prototypes", "pixels")
        for shard in shards:
            for world in (1, 2):
                r = run_processes(world, kind, size, shard, args.repeats)
                rows.append({"job": job, "method": f"densematch shard={shard}", "processes": world, **r})
                print(rows[-1], flush=True)
        for n in (1, 2):
            t = run_faiss(kind, size, n, args.repeats)
            method = "FAISS IndexFlat" if n == 1 else "FAISS IndexShards"
            rows.append({"job": job, "method": method, "processes": n, "median_s": t})
            print(rows[-1], flush=True)
    info = machine()
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {path}\n")
    print("| job | method | processes (threads) | median s | communicating s | bytes sent per rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        comm = f"{r['comm_s']:.3f}" if "comm_s" in r else ""
        sent = f"{r['bytes_sent_per_rank']:,}" if "bytes_sent_per_rank" in r else ""
        print(f"| {r['job']} | {r['method']} | {r['processes']} | {r['median_s']:.3f} | {comm} | {sent} |")


if __name__ == "__main__":
    main()
