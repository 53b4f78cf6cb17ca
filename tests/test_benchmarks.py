"""The benchmark scripts that reach into the engine's internals, run at their smallest.

A study that patches or calls a private method (``HalfSearch._block``, ``_sides``) breaks silently
when the method changes: bench_certify.py's replay failed for a day after ``_sides`` changed its
signature, and ``gpu.py`` runs once per lent GPU, where a failure costs device time. Each runs here
in its own process on inputs of a few hundred pixels, its JSON written to a temporary folder
(``DENSEMATCH_BENCH_RESULTS``). Timings are not checked, only that each script finishes and says
what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--sizes", "24x24x64"]
SCRIPTS = {
    "bench_certify, one thread": (
        "studies/bench_certify.py",
        [*TINY, "--features", "same-scene", "--metrics", "l2", "--ks", "1", "--repeats", "1", "--threads", "1"],
        "smoke",
    ),
    # above one thread the products are recorded by key and replayed (bench_certify.replayed_rest)
    "bench_certify, two threads": (
        "studies/bench_certify.py",
        [*TINY, "--features", "same-scene", "--metrics", "cosine", "--ks", "8", "--repeats", "1", "--threads", "2"],
        "smoke",
    ),
    "cap_bounds": ("studies/cap_bounds.py", [*TINY, "--metrics", "l2", "--ks", "1"], "smoke"),
    "c_step_replay": ("studies/c_step_replay.py", ["--cases", "24x24x64:l2:8", "--repeats", "1"], "smoke"),
    "exact_goals": (
        "suites/exact_goals.py",
        "--threads 1 --cases 24x24x64 --ks 1 --metrics cosine --features same-scene --rounds 1".split(),
        "smoke",
    ),
    "gpu, on the CPU": ("suites/gpu.py", ["--small", "--device", "cpu"], None),
    # the A/B of two revisions, on its smallest same-scene case at two threads, against HEAD
    "bench_versions": (
        "suites/bench_versions.py",
        ["--against", "HEAD", "--only", "same-scene 96x96x64 cosine", *"--rounds 1 --repeats 1 --threads 2".split()],
        "smoke",
    ),
}


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_the_script_runs_and_writes_its_rows(case, tmp_path):
    script, args, name = SCRIPTS[case]
    env = {**os.environ, "DENSEMATCH_BENCH_RESULTS": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    if name is not None:
        command += ["--name", name]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = list(tmp_path.glob("*.json"))
    assert len(written) == 1, written
    assert json.loads(written[0].read_text())["rows"]
