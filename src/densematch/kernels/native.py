"""densematch's C kernels for the CPU, called through ctypes: l1 /
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
setting up (``python -m densematch.kernels.native``). A library whose SHA-256 (written beside
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
    "GROUP",
    "Candidates",
    "align_best_shifts",
    "align_cross",
    "align_refine",
    "build",
    "cache_dir",
    "certify_bound",
    "cosine_terms",
    "l2_finish",
    "l2_weights",
    "library",
    "local_flow_grad",
    "local_flow_values",
    "local_values",
    "merge",
    "merge_certified",
    "merge_pairs",
    "minkowski",
    "minkowski_grad",
    "pair_values",
    "planar",
    "shipped",
    "sqnorms",
    "status",
    "usable",
]

SOURCES = kernel_build.SOURCES
HEADER = kernel_build.HEADER
# the dm_abi.h these bindings were written against (DM_ABI_VERSION); a library built from other
# declarations is refused
ABI_VERSION = 2
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
# references per centre where the certified search centres its half rows by groups (DM_GROUP)
GROUP = 32
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
    parts = [s.read_bytes() for s in (*SOURCES, HEADER)]
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


def minkowski(y: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *, linf: bool, scale: float = 1.0) -> torch.Tensor:
    """``out[f, p] = scale * dist(y[f], x[:, p])``, l1 or linf (``linf``), on this thread.

    Shapes: y (F, D), x (D, P), out (F, P) of any strides; all of one dtype (see :func:`usable`).
    """
    lib = _loaded("minkowski", y, x, out)
    _require(y.dtype in _SUFFIX and y.dtype == x.dtype == out.dtype, "y, x and out: one float dtype")
    y, x = _unit_rows(y), _unit_rows(x)
    f, d = y.shape
    p = x.shape[1]
    if f * p == 0:
        return out
    code = getattr(lib, f"dm_minkowski_{_SUFFIX[y.dtype]}")(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), out.stride(1),
        f, d, p, int(linf), scale,
    )  # fmt: skip
    if code != 0:
        raise MemoryError(f"the l1/linf kernel could not allocate a block of {d} x 16 values")
    return out


def minkowski_grad(
    y: torch.Tensor, x: torch.Tensor, g: torch.Tensor, dist: torch.Tensor, *, linf: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``sum(g * dist)`` with respect to x (D, P) and y (F, D), where ``dist``
    (F, P) is :func:`minkowski`'s output; l1, or linf (the gradient goes to every feature
    where the difference reaches the distance, as torch.cdist's does). On this thread."""
    lib = _loaded("minkowski_grad", y, x, g, dist)
    _require(y.dtype in _SUFFIX and y.dtype == x.dtype == g.dtype == dist.dtype, "y, x, g and dist: one float dtype")
    y, x = _unit_rows(y), _unit_rows(x)
    g, dist = g.contiguous(), dist.contiguous()
    f, d = y.shape
    p = x.shape[1]
    gx = torch.empty((d, p), dtype=x.dtype)
    gy = torch.zeros((f, d), dtype=y.dtype)
    if f * p * d:
        getattr(lib, f"dm_minkowski_grad_{_SUFFIX[y.dtype]}")(
            y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), g.data_ptr(), dist.data_ptr(), p,
            gx.data_ptr(), p, gy.data_ptr(), d, f, d, p, int(linf),
        )  # fmt: skip
    else:
        gx.zero_()
    return gx, gy


def sqnorms(x: torch.Tensor) -> torch.Tensor:
    """The squared norms (P,) of the columns of x (D, P), summed over rows in order; one pass,
    no temporary. On this thread."""
    lib = _loaded("sqnorms", x)
    _require(x.dtype in _SUFFIX and x.dim() == 2, "x must be a 2-D float32 or float64 tensor")
    x = _unit_rows(x)
    d, p = x.shape
    out = torch.empty(p, dtype=x.dtype)
    getattr(lib, f"dm_sqnorms_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), out.data_ptr(), d, p)
    return out


def l2_finish(
    t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, out: torch.Tensor, *, root: bool
) -> torch.Tensor:
    """``out = max(rows[:, None] - 2 t + cols, 0)``, square-rooted if ``root``, in one pass;
    returns each column's smallest value before clamping. Shapes: t (F, P) with unit column
    stride, rows (F,), cols (P,), out (F, P) of any strides; all one dtype; on this thread."""
    lib = _loaded("l2_finish", t, rows, cols, out)
    _require(t.dtype == rows.dtype == cols.dtype == out.dtype, "t, rows, cols and out must share one dtype")
    t, rows, cols = _unit_rows(t), rows.contiguous(), cols.contiguous()
    f, p = t.shape
    colmin = torch.empty(p, dtype=t.dtype)
    getattr(lib, f"dm_l2_finish_{_SUFFIX[t.dtype]}")(
        t.data_ptr(), t.stride(0), rows.data_ptr(), cols.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        f, p, int(root), colmin.data_ptr(),
    )  # fmt: skip
    return colmin


def l2_weights(
    g: torch.Tensor, dist: torch.Tensor, w: torch.Tensor, *, root: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The l2 backward's pair weights into ``w`` (F, P, contiguous): ``g / dist`` and 0 where
    dist is 0 (``root``), or ``g``; returned with their sums over rows (P,) and over columns
    (F,). g and dist (F, P) may have any strides. On this thread."""
    lib = _loaded("l2_weights", g, dist, w)
    _require(g.dtype == dist.dtype == w.dtype and w.is_contiguous(), "g, dist and w must share one dtype, w contiguous")
    f, p = g.shape
    colsum = torch.empty(p, dtype=g.dtype)
    rowsum = torch.empty(f, dtype=g.dtype)
    getattr(lib, f"dm_l2_weights_{_SUFFIX[g.dtype]}")(
        g.data_ptr(), g.stride(0), g.stride(1), dist.data_ptr(), dist.stride(0), dist.stride(1),
        w.data_ptr(), colsum.data_ptr(), rowsum.data_ptr(), f, p, int(root),
    )  # fmt: skip
    return w, colsum, rowsum


class Candidates:
    """Per-row candidate slots for :func:`merge`'s certified listing: ``cols`` (m, cap) int64,
    ``vals`` (m, cap), ``counts`` (m,) int32, ``over`` (m,) bool (rows that had more than cap)."""

    def __init__(self, m: int, cap: int, dtype: torch.dtype) -> None:
        self.cap = cap
        self.cols = torch.empty((m, cap), dtype=torch.int64)
        self.vals = torch.empty((m, cap), dtype=dtype)
        self.counts = torch.zeros(m, dtype=torch.int32)
        self.over = torch.zeros(m, dtype=torch.bool)

    def take(self, rows: torch.Tensor) -> Candidates:
        """The slots of ``rows`` (int64) as a list of their own, for a search of those rows only."""
        part = Candidates(0, self.cap, self.vals.dtype)
        part.cols, part.vals = self.cols[rows], self.vals[rows]
        part.counts, part.over = self.counts[rows], self.over[rows]
        return part

    def put(self, rows: torch.Tensor, part: Candidates) -> None:
        """Write the list ``part``, taken for ``rows``, back into these slots."""
        self.cols[rows], self.vals[rows] = part.cols, part.vals
        self.counts[rows], self.over[rows] = part.counts, part.over

    def reaching(self, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the listed pairs scoring at least their row's ``floor``, rows that
        are over left out."""
        lib = _loaded("Candidates.reaching", floor, self.cols, self.vals, self.counts, self.over)
        m = self.counts.shape[0]
        _require(floor.shape == (m,) and floor.dtype == self.vals.dtype, "floor must be (rows,) in the lists' dtype")
        lists = (self.cols, self.vals, self.counts, self.over)
        _require(all(t.is_contiguous() for t in lists), "the lists must be contiguous")
        room = int(self.counts.sum())
        rows, cols = torch.empty(room, dtype=torch.int64), torch.empty(room, dtype=torch.int64)
        if room == 0:
            return rows, cols
        floor = floor.contiguous()
        found = getattr(lib, f"dm_list_reaching_{_SUFFIX[self.vals.dtype]}")(
            self.cols.data_ptr(), self.vals.data_ptr(), self.counts.data_ptr(), self.over.data_ptr(),
            m, self.cap, floor.data_ptr(), rows.data_ptr(), cols.data_ptr(),
        )  # fmt: skip
        return rows[:found], cols[:found]


def merge(
    s: torch.Tensor,
    offset: int,
    best_v: torch.Tensor,
    best_i: torch.Tensor,
    margin: torch.Tensor | None = None,
    listed: Candidates | None = None,
    *,
    bias: torch.Tensor | None = None,
) -> None:
    """Merge the score tile ``s`` (m, n; columns ``offset`` onwards; higher is better) into the
    running top-k ``best_v`` / ``best_i`` (m, k, contiguous; best first, -inf / -1 when empty),
    equal scores to the lower column. With ``margin`` (m,) and ``listed``, also list every pair
    reaching its row's k-th best minus the margin (see native.c). bfloat16 scores merge into a
    float32 top-k, without a margin, each column plus ``bias`` (n,) in float32 where given. On
    this thread."""
    lib = _loaded("merge", s, best_v, best_i, margin, bias)
    _require(best_v.is_contiguous() and best_i.is_contiguous(), "the running top-k must be contiguous")
    if s.dtype == torch.bfloat16:
        _require(best_v.dtype == torch.float32 and margin is None, "bfloat16 scores merge into float32, no margin")
        s = _unit_rows(s)
        if bias is not None:
            bias = bias.float().contiguous()
        if s.numel():
            lib.dm_merge_bf16(
                s.data_ptr(), s.stride(0), *s.shape, offset, best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
                None if bias is None else bias.data_ptr(),
            )  # fmt: skip
        return
    _require(bias is None, "only bfloat16 scores take a bias")
    _require(s.dtype == best_v.dtype, "the scores and the running top-k must share one dtype")
    s = _unit_rows(s)
    m, n = s.shape
    if m * n == 0:
        return
    null = None
    if margin is not None:
        _require(
            listed is not None and margin.dtype == s.dtype, "a margin needs a candidate list and the scores' dtype"
        )
        margin = margin.contiguous()
    getattr(lib, f"dm_merge_{_SUFFIX[s.dtype]}")(
        s.data_ptr(), s.stride(0), m, n, offset, best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
        null if margin is None else margin.data_ptr(),
        0 if listed is None else listed.cap,
        null if listed is None else listed.cols.data_ptr(),
        null if listed is None else listed.vals.data_ptr(),
        null if listed is None else listed.counts.data_ptr(),
        null if listed is None else listed.over.data_ptr(),
    )  # fmt: skip


def merge_pairs(
    rows: torch.Tensor, cols: torch.Tensor, score: torch.Tensor, best_v: torch.Tensor, best_i: torch.Tensor
) -> None:
    """Merge the scored pairs (``rows[t]``, ``cols[t]``, ``score[t]``; 1-D, rows and cols int64,
    in any order) into the running top-k ``best_v`` / ``best_i`` (m, k, contiguous; best first,
    -inf / -1 when empty) of their rows, equal scores to the lower column; a NaN score never
    enters. Rows must lie in [0, m). On this thread."""
    lib = _loaded("merge_pairs", rows, cols, score, best_v, best_i)
    _require(best_v.is_contiguous() and best_i.is_contiguous(), "the running top-k must be contiguous")
    _require(score.dtype == best_v.dtype and best_i.dtype == torch.int64, "score must be in the top-k's dtype")
    _require(rows.dtype == cols.dtype == torch.int64, "rows and cols must be int64")
    _require(rows.numel() == cols.numel() == score.numel(), "rows, cols and score must have one length each")
    if rows.numel() == 0:
        return
    _require(0 <= int(rows.min()) and int(rows.max()) < best_v.shape[0], "rows must index best_v's rows")
    rows, cols, score = rows.contiguous(), cols.contiguous(), score.contiguous()
    getattr(lib, f"dm_merge_pairs_{_SUFFIX[score.dtype]}")(
        rows.data_ptr(), cols.data_ptr(), score.data_ptr(), rows.numel(),
        best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
    )  # fmt: skip


def merge_certified(
    h: torch.Tensor,
    offset: int,
    best_v: torch.Tensor,
    best_i: torch.Tensor,
    qt: torch.Tensor,
    rt: torch.Tensor,
    bias: torch.Tensor | None,
    rounding: float,
    listed: Candidates,
    groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The certified search's step for the bfloat16 score tile ``h`` (m, n; columns ``offset``
    onwards): lower bounds merged into the running top-k ``best_v`` / ``best_i`` (m, k, float32,
    contiguous), upper bounds reaching each row's k-th lower bound listed in ``listed`` (see
    native.c). ``qt`` (m, 3) and ``rt`` (n, 3) are the bound terms of
    :func:`densematch.precision.query_terms` / ``ref_terms``; ``bias`` (n,) float32 or None.

    ``groups``: where the references' half rows were centred per group of :data:`GROUP`
    references, ``(products, query_terms, group_terms)``: each row's float32 product with the
    centres of the groups this tile touches (m, g; unit-stride rows, the first being group
    ``offset // GROUP``), and their bound's terms (m, 5) and (g, 3), from
    :func:`densematch.precision.group_terms` and ``group_norms``."""
    lib = _loaded("merge_certified", h, best_v, best_i, qt, rt, bias, groups)
    _require(h.dtype == torch.bfloat16 and best_v.dtype == torch.float32, "h must be bfloat16, best_v float32")
    _require(best_v.is_contiguous() and best_i.is_contiguous(), "the running top-k must be contiguous")
    h = _unit_rows(h)
    m, n = h.shape
    if m * n == 0:
        return
    qt, rt = qt.float().contiguous(), rt.float().T.contiguous()  # the references' terms as planes
    bias = torch.zeros(n) if bias is None else bias.float().contiguous()
    gp = gq = gt = None
    if groups is not None:
        gp, gq, gt = groups
        touched = (offset + n - 1) // GROUP - offset // GROUP + 1
        _require(
            gp.shape[0] == m and gp.shape[1] >= touched and gq.shape == (m, 5) and gt.shape[0] >= touched,
            "groups must be the products (rows, groups touched) and terms (rows, 5), (groups, 3)",
        )
        _require(gp.dtype == gq.dtype == gt.dtype == torch.float32, "groups must be float32")
        _require(gp.stride(1) == 1, "the groups' products need unit-stride rows")
        gq, gt = gq.contiguous(), gt.contiguous()
    lib.dm_merge_certified_bf16(
        h.data_ptr(), h.stride(0), m, n, offset, bias.data_ptr(),
        None if gp is None else gp.data_ptr(), 0 if gp is None else gp.stride(0),
        None if gq is None else gq.data_ptr(), None if gt is None else gt.data_ptr(),
        qt.data_ptr(), rt.data_ptr(), rounding, best_v.data_ptr(), best_i.data_ptr(), best_v.shape[1],
        listed.cap, listed.cols.data_ptr(), listed.vals.data_ptr(), listed.counts.data_ptr(), listed.over.data_ptr(),
    )  # fmt: skip


PAIR_KINDS = {"dot": 0, "sqdiff": 1, "absdiff": 2, "maxabs": 3, "cosine": 4}


def cosine_terms(x: torch.Tensor) -> torch.Tensor:
    """Each row's cosine terms (n, 3) for :func:`pair_values`, of x (n, C) float32 or float64 with
    unit-stride rows: the row's scale, two powers of two that bring its largest magnitude to
    [0.5, 1), and its norm after them; (0, 0, 0) for a zero row, (0, 0, NaN) for a row holding
    a NaN. On this thread."""
    lib = _loaded("cosine_terms", x)
    _require(x.dim() == 2 and _unit_stride(x), "x must be (n, C) with unit-stride rows")
    out = torch.empty((x.shape[0], 3), dtype=x.dtype)
    if x.shape[0]:
        getattr(lib, f"dm_cosine_terms_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.stride(0), *x.shape, out.data_ptr())
    return out


def pair_values(
    q: torch.Tensor,
    r: torch.Tensor,
    idx: torch.Tensor,
    kind: str,
    *,
    q_rows: torch.Tensor | None = None,
    r_terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values (m, k) of the row pairs (q[q_rows[i]], r[idx[i, j]]) (q[i] without ``q_rows``):
    "dot", "sqdiff" (sum of squared differences), "absdiff", "maxabs" or "cosine". q (mq, C)
    and r (n, C) of one dtype, any strides (rows that are not unit-stride are gathered first);
    idx (m, k) and q_rows (m,) int64. Each pair is reduced in one order, so equal rows give
    equal values. For "cosine", ``r_terms`` (:func:`cosine_terms` of r, unit-stride rows) spare
    each pair the reference's scale and norm: the same values to the bit, faster (a query row's
    are computed once for its consecutive pairs). On this thread."""
    lib = _loaded("pair_values", q, r, idx, q_rows, r_terms)
    _require(q.dtype == r.dtype and idx.dtype == torch.int64, "q and r must share one dtype, idx be int64")
    m, k = idx.shape
    out = torch.empty((m, k), dtype=q.dtype)
    if m * k == 0:
        return out
    if r_terms is not None:
        _require(kind == "cosine" and _unit_stride(r), "r_terms go with cosine of unit-stride references")
        _require(
            r_terms.shape == (r.shape[0], 3) and r_terms.dtype == r.dtype,
            "r_terms must be (rows of r, 3) in r's dtype",
        )
        r_terms = r_terms.contiguous()
    # rows that are not unit-stride are gathered: one copy beats a cache line per value
    if not _unit_stride(q):
        q, q_rows = q.index_select(0, q_rows) if q_rows is not None else q.contiguous(), None
    ridx: torch.Tensor | None = idx.contiguous()
    if not _unit_stride(r):
        r, ridx = r.index_select(0, idx.reshape(-1)), None
    if q_rows is not None:
        q_rows = q_rows.contiguous()
    getattr(lib, f"dm_pair_values_{_SUFFIX[q.dtype]}")(
        q.data_ptr(), q.stride(0), None if q_rows is None else q_rows.data_ptr(),
        r.data_ptr(), r.stride(0), None if ridx is None else ridx.data_ptr(),
        m, k, q.shape[1], PAIR_KINDS[kind], None if r_terms is None else r_terms.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def local_values(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    kind: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(m, y1 - y0, W) values of rows y0:y1 of a (H, W, C) against b (H, W, C) at the m offsets
    (m, 2) int64 (row, col), NaN where an offset leaves the grid: "dot", "sqdiff", "absdiff" or
    "maxabs", each pair as :func:`pair_values` reduces it; into ``out`` (contiguous) when given.
    a and b are both contiguous, or both views of channels-first storage (:func:`planar`), read
    in place: each row a window reaches turned channels last once, into a ring of rows, for the
    same values to the bit. On this thread."""
    lib = _loaded("local_values", a, b, offsets, out)
    flat = planar(a) and planar(b)
    oy, ox, out = _window_args(a, b, offsets, y0, y1, kind, out, flat)
    h, w, c = a.shape
    args = (a.data_ptr(), b.data_ptr(), h, w, c, oy.data_ptr(), ox.data_ptr(), len(offsets), y0, y1, PAIR_KINDS[kind])
    if not flat:
        getattr(lib, f"dm_local_values_{_SUFFIX[a.dtype]}")(*args, out.data_ptr())
    elif getattr(lib, f"dm_local_planar_{_SUFFIX[a.dtype]}")(*args, out.data_ptr()):
        rows = int(oy.max() - oy.min()) + 2
        raise MemoryError(f"native.local_values: no memory for a ring of {rows} rows of {w} x {c}")
    return out


def planar(x: torch.Tensor) -> bool:
    """Whether (H, W, C) ``x`` is a view of contiguous channels-first (C, H, W) storage, which
    :func:`local_values` reads in place (and a contiguous map is not, unless C is 1)."""
    return x.ndim == 3 and x.shape[2] > 1 and x.permute(2, 0, 1).is_contiguous()


def _window_args(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    kind: str,
    out: torch.Tensor | None,
    flat: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local kernels' checked arguments: the offsets' rows and columns (int64) and the
    output (m, y1 - y0, W), made where not given. ``flat``: a and b are channels-first views."""
    laid_out = flat or (a.is_contiguous() and b.is_contiguous())
    _require(
        a.dtype == b.dtype and a.shape == b.shape and a.ndim == 3 and laid_out,
        "a and b must be contiguous (H, W, C) maps of one dtype and shape (or both channels-first views)",
    )
    _require(kind in PAIR_KINDS and kind != "cosine", f"kind must be dot, sqdiff, absdiff or maxabs, got {kind!r}")
    _require(0 <= y0 <= y1 <= a.shape[0], f"rows {y0}:{y1} must lie in 0:{a.shape[0]}")
    shape = (len(offsets), y1 - y0, a.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=a.dtype)
    _require(out.shape == shape and out.dtype == a.dtype and out.is_contiguous(), f"out must be contiguous {shape}")
    oy, ox = (offsets[:, i].to(torch.int64).contiguous() for i in (0, 1))
    return oy, ox, out


def local_flow_values(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    kind: str,
    *,
    bilinear: bool,
    linear: bool,
    mask_b: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`local_values` of windows moved by ``flow`` (H, W, 2) (row, col), each pixel's
    window rigidly: at (floor(y + fy) + oy, floor(x + fx) + ox), whole numbers unless
    ``bilinear``: then b's four neighbours of each position are blended with the fractions of
    y + fy and x + fx (``linear``: the blend of their dot products, shared between the offsets
    where they are a whole grid of unit steps; else the pair of a and the blended feature).
    ``mask_b`` (H, W) bool: pixels of b that may be read. Returns the values (m, y1 - y0, W), NaN
    where a window's position needs a pixel outside b, and that validity (bool). On this thread."""
    lib = _loaded("local_flow_values", a, b, flow, offsets, mask_b, out)
    oy, ox, out = _window_args(a, b, offsets, y0, y1, kind, out)
    h, w, c = a.shape
    _require(flow.shape == (h, w, 2), f"flow must have shape {(h, w, 2)}")
    flow = flow.to(a.dtype).contiguous()
    mask = None if mask_b is None else mask_b.to(torch.uint8).contiguous()
    valid = torch.empty(out.shape, dtype=torch.uint8)
    code = getattr(lib, f"dm_local_flow_{_SUFFIX[a.dtype]}")(
        a.data_ptr(), b.data_ptr(), h, w, c, flow.data_ptr(), int(bilinear),
        None if mask is None else mask.data_ptr(), oy.data_ptr(), ox.data_ptr(), len(offsets),
        _grid_columns(oy, ox), y0, y1, PAIR_KINDS[kind], int(linear), out.data_ptr(), valid.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise MemoryError("the local window kernel could not allocate its scratch")
    return out, valid.bool()


def local_flow_grad(
    a: torch.Tensor,
    b: torch.Tensor,
    flow: torch.Tensor,
    offsets: torch.Tensor,
    y0: int,
    y1: int,
    grad: torch.Tensor,
    *,
    bilinear: bool,
    mask_b: torch.Tensor | None = None,
    ga: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    gf: torch.Tensor | None = None,
) -> None:
    """Accumulate into ``ga``, ``gb`` (H, W, C) and ``gf`` (H, W, 2) (contiguous, a's dtype;
    any may be None) the gradients of :func:`local_flow_values`' dot products (``linear``) from
    ``grad`` (m, y1 - y0, W), with b's corners read where the torch path reads them. On this
    thread."""
    lib = _loaded("local_flow_grad", a, b, flow, offsets, grad, mask_b, ga, gb, gf)
    oy, ox, grad = _window_args(a, b, offsets, y0, y1, "dot", grad.to(a.dtype).contiguous())
    h, w, c = a.shape
    _require(flow.shape == (h, w, 2), f"flow must have shape {(h, w, 2)}")
    for t, want in ((ga, a.shape), (gb, a.shape), (gf, (h, w, 2))):
        _require(t is None or (t.shape == want and t.dtype == a.dtype and t.is_contiguous()), "contiguous outputs")
    flow = flow.to(a.dtype).contiguous()
    mask = None if mask_b is None else mask_b.to(torch.uint8).contiguous()
    getattr(lib, f"dm_local_flow_grad_{_SUFFIX[a.dtype]}")(
        a.data_ptr(), b.data_ptr(), h, w, c, flow.data_ptr(), int(bilinear),
        None if mask is None else mask.data_ptr(), oy.data_ptr(), ox.data_ptr(), len(offsets), y0, y1,
        grad.data_ptr(), *(None if t is None else t.data_ptr() for t in (ga, gb, gf)),
    )  # fmt: skip


def _grid_columns(oy: torch.Tensor, ox: torch.Tensor) -> int:
    """The columns of the offsets where they are a whole row-major grid of unit steps (the
    moved window's dot products can then be shared), else 0."""
    if oy.numel() == 0:
        return 0
    rows = torch.arange(int(oy[0]), int(oy[-1]) + 1)
    cols = torch.arange(int(ox[0]), int(ox[-1]) + 1)
    if rows.numel() * cols.numel() != oy.numel():
        return 0
    grid = torch.cartesian_prod(rows, cols)
    return cols.numel() if torch.equal(grid[:, 0], oy) and torch.equal(grid[:, 1], ox) else 0


def align_refine(
    t: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    owner: torch.Tensor,
    params: torch.Tensor,
    ranges: tuple[float, float, float, float],
    iterations: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt for align's candidates (align.c), each from its start to its end.

    ``t`` (B, C, h, w), ``x`` (B, C, H, W) and ``weights`` (B, h, w), or (1, h, w) shared by the
    pairs, float64; candidate i fits
    template ``owner[i]`` into its image, starting at ``params[i]`` (M, 4), or (M, 6) with gain
    and bias; scales kept in ``ranges`` (lo_h, hi_h, lo_w, hi_w). Returns the parameters (M, P)
    and each one's weighted sums of squared and of absolute residuals (M, 2). On this thread."""
    lib = _loaded("align_refine", t, x, weights, owner, params)
    b, c, h, w = t.shape
    m, n_par = params.shape
    _require(
        all(v.dtype == torch.float64 and v.is_contiguous() for v in (t, x, weights, params))
        and x.shape[:2] == (b, c)
        and weights.shape in ((b, h, w), (1, h, w))
        and n_par in (4, 6),
        "t, x, weights and params must be contiguous float64 (B, C, h, w), (B, C, H, W), (B or 1, h, w), (M, 4 or 6)",
    )
    owner = owner.to(torch.int64).contiguous()
    _require(owner.shape == (m,) and bool(((owner >= 0) & (owner < b)).all()), "owner must hold M pair indices")
    p = params.clone()
    out = torch.empty(m, 2, dtype=torch.float64)
    box = torch.tensor(ranges, dtype=torch.float64)
    failed = lib.dm_align_refine(
        t.data_ptr(), x.data_ptr(), weights.data_ptr(), weights.shape[0] != b, c, h, w, x.shape[2], x.shape[3],
        owner.data_ptr(), m, n_par, box.data_ptr(), iterations, tolerance, p.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("densematch's C kernels: align_refine could not allocate its scratch")
    return p, out


def align_cross(
    along_y: torch.Tensor, t: torch.Tensor, taps: tuple[torch.Tensor, ...], n_shift: tuple[int, int]
) -> torch.Tensor:
    """align's cross term (align.c): (B, nh, nw, n_y, n_x) sums over the template's pixels and
    channels of T times the stretched image at every integer shift, from ``along_y`` = Ry X
    (B, C, nh, rows, W), the template ``t`` (B, C, h, w) and Rx's taps (i0, i1, w0, w1), each
    (nw, cols) (:func:`densematch.alignment.warp.bilinear_taps`). float32 or float64."""
    lib = _loaded("align_cross", along_y, t, taps)
    b, c, nh, rows, big_w = along_y.shape
    h, w = t.shape[-2:]
    i0, i1, w0, w1 = taps
    nw, cols = i0.shape
    ny, nx = n_shift
    _require(
        along_y.dtype in _SUFFIX
        and all(v.dtype == along_y.dtype and v.is_contiguous() for v in (along_y, t, w0, w1))
        and all(v.dtype == torch.int64 and v.is_contiguous() and v.shape == (nw, cols) for v in (i0, i1))
        and w0.shape == w1.shape == (nw, cols)
        and t.shape[:2] == (b, c)
        and ny + h - 1 <= rows
        and nx + w - 1 <= cols
        and bool((i0 >= 0).all() and (i1 >= 0).all() and (i0 < big_w).all() and (i1 < big_w).all()),
        "along_y (B, C, nh, rows, W), t (B, C, h, w) and taps (nw, cols) must be contiguous, of one float "
        "dtype, with every shift's window inside rows x cols and taps inside W",
    )
    out = torch.empty(b, nh, nw, ny, nx, dtype=along_y.dtype)
    sizes = (b, c, nh, rows, big_w, h, w, nw, cols, ny, nx)
    ptrs = (along_y.data_ptr(), t.data_ptr(), *(v.data_ptr() for v in taps))
    if getattr(lib, f"dm_align_cross_{_SUFFIX[along_y.dtype]}")(*ptrs, *sizes, out.data_ptr()):
        raise MemoryError("densematch's C kernels: align_cross could not allocate its scratch")
    return out


def align_best_shifts(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scale pair of align's grid ``score`` (..., n_y, n_x), float32 or float64: the ``k``
    lowest local minima over the shifts (no higher than any of their 8 neighbours), lowest first,
    ties to the lower flat index, and their flat indices, each (..., k); inf and 0 where fewer."""
    lib = _loaded("align_best_shifts", score)
    *lead, ny, nx = score.shape
    _require(score.dtype in _SUFFIX and score.is_contiguous() and k >= 1, "score must be contiguous float, k >= 1")
    best = torch.empty(*lead, k, dtype=score.dtype)
    where = torch.empty(*lead, k, dtype=torch.int64)
    rows = best.numel() // k
    getattr(lib, f"dm_align_best_shifts_{_SUFFIX[score.dtype]}")(
        score.data_ptr(), rows, ny, nx, k, best.data_ptr(), where.data_ptr()
    )
    return best, where


def certify_bound(
    image: torch.Tensor,
    template: torch.Tensor,
    cells: torch.Tensor,
    half: tuple[float, ...],
    rows: torch.Tensor,
    *,
    pivot: tuple[float, float],
    exact: bool,
    squared: bool,
    stop: float,
) -> torch.Tensor:
    """certify_alignment's bound (certify.c): per cell of ``cells`` (M, 4) (centres scale_h,
    scale_w, centre_y, centre_x: where the template pixel ``pivot`` (y, x) lands; half widths
    ``half``), the sum over the template's ``rows`` (in that order) and channels of each pixel's
    distance (squared: its square) from its value in ``template`` (C, h, w) to the range of
    ``image`` (C, H, W) over the box it samples from: whole pixels, or with ``exact`` the bilinear
    interpolant's own. A cell's sum stops at the first row after which it exceeds ``stop``. (M,)
    float64, on this thread."""
    lib = _loaded("certify_bound", image, template, cells, rows)
    c, h, w = template.shape
    _require(
        all(v.dtype == torch.float64 and v.is_contiguous() for v in (image, template, cells))
        and image.ndim == 3
        and image.shape[0] == c
        and cells.ndim == 2
        and cells.shape[1] == 4
        and rows.dtype == torch.int64
        and bool(((rows >= 0) & (rows < h)).all()),
        "image (C, H, W), template (C, h, w) and cells (M, 4) must be contiguous float64, rows template rows",
    )
    rows = rows.contiguous()
    spread, at = torch.tensor(half, dtype=torch.float64), torch.tensor(pivot, dtype=torch.float64)
    out = torch.empty(cells.shape[0], dtype=torch.float64)
    failed = lib.dm_certify_bound(
        image.data_ptr(), template.data_ptr(), c, h, w, image.shape[1], image.shape[2], cells.data_ptr(),
        cells.shape[0], spread.data_ptr(), at.data_ptr(), rows.data_ptr(), rows.numel(), exact, squared, stop,
        out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("densematch's C kernels: certify_bound could not allocate its scratch")
    return out


if __name__ == "__main__":
    print(build())
