"""Exact search sharded over processes: :func:`match` and :func:`nearest_prototype` on
torch.distributed (launched by torchrun; gloo on CPUs, NCCL on GPUs).

Each is a collective: every rank of the group calls it, and every rank gets the whole result,
equal to the one-process call on the whole input (ties to the lowest global index). Two ways to
shard:

- the queries (``shard="queries"``, ``"pixels"``): every rank holds all of both inputs and searches
  a contiguous share of the query rows; the shares' top-k lists are gathered;
- the references (``shard="references"``, ``"prototypes"``): every rank holds all of the queries
  and its own band of the references, searches it, and the per-band top-k lists are gathered and
  merged (by value, equal values to the lower global index). Each rank holds only its band.

What is sent: each rank's top-k lists, 12 bytes (a float32 value and an int64 index) per query
row and k, plus, for ``mutual``, 8 bytes per reference row. Ranks agree on success before any
result is exchanged: a bad input on one rank raises the same error on every rank, never a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from . import engine
from .checks import as_tensor, check_choice, options_by_keyword
from .distances import prototypes as _distance
from .engine.merge import order
from .matching import dense as _match
from .matching.options import MatchOptions
from .progress import progress_bar

__all__ = ["init_from_env", "match", "nearest_prototype"]

MATCH_SHARDS = ("queries", "references")
NEAREST_SHARDS = ("prototypes", "pixels")
T = TypeVar("T")
# errors raised again, by type, on every rank; any other exception becomes a RuntimeError there
_ERRORS: dict[str, type[Exception]] = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, MemoryError)}
_ERRORS["OutOfMemoryError"] = MemoryError


class _Group:
    """The process group of one collective call: rank, size, and the agreed exchanges."""

    def __init__(self, group: Any, timeout: float | None, stats: dict[str, float] | None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "densematch.distributed needs an initialised process group: launch with torchrun "
                "(torchrun --nproc-per-node 2 your_script.py) and call "
                "torch.distributed.init_process_group() or densematch.distributed.init_from_env() first; "
                "in one process, call densematch.match / nearest_prototype directly"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.gloo = dist.get_backend(group) == "gloo"
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.stats = stats
        if stats is not None:
            stats.update(bytes_sent=0, seconds_communicating=0.0, collectives=0)

    def _account(self, started: float, sent: int) -> None:
        if self.stats is not None:
            self.stats["bytes_sent"] += sent
            self.stats["seconds_communicating"] += time.perf_counter() - started
            self.stats["collectives"] += 1

    def agree(self, step: Callable[[], T]) -> T:
        """Run ``step`` here, then learn whether it succeeded on every rank: the first failure
        (by rank) is raised on all of them, with the rank named. A rank that does not answer
        within ``timeout`` seconds is named by gloo's monitored barrier."""
        result: T | None = None
        failure: Exception | None = None
        try:
            result = step()
        except Exception as err:  # any failure here is agreed on, so no rank waits for another
            failure = err
        reports = self.objects(None if failure is None else (type(failure).__name__, str(failure)), barrier=True)
        for rank, report in enumerate(reports):
            if report is not None:
                kind, message = report
                raise _ERRORS.get(kind, RuntimeError)(f"{message} (rank {rank} of {self.size})") from failure
        return cast(T, result)

    def objects(self, obj: Any, *, barrier: bool = False) -> list[Any]:
        """Every rank's ``obj`` (small Python values), in rank order; with ``barrier``, after
        gloo's monitored barrier when a timeout is set."""
        started = time.perf_counter()
        out: list[Any] = [None] * self.size
        with self._waiting():
            if barrier and self.gloo and self.timeout is not None:
                dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)
            dist.all_gather_object(out, obj, group=self.group)
        self._account(started, 0)
        return out

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Collectives that fail because another rank stopped answering (gloo's monitored
        barrier names it; a crashed peer is named by its address) say so."""
        try:
            yield
        except RuntimeError as err:
            raise RuntimeError(
                f"densematch.distributed: rank {self.rank} of {self.size} lost the other ranks: {err}"
            ) from err

    def same(self, what: dict[str, Any]) -> None:
        """Check that every rank called with the same ``what`` (settings, shapes, checksums of
        the inputs that must be replicated), before any exchange: the same ValueError on every
        rank, naming what differs and each rank's value, rather than a merge of different
        searches or a collective that aborts on one rank."""
        views = self.objects(what)
        differ = [key for key in what if any(v.get(key) != views[0].get(key) for v in views)]
        if differ:
            detail = "; ".join(
                f"{key}: " + ", ".join(f"rank {r} {v.get(key)!r}" for r, v in enumerate(views)) for key in differ
            )
            raise ValueError(
                f"every rank must pass the same {', '.join(differ)} ({detail}); "
                "pass the replicated inputs and the settings unchanged on every rank"
            )

    def gather(self, t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's ``t``, of ``sizes[r]`` rows on rank r (known to all), in rank order."""
        started = time.perf_counter()
        most = max(sizes)
        device = torch.device("cpu") if self.gloo else t.device
        padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=device)
        padded[: t.shape[0]] = t
        out = [torch.empty_like(padded) for _ in range(self.size)]
        with self._waiting():
            dist.all_gather(out, padded, group=self.group)
        self._account(started, padded.numel() * padded.element_size() * (self.size - 1))
        return [o[:n].to(t.device) for o, n in zip(out, sizes, strict=True)]

    def share(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """The contiguous share [start, stop) of n rows that ``rank`` (default: this one) searches."""
        r = self.rank if rank is None else rank
        return n * r // self.size, n * (r + 1) // self.size

    def share_sizes(self, n: int) -> list[int]:
        return [stop - start for start, stop in (self.share(n, r) for r in range(self.size))]


_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's constants


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _mixed(v: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bit patterns (wrapping products, logical shifts): a
    bijection of 64-bit words in which each input bit moves about half the output bits."""
    for shift, factor in ((30, _MIX[1]), (27, _MIX[2])):
        v = v ^ ((v >> shift) & ((1 << (64 - shift)) - 1))
        v = v * _signed(factor)
    return v ^ ((v >> 31) & ((1 << 33) - 1))


def checksum(t: torch.Tensor | None, step: int = 1 << 20) -> int | None:
    """An exact, order-free checksum of a tensor's bits: the sum, wrapping modulo 2^64, of each
    element's bit pattern and position mixed by splitmix64's finaliser. Integer additions, so no
    thread count or kernel changes it; and not linear in the bits, so changes to several
    elements cannot cancel by their structure, only by a 64-bit collision (scaling three of
    them by 2, 1/4 and 2 moves their exponents by +1, -2 and +1, which a plain sum of patterns,
    even one weighted by position, does not see). Reads ``step`` elements at a time."""
    if t is None:
        return None
    flat = t.detach().reshape(-1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step].contiguous().view(bits).to(torch.int64)
        if bits != torch.int64:  # the pattern's own bits only, not a sign extension of them
            part = part & ((1 << (8 * flat.element_size())) - 1)
        place = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        total = total + _mixed(_mixed(place * _signed(_MIX[0])) ^ part).sum()
    return int(total)


def _task_view(task: _match.Task, replicated: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    """What every rank of a sharded match must agree on (``replicated``: the inputs that are
    the same on every rank, checksummed). ``memory`` is per rank and the half dtype follows the
    rank's device: neither changes an exact result, so neither is compared."""
    view: dict[str, Any] = {
        "metric": task.metric.name,
        "k": task.k,
        "mutual": task.mutual,
        "ratio": task.ratio,
        "layout": task.layout,
        "precision": task.precision.name,
        "exclude_radius": task.exclude_radius,
        "refine, stride, offset": (task.options.refine, task.options.stride, task.options.offset),
        "a's grid": (task.nbatch, *task.grid_a),
        "b's grid": task.grid_b,
        "channels": task.ra.shape[-1],
        "dtype": str(task.ra.dtype),
    }
    view.update({f"{name} (checksum)": checksum(t) for name, t in replicated.items()})
    return view


def _nearest_view(task: _distance.NearestTask, replicated: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What every rank of a sharded nearest_prototype must agree on (see :func:`_task_view`)."""
    view: dict[str, Any] = {
        "metric": task.metric.name,
        "k": task.k,
        "precision": task.precision.name,
        "x's shape": tuple(task.x.shape),
        "prototype width": task.prototypes.shape[1],
        "dtype": str(task.x.dtype),
    }
    view.update({f"{name} (checksum)": checksum(t) for name, t in replicated.items()})
    return view


def _merge(
    values: list[torch.Tensor], indices: list[torch.Tensor], k: int, higher_is_better: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best k of per-band top-k lists (n, k_r) with global indices: by value, equal values
    to the lower index; empty slots (index -1) last, NaN in the value."""
    v, i = torch.cat(values, dim=1), torch.cat(indices, dim=1)
    v = torch.where(i >= 0, v, -torch.inf if higher_is_better else torch.inf)
    v, i = order(v, i, descending=higher_is_better)
    v, i = v[:, :k], i[:, :k]
    return torch.where(i >= 0, v, torch.nan), i


def _band_rows(b: Any, layout: str) -> tuple[int, int]:
    """(rows of the band, pixels per row) of a band of b: rows of the grid for hwc and chw (the
    width), rows of the list for flat (1)."""
    x = as_tensor(b, "b")
    if layout == "flat":
        return int(x.shape[-2]) if x.ndim >= 2 else 0, 1
    if x.ndim < 3:
        raise ValueError(f"b must have shape (H, W, C) or (C, H, W) or a batch of them, got {tuple(x.shape)}")
    return (int(x.shape[-3]), int(x.shape[-2])) if layout == "hwc" else (int(x.shape[-2]), int(x.shape[-1]))


def match(
    a: Any,
    b: Any,
    *,
    shard: str = "queries",
    group: Any = None,
    timeout: float | None = None,
    stats: dict[str, float] | None = None,
    mask_a: Any = None,
    mask_b: Any = None,
    **settings: Any,
) -> _match.Matches:
    """:func:`densematch.match` sharded over the ranks of a process group: a collective.

    Every rank of ``group`` calls it and every rank returns the full :class:`Matches`, equal to
    ``densematch.match(a, whole_b, ...)`` in one process: the same index, scores and valid mask,
    ties to the lowest global index of b, ``mutual`` and ``ratio`` included.

    Parameters
    ----------
    a, b : Tensor or ndarray
        As in :func:`densematch.match`. With ``shard="queries"`` every rank passes the same a
        and b. With ``shard="references"`` every rank passes the same a and its own band of b:
        a band of b's rows for layouts "hwc" and "chw" (rank 0 the top band, then in rank order;
        bands may differ in height, and one may be empty), a slice of rows for "flat".
    shard : {"queries", "references"}, default="queries"
        Split a's pixels (each rank searches a contiguous share against all of b), or b's
        (each rank searches all of a against its band, and the bands' top-k are merged).
    group : ProcessGroup, optional
        The ranks taking part; default the default process group.
    timeout : float, optional
        Seconds to wait for every rank at each agreement (gloo only: a rank that does not
        answer is named). Default: the group's own timeout.
    stats : dict, optional
        Filled with ``bytes_sent`` (by this rank), ``seconds_communicating`` and ``collectives``.
    mask_a, mask_b
        As in :func:`densematch.match`; ``mask_b`` is the rank's own band with
        ``shard="references"``.
    **settings
        :func:`densematch.match`'s other keywords (:class:`densematch.MatchOptions`): metric,
        k, mutual, ratio, layout, memory (per rank), progress (rank 0's share of the queries,
        ``shard="queries"`` only), precision, refine, stride, offset and exclude_radius. The
        placing is applied by every rank to the merged matches; ``refine`` reads b's features
        around each match, so it needs ``shard="queries"``, where every rank holds all of b.

    Returns
    -------
    Matches
        Indices and coords in the whole of b (the bands concatenated in rank order).

    Raises
    ------
    ValueError, TypeError
        Whatever :func:`densematch.match` raises, on every rank, when any rank's input is bad
        (the message names the rank); a ValueError for bands of unequal width.
    RuntimeError
        Without an initialised process group, or when a rank stops answering.
    """
    return run(a, b, settings, mask_a=mask_a, mask_b=mask_b, shard=shard, group=group, timeout=timeout, stats=stats)


def run(
    a: Any,
    b: Any,
    settings: MatchOptions | dict[str, Any],
    *,
    mask_a: Any = None,
    mask_b: Any = None,
    shard: str = "queries",
    group: Any = None,
    timeout: float | None = None,
    stats: dict[str, float] | None = None,
) -> _match.Matches:
    """:func:`match` with its settings as :class:`densematch.MatchOptions` (what the command
    runs under torchrun) or as keywords, checked on every rank and agreed on."""
    check_choice(shard, "shard", MATCH_SHARDS)
    g = _Group(group, timeout, stats)
    options = g.agree(lambda: settings if isinstance(settings, MatchOptions) else MatchOptions(**settings))
    if shard == "queries":
        task = g.agree(lambda: _match.validate(a, b, options, mask_a, mask_b))
        replicated = {"a": task.ra, "b": task.rb, "mask_a": task.masks[0], "mask_b": task.masks[1]}
        g.same(_task_view(task, replicated))
        total = task.pixels_searched(lambda n: g.share_sizes(n)[g.rank])
        with progress_bar(options.progress and g.rank == 0, total=total, unit="px", desc="match") as bar:
            found = _match.solve(task, *_by_queries(g, task, bar.update))
        return _match.placed(task, found)
    if options.refine is not None:
        raise ValueError(
            "refine reads b's features around each match, which no rank holds whole with shard='references'; "
            "use shard='queries'"
        )
    bands = g.objects(g.agree(lambda: _band_rows(b, options.layout)))
    widths = {w for rows, w in bands if rows > 0}
    if len(widths) > 1:
        raise ValueError(f"b's bands must have one width, got widths {sorted(widths)} by rank")
    width = widths.pop() if widths else 1
    offsets = [sum(rows for rows, _ in bands[:r]) * width for r in range(g.size)]
    height = sum(rows for rows, _ in bands)
    grid_b = (height * width,) if options.layout == "flat" else (height, width)
    task = g.agree(
        lambda: _match.validate(a, b, options, mask_a, mask_b, nb=height * width, grid_b=grid_b, empty_b=True)
    )
    g.same(_task_view(task, {"a": task.ra, "mask_a": task.masks[0]}))
    forward, backward = _by_references(g, task, offsets, [rows * width for rows, _ in bands])
    return _match.placed(task, _match.solve(task, forward, backward))


def _by_queries(g: _Group, task: _match.Task, on_tile: Callable[[int], None]) -> tuple[_match.Forward, _match.Backward]:
    """Each rank searches a contiguous share of the allowed rows of a (and, for mutual, of b)."""
    search = task.search(on_tile)

    def forward(i: int, rows_a: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        allowed = torch.arange(task.na, device=task.ra.device) if rows_a is None else rows_a
        start, stop = g.share(allowed.numel())
        step = functools.partial(
            search,
            task.ra[i],
            task.rb[i],
            k=k,
            rows_a=allowed[start:stop],
            rows_b=task.rows(1, i),
            reserved=task.reserved,
        )
        v, idx = g.agree(step)
        sizes = g.share_sizes(allowed.numel())
        return torch.cat(g.gather(v, sizes)), torch.cat(g.gather(idx, sizes))

    def backward(i: int, rows_a: torch.Tensor | None) -> torch.Tensor:
        rows_b = task.rows(1, i)
        allowed = torch.arange(task.nb, device=task.rb.device) if rows_b is None else rows_b
        start, stop = g.share(allowed.numel())
        reserved = task.reserved + 8 * task.nb
        step = functools.partial(
            search, task.rb[i], task.ra[i], k=1, rows_a=allowed[start:stop], rows_b=rows_a, reserved=reserved
        )
        _, back = g.agree(step)
        back = torch.cat(g.gather(back[:, 0], g.share_sizes(allowed.numel())))
        return _match.owners(back, rows_b, task.nb)

    return forward, backward


def _by_references(
    g: _Group, task: _match.Task, offsets: list[int], band_sizes: list[int]
) -> tuple[_match.Forward, _match.Backward]:
    """Each rank searches all of a against its band of b; the bands' top-k are merged."""
    search = task.search()
    offset = offsets[g.rank]

    def forward(i: int, rows_a: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = functools.partial(
            search, task.ra[i], task.rb[i], k=k, rows_a=rows_a, rows_b=task.rows(1, i), reserved=task.reserved
        )
        v, idx = g.agree(step)
        idx = torch.where(idx >= 0, idx + offset, -1)
        sizes = [v.shape[0]] * g.size
        return _merge(g.gather(v, sizes), g.gather(idx, sizes), k, task.metric.higher_is_better)

    def backward(i: int, rows_a: torch.Tensor | None) -> torch.Tensor:
        rows_b = task.rows(1, i)
        reserved = task.reserved + 8 * task.nb
        step = functools.partial(search, task.rb[i], task.ra[i], k=1, rows_a=rows_b, rows_b=rows_a, reserved=reserved)
        _, back = g.agree(step)
        mine = _match.owners(back[:, 0], rows_b, band_sizes[g.rank])
        return torch.cat(g.gather(mine, band_sizes))

    return forward, backward


@options_by_keyword(2)
def nearest_prototype(
    x: Any,
    prototypes: Any,
    *,
    metric: str = "l2",
    k: int = 1,
    shard: str = "prototypes",
    group: Any = None,
    timeout: float | None = None,
    stats: dict[str, float] | None = None,
    memory: int | str | None = None,
    check_finite: bool = True,
    precision: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`densematch.nearest_prototype` sharded over the ranks of a process group: a
    collective, every rank returning the whole result.

    Parameters
    ----------
    x : Tensor or ndarray of shape (N, D, H, W)
        The same on every rank.
    prototypes : Tensor or ndarray of shape (F_r, D)
        ``shard="prototypes"``: this rank's slice of the bank (a memory bank split over GPUs;
        a slice may be empty), the global index of its first row being the sum of the slices
        of the ranks before it. ``shard="pixels"``: the whole bank, the same on every rank.
    shard : {"prototypes", "pixels"}, default="prototypes"
        Split the bank, or split x's pixels (each rank searches a contiguous share).
    group, timeout, stats
        As in :func:`match`.
    metric, k, memory, check_finite, precision
        As in :func:`densematch.nearest_prototype`; k counts the whole bank.

    Returns
    -------
    distance, index : Tensor of shape (N, H, W), or (N, k, H, W) for k > 1
        As :func:`densematch.nearest_prototype` returns them, with global prototype indices. The
        distances carry no autograd graph (the gathered results cannot be differentiated).
    """
    check_choice(shard, "shard", NEAREST_SHARDS)
    g = _Group(group, timeout, stats)
    if shard == "pixels":
        task = g.agree(lambda: _distance.nearest_task(x, prototypes, metric, k, memory, check_finite, precision))
        x, p, m, prec, k, budget = task.x, task.prototypes, task.metric, task.precision, task.k, task.budget
        g.same(_nearest_view(task, {"x": x, "prototypes": p}))
        n, _d, h, w = x.shape
        start, stop = g.share(n * h * w)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []

        def local() -> tuple[torch.Tensor, torch.Tensor]:
            for item in range(n):  # the share's rows, item by item: views of x, never a copy of it
                lo, hi = max(start, item * h * w), min(stop, (item + 1) * h * w)
                if lo < hi:
                    rows = x[item].detach().flatten(1).T[lo - item * h * w : hi - item * h * w]
                    parts.append(engine.topk(rows, p.detach(), metric=m, k=k, budget=budget, precision=prec))
            if not parts:
                return torch.empty(0, k, dtype=prec.dtype), torch.empty(0, k, dtype=torch.int64)
            return torch.cat([v for v, _ in parts]), torch.cat([i for _, i in parts])

        with torch.autocast(device_type=x.device.type, enabled=False):
            v, idx = g.agree(local)
        sizes = g.share_sizes(n * h * w)
        value = torch.cat(g.gather(v.to(x.device), sizes)).view(n, h * w, k)
        index = torch.cat(g.gather(idx.to(x.device), sizes)).view(n, h * w, k)
        return _distance.nearest_result(m.distance(value), index, x.shape)

    sizes = g.objects(g.agree(lambda: int(as_tensor(prototypes, "prototypes").shape[0])))
    offset, total = sum(sizes[: g.rank]), sum(sizes)
    task = g.agree(
        lambda: _distance.nearest_task(x, prototypes, metric, k, memory, check_finite, precision, bank=total)
    )
    x, m, k = task.x, task.metric, task.k
    g.same(_nearest_view(task, {"x": x}))
    n, _d, h, w = x.shape

    def search() -> tuple[torch.Tensor, torch.Tensor]:
        value, index = _distance.nearest_values(task)
        return value, torch.where(index >= 0, index + offset, -1)

    value, index = g.agree(search)
    rows = [n * h * w] * g.size
    flat_v, flat_i = value.view(-1, k), index.view(-1, k)
    value, index = _merge(g.gather(flat_v, rows), g.gather(flat_i, rows), k, m.higher_is_better)
    return _distance.nearest_result(m.distance(value).view(n, h * w, k), index.view(n, h * w, k), x.shape)


def init_from_env(device: str = "cpu", timeout: float | None = None) -> bool:
    """Initialise the default process group from torchrun's environment (``WORLD_SIZE`` above
    1): gloo for ``device="cpu"``, NCCL with one GPU per local rank for ``"cuda"``. Returns
    whether a group of more than one process is (now) initialised; False when not launched by
    torchrun or launched with one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        kw: dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = datetime.timedelta(seconds=timeout)
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl", **kw)
        else:
            dist.init_process_group("gloo", **kw)
    return dist.get_world_size() > 1
