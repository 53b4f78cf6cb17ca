"""Building the C kernels (native.c, align.c): one shared library per instruction-set level, the
same flags everywhere.

Standard library only, so that the package build (setup.py, which runs this file by its path
before densematch or torch can be imported) and the run-time fallback (:mod:`.native`, which
builds into a cache where a package shipped none) compile with one rule.

Levels, not ``-march=native``: an x86-64 build comes in the psABI levels v4 (AVX-512), v3
(AVX2, FMA) and v2 (SSE4.2), and a process loads the highest its CPU runs (:func:`level`), so one
installed package serves every machine of a cluster. ``-ffp-contract=off`` keeps the compiler
from fusing a multiply and an add where an ISA has FMA: the kernels' explicit 32-byte vectors
fix the order of every sum, so each level computes the same bits, and a distance does not change
in its last place between an AVX2 and an AVX-512 machine.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# one library from these: the engine's kernels, and align's refinement
SOURCES = tuple(Path(__file__).with_name(name) for name in ("native.c", "align.c", "certify.c"))
# what every source includes: the declarations of the library's functions and its ABI version
HEADER = Path(__file__).with_name("dm_abi.h")
# the type templates the sources include once per type (CPython stringlib's way: plain C, which a
# debugger and git blame see line by line, where a macro would be one line)
TEMPLATES = tuple(Path(__file__).with_name(name) for name in ("dm_template.h", "native_t.h", "align_t.h"))
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off", "-std=gnu11")
# x86-64 psABI levels, highest first, with the /proc/cpuinfo flags each needs
X86_LEVELS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "x86-64-v3": ("avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"),
    "x86-64-v2": ("sse4_2", "popcnt", "ssse3", "sse4_1", "cx16"),
}
# what torch's own dispatch calls each level, where /proc/cpuinfo cannot be read
_TORCH_NAMES = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}


def levels() -> tuple[str, ...]:
    """The levels this machine's architecture is built in: three on x86-64, one elsewhere."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return (*X86_LEVELS, "x86-64")
    return ("generic",)


def level(cpu_flags: set[str] | None = None, torch_capability: str | None = None) -> str:
    """The highest level this CPU runs, from its flags (default: /proc/cpuinfo's), else from
    torch's CPU capability ("AVX512", "AVX2", "DEFAULT")."""
    if levels() == ("generic",):
        return "generic"
    if cpu_flags is None:
        cpu_flags = _cpu_flags()
    if cpu_flags:
        return next((name for name, needs in X86_LEVELS.items() if set(needs) <= cpu_flags), "x86-64")
    return _TORCH_NAMES.get(torch_capability or "", "x86-64")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def flags(name: str, *, here: bool = False) -> tuple[str, ...]:
    """The compiler flags of one level; ``here``: scheduled for this machine's CPU too
    (``-mtune=native``: l1 tiles at C=32 20-30% faster on an AVX-512 Xeon than with the
    generic tuning of x86-64-v4, benchmarks/studies/bench_build_flags.py), for a build that runs where
    it is compiled. Tuning picks and orders instructions, never the arithmetic: the bits stay
    the same."""
    tuned = FLAGS if name == "generic" else (*FLAGS, f"-march={name}")
    return (*tuned, "-mtune=native") if here else tuned


def library_name(name: str) -> str:
    """The file name a level's library is shipped under, beside native.py."""
    return f"_native-{name}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"


def compiler() -> str | None:
    """The C compiler: ``$CC`` where it is set (and none where it names nothing that runs:
    ``CC=/nonexistent`` means no compiler, not the next one found), else cc, gcc or clang on
    the PATH."""
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compile_library(cc: str, name: str, path: Path, *, here: bool = False) -> None:
    """Compile the level ``name`` to ``path``, atomically: compiled beside it and renamed, its
    SHA-256 written to ``path.with_suffix('.sha256')`` first, so that a process racing this one,
    or one that dies half-way, never leaves a library that passes as whole. Raises a
    RuntimeError with the compiler's message when it fails."""
    import hashlib

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        command = [cc, *flags(name, here=here), "-o", tmp, *map(str, SOURCES)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            names = ", ".join(s.name for s in SOURCES)
            raise RuntimeError(f"{cc} failed on {names} ({name}): {done.stderr.strip()[-2000:]}")
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as fh:
            fh.write(digest)
        os.replace(fh.name, path.with_suffix(".sha256"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_all(out_dir: Path) -> list[Path]:
    """Every level's library into ``out_dir`` (the package build), the levels compiled side by
    side, one per core. A level the compiler cannot target is left out with a message on
    stderr; the run-time fallback covers it."""
    from concurrent.futures import ThreadPoolExecutor

    cc = compiler()
    if cc is None:
        print("densematch: no C compiler: the C kernels will be built at first use, if one appears", file=sys.stderr)
        return []

    def one(name: str) -> Path | None:
        path = Path(out_dir) / library_name(name)
        try:
            compile_library(cc, name, path)
        except RuntimeError as err:
            print(f"densematch: {err}", file=sys.stderr)
            return None
        return path

    with ThreadPoolExecutor(max_workers=max(1, min(len(levels()), os.cpu_count() or 1))) as pool:
        return [path for path in pool.map(one, levels()) if path is not None]


if __name__ == "__main__":  # python build.py OUT_DIR
    for p in build_all(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)):
        print(p)
