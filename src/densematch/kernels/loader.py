"""densematch's C kernels for the CPU, called through ctypes: the loader. The bindings, one
module per C source, call through :func:`_loaded`: :mod:`.c_engine` (native.c's l1 /
linf distances and their gradients, the elementwise passes around l2's product, the engine's tile
merge with its candidate listing (float32 scores, and the certified bfloat16 step with its
bounds), and the values of chosen row pairs.

torch.cdist's CPU kernel for p=1 and p=inf reduces over the features one pair at a time; the
kernels of ``native.c`` keep a block of pairs in registers and vectorise across pixels instead
(4x faster on one thread here, with the same sums in the same order). ctypes lets go of the GIL
for the call, so :func:`densematch.threads.share_out`'s workers run tiles side by side.

The package ships one library per instruction-set level, built with it
(:mod:`densematch.kernels.build`, run by setup.py), and a process loads the highest its CPU runs.
Where none was shipped (an editable install, a source tree), the same level's library is built
with the system's C compiler (``$CC``, else ``cc``) the first time it is wanted, about a second,
and kept in ``$DENSEMATCH_CACHE`` (default ``~/.cache/densematch``); ``make`` builds it while
setting up (:func:`build`). A library whose SHA-256 (written beside
it by the build) no longer matches is never loaded. Without either (a RuntimeWarning says so
once), with ``DENSEMATCH_NATIVE=0``, or under ``config_context(kernel="torch")``, callers
fall back to torch's kernels: :func:`usable` says which applies, :func:`status` why.

``dm_abi.h`` declares every function the library exports, one line each, and every source
includes it: :func:`signatures` reads the ctypes types from those lines, and a library whose
``dm_abi_version()`` differs from :data:`ABI_VERSION` is refused. A new kernel is its C body, its
line in the header and its wrapper here, whose tensors pass :func:`_loaded`'s boundary.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from ..threads import traced
from . import build as kernel_build

__all__ = [
    "ABI_VERSION",
    "HEADER",
    "SOURCES",
    "build",
    "cache_dir",
    "library",
    "shipped",
    "signatures",
    "status",
    "usable",
]

SOURCES = kernel_build.SOURCES
HEADER = kernel_build.HEADER
# the dm_abi.h these bindings were written against (DM_ABI_VERSION); a library built from other
# declarations is refused
ABI_VERSION = 9
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_status: dict[str, str] = {}  # why the library could not be loaded, once it was tried


def _switched_off() -> bool:
    """Whether DENSEMATCH_NATIVE=0 (or empty) keeps the C kernels out."""
    return os.environ.get("DENSEMATCH_NATIVE", "1") in ("0", "")


def cache_dir() -> Path:
    """Where libraries built at run time are kept: ``$DENSEMATCH_CACHE``, else
    ``$XDG_CACHE_HOME/densematch``, else ``~/.cache/densematch``."""
    if os.environ.get("DENSEMATCH_CACHE"):
        return Path(os.environ["DENSEMATCH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "densematch"


def _level() -> str:
    """The instruction-set level this process loads: ``$DENSEMATCH_NATIVE_LEVEL`` where set (one
    of :func:`densematch.kernels.build.levels`; the tests force each), else the highest this CPU
    runs (:func:`densematch.kernels.build.level`)."""
    forced = os.environ.get("DENSEMATCH_NATIVE_LEVEL")
    if not forced:
        return kernel_build.level(torch_capability=torch.backends.cpu.get_cpu_capability())
    if forced not in kernel_build.levels():
        raise RuntimeError(f"DENSEMATCH_NATIVE_LEVEL must be one of {', '.join(kernel_build.levels())}, got {forced!r}")
    return forced


def _intact(path: Path) -> bool:
    """Whether the library at ``path`` is whole: its SHA-256 equals the one the build wrote
    beside it. A library cut short (a full disk, an interrupted copy) would otherwise be mapped
    by ctypes and kill the process with SIGBUS at its first call."""
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return path.with_suffix(".sha256").read_text().strip() == digest
    except OSError:
        return False


def shipped() -> Path | None:
    """The library the package was installed with for this CPU's level, where it is whole."""
    path = Path(__file__).with_name(kernel_build.library_name(_level()))
    return path if path.exists() and _intact(path) else None


def _cached_path(compiler: str) -> Path:
    """Where this machine's run-time build goes: named by the source, the level's flags and the
    compiler, so that a shared home directory hands each CPU level its own build."""
    stat = Path(compiler).resolve().stat()
    key = hashlib.sha256()
    parts = [s.read_bytes() for s in (*SOURCES, HEADER, *kernel_build.TEMPLATES)]
    for part in (*parts, " ".join(kernel_build.flags(_level(), here=True)).encode()):
        key.update(part)
    key.update(f"{compiler}:{stat.st_mtime_ns}:{platform.machine()}".encode())
    return cache_dir() / f"native-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The library's path: the one the package shipped for this CPU, else one compiled into
    :func:`cache_dir` (once per machine and source; again where it is not whole). Raises a
    RuntimeError saying why when there is neither a shipped library nor a compiler, or the
    compilation fails."""
    path = shipped()
    if path is not None:
        return path
    compiler = kernel_build.compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found and none shipped with the package (set CC, or install gcc or clang)")
    path = _cached_path(compiler)
    if not (path.exists() and _intact(path)):
        kernel_build.compile_library(compiler, _level(), path, here=True)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, built if needed; None where it cannot be (the reason is logged)."""
    if _switched_off():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        _status["reason"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        # once per process, where it costs speed: l1/linf distances and the CPU merge run ~4x slower
        warnings.warn(
            f"densematch's C kernels are unavailable ({_status['reason']}); torch's slower kernels run instead "
            "(set DENSEMATCH_NATIVE=0 to choose that without this warning)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    version = getattr(lib, "dm_abi_version", None)
    if version is not None:
        version.argtypes, version.restype = [], ctypes.c_int64
    found = None if version is None else int(version())
    if found != ABI_VERSION:
        _status["reason"] = f"its library declares ABI version {found}, this package's bindings {ABI_VERSION}"
        warnings.warn(
            f"densematch's C kernels are unavailable ({_status['reason']}: a build of other sources); torch's "
            "slower kernels run instead (delete it, or the cache at DENSEMATCH_CACHE, to rebuild)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for name, (args, result) in signatures().items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


# C types of dm_abi.h's declarations as ctypes gives them; any pointer is an address
_CTYPES: dict[str, Any] = {
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "void": None,
}
_DECLARATION = re.compile(r"^(\w+)\s+(dm_\w+)\((.*)\);$")


def _ctype(declared: str, where: str) -> Any:
    """The ctypes type of one C type in dm_abi.h (``declared``: a parameter or a result)."""
    if "*" in declared:
        return ctypes.c_void_p
    words = declared.replace("const ", "").split()
    if not words or words[0] not in _CTYPES:
        raise ValueError(f"dm_abi.h: {where}: no ctypes type for {declared!r}")
    return _CTYPES[words[0]]


@functools.cache
def signatures() -> dict[str, tuple[list[Any], Any]]:
    """Every function dm_abi.h declares (one declaration a line), as (argtypes, restype): the
    one list of the library's signatures, which the loader gives ctypes."""
    out: dict[str, tuple[list[Any], Any]] = {}
    for line in HEADER.read_text().splitlines():
        found = _DECLARATION.match(line.strip())
        if found is None:
            continue
        result, name, params = found.groups()
        args = [] if params.strip() == "void" else [_ctype(p, name) for p in params.split(",")]
        out[name] = (args, _ctype(result, name))
    return out


def status() -> dict[str, str]:
    """Whether the C kernels run in this process, and why not, with their library and flags
    (for ``densematch info``); builds them if they are wanted and not yet built."""
    if _switched_off():
        return {"kernels": "off (DENSEMATCH_NATIVE=0)"}
    if library() is None:
        return {"kernels": f"unavailable: {_status.get('reason', 'unknown')}"}
    where = shipped()
    return {
        "kernels": "in use",
        "library": str(where or _cached_path(kernel_build.compiler() or "cc")),
        "built": "with the package" if where is not None else "at first use, in the cache",
        "level": _level(),
        "flags": " ".join(kernel_build.flags(_level(), here=where is None)),
    }


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C kernels can run for tensors of ``dtype`` on ``device``: float32 or float64
    on a CPU, the library built, and the tensors real: not while :func:`densematch.threads.traced`
    (FakeTensorMode's tensors have no storage: a pointer to it crashed the process; and a ctypes
    call is not an operator torch.compile can record). Whether they may is the caller's setting
    (:attr:`densematch.precision.Precision.c_kernels`), never read here."""
    if device.type != "cpu" or dtype not in _SUFFIX or traced():
        return False
    return library() is not None


def _loaded(what: str, *operands: torch.Tensor | tuple[torch.Tensor, ...] | None) -> ctypes.CDLL:
    """The library, for a caller that :func:`usable` let through, once every tensor among
    ``operands`` (None skipped, tuples opened) is one a pointer can be taken of: a plain strided
    tensor with storage in this process's memory, on the CPU, outside any recorded or faked
    trace. A ValueError names the rule and the operand otherwise (fake, meta, CUDA, sparse and
    functorch-wrapped tensors had reached C and crashed the process); a RuntimeError says why
    where the library cannot load. Checks that stay under ``python -O``, unlike asserts."""
    if traced():
        raise ValueError(f"densematch's C kernels: native.{what} cannot run while a graph is traced or faked")
    for i, t in enumerate(_flat(operands)):
        if not _addressable(t):
            raise ValueError(
                f"densematch's C kernels: native.{what}'s tensor operand {i} must be a plain strided CPU tensor "
                f"with storage, got {type(t).__name__} on {t.device} ({t.layout}); call it with real tensors"
            )
    lib = library()
    if lib is None:
        raise RuntimeError(f"native.{what} needs densematch's C kernels: {status()['kernels']}")
    return lib


def _flat(operands: tuple[torch.Tensor | tuple[torch.Tensor, ...] | None, ...]) -> list[torch.Tensor]:
    return [t for o in operands if o is not None for t in (o if isinstance(o, tuple) else (o,))]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _addressable(t: torch.Tensor) -> bool:
    """Whether C may read ``t`` through its data pointer (see :func:`_loaded`)."""
    return (
        type(t) in _PLAIN
        and t.is_cpu
        and t.layout is torch.strided
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _require(condition: bool, rule: str) -> None:
    """The ctypes boundary's checks: a ValueError naming the rule, never a call with bad memory."""
    if not condition:
        raise ValueError(f"densematch's C kernels: {rule}")


def _unit_stride(t: torch.Tensor) -> bool:
    """Whether the rows of ``t`` (2-D) are unit-stride, as the kernels read them."""
    return t.stride(1) == 1 or t.shape[1] <= 1


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with unit stride along its rows, copied only if it has none."""
    return t if _unit_stride(t) else t.contiguous()
