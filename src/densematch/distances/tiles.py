"""The prototype distances' tiled work, below the public functions (it reads no setting): the
(N, F, H, W) distances and their gradients computed tile by tile into the output, tiles shared
out over worker threads, each tile through the metric's bank with the call's operations
(:func:`densematch.kernels.ops_for`, resolved here once per operator call from ``use_c``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from ..budget import chunk_rows
from ..checks import compute_dtype
from ..kernels import ops_for
from ..metrics import Metric, Minkowski
from ..threads import share_out, share_size, workers_for

__all__ = ["backward", "forward", "tile_plan"]

# Bytes of one tile of distances for the matrix metrics, written by the product and read again
# at once: within this machine's L2 + L3 share per core (4 MiB ran 0.65-0.77x torch.cdist's time
# at both benchmark sizes, 1 MiB 0.69-0.85x)
_CACHE_TILE = 4 << 20


@functools.cache
def _compiled_minkowski(metric: Minkowski, rows_last: bool) -> Any:
    """A torch.compile'd l1 / linf kernel. Inductor fuses the difference, absolute value and
    reduction into one loop nest vectorised across pixels, so the broadcast is never stored.
    Maps (N, D, HW) to (N, F, HW), or rows (N, HW, D) to (N, HW, F) when ``rows_last``."""

    def kernel(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if rows_last:
            return metric.reduce_abs((x[:, :, None, :] - p[None, None, :, :]).abs(), -1)
        return metric.reduce_abs((x[:, None, :, :] - p[None, :, :, None]).abs(), 2)

    return torch.compile(kernel, dynamic=True)


# Tile boundaries never depend on the thread count, so neither do the gradients' sums (the
# prototypes' gradient adds the tiles' parts in order): tiles are cut as for this many workers
# whatever the count (more cost 2-4x at 4x64x48x48 against 32 prototypes, benchmarks/suites/bench_compile.py)
_TILE_SHARES = 2
_MIN_TILE = 128


def tile_plan(shape: tuple[int, ...], f: int, item: int, matrix: bool, budget: int, minkowski: bool) -> tuple[int, int]:
    """Pixels per tile and how many tiles may be held at once, for maps of ``shape`` (N, D, H,
    W) against F prototypes. The l1 / linf backward holds torch's (pixels, F, D) buffer (pass
    ``minkowski=True`` for it); the rest hold a few (F, pixels) blocks and copies of the
    pixels' features. The tile size depends on the budget and the shape alone; the budget
    bounds how many workers hold a tile at once."""
    n, d, h, w = shape
    hw = h * w
    per_col = f * 4 * item + 4 * d * item + (f * d * item if minkowski else 0)
    # the prepared bank, its centred or unit copy, the bank's gradient, and per worker the part
    # of it a tile computed plus one waiting to be added in order
    fixed = 6 * f * d * item
    fit = chunk_rows(budget, per_col, f"one tile of F={f}, D={d}", fixed=fixed)
    # several tiles per worker, and for the matrix metrics tiles whose passes stay in the cache
    cap = min(hw, max(_MIN_TILE, share_size(n * hw, _TILE_SHARES)))
    if matrix:
        cap = min(cap, max(64, _CACHE_TILE // (f * item)))
    cols = min(fit, cap)
    return cols, max(1, (budget - fixed) // (per_col * cols))


def forward(x: torch.Tensor, p: torch.Tensor, metric: Metric, budget: int, use_c: bool, compiled: bool) -> torch.Tensor:
    """The (N, F, H, W) distances, computed by tiles written into the output, laid out like x."""
    dtype = compute_dtype(x, p)
    ops = ops_for(use_c, x.device, dtype)
    n, d, h, w = x.shape
    f, hw = p.shape[0], h * w
    cols, held = tile_plan(tuple(x.shape), f, torch.finfo(dtype).bits // 8, metric.matrix, budget, False)
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    bank = metric.bank(p, dtype)
    x3 = x.flatten(2)  # (N, D, HW): a view for NCHW and channels_last alike
    minkowski = metric if isinstance(metric, Minkowski) and x.dtype == dtype else None
    if compiled and minkowski is not None:
        # the fused kernel holds nothing but its output: no tiling needed
        kernel = _compiled_minkowski(minkowski, channels_last)
        buf = kernel(x3.transpose(1, 2) if channels_last else x3, bank.rows)
    elif minkowski is not None and cols >= hw and not ops.c:
        # whole maps fit: one batched kernel call writes the output in x's layout directly
        rows = x3.transpose(1, 2).contiguous()  # (N, HW, D): a view already if channels_last
        bank_n = bank.rows.expand(n, f, d).contiguous()
        buf = torch.ops.aten._cdist_forward(
            *((rows, bank_n) if channels_last else (bank_n, rows)), minkowski.order, None
        )
    else:
        # the output is laid out like x: NCHW, or channels_last as a (N, HW, F) buffer
        buf = torch.empty((n, hw, f) if channels_last else (n, f, hw), dtype=x.dtype, device=x.device)
        out = buf.transpose(1, 2) if channels_last else buf
        # a metric that cannot write x's strides gets a contiguous tile of its own
        strided = metric.bank_writes_strided(ops)

        def tile(item: tuple[int, int]) -> None:
            i, s = item
            o = out[i, :, s : s + cols]
            direct = o.dtype == dtype and (strided or o.is_contiguous())
            t = o if direct else torch.empty(o.shape, dtype=dtype, device=x.device)
            metric.bank_distances(bank, x3[i, :, s : s + cols].to(dtype), t, ops=ops)
            if not direct:
                o.copy_(t)

        workers = min(workers_for(x.device), held)
        share_out(tiles_of(n, hw, cols), tile, workers, name="densematch-distance")
    return (buf.transpose(1, 2) if channels_last else buf).view(n, f, h, w)


def backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    p: torch.Tensor,
    result: torch.Tensor,
    metric: Metric,
    budget: int,
    use_c: bool,
    need_x: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gradients of x (None unless ``need_x``) and of the prototypes, by tiles recomputed
    from the output: in a fixed order, whatever the thread count."""
    dtype = compute_dtype(x, p)
    ops = ops_for(use_c, x.device, dtype)
    n, d, h, w = x.shape
    item = torch.finfo(dtype).bits // 8
    cols, held = tile_plan(tuple(x.shape), p.shape[0], item, metric.matrix, budget, not metric.matrix and not ops.c)
    x3, g3, d3 = x.flatten(2), grad.flatten(2), result.flatten(2)
    bank = metric.bank(p, dtype)
    gx = torch.empty((n, d, h * w), dtype=x.dtype, device=x.device) if need_x else None
    gp = torch.zeros(p.shape, dtype=dtype, device=p.device)
    tiles = tiles_of(n, h * w, cols)
    workers = min(workers_for(x.device), held)
    # the prototypes' gradient adds the tiles' parts in the order of the tiles, whichever
    # worker finishes first, so that it does not depend on the threads' timing; a worker
    # ahead of the oldest unfinished tile by more than the workers waits, so that at most
    # that many parts are held (tiles are taken in order: the oldest one's worker never waits)
    done: dict[int, torch.Tensor] = {}
    added = 0
    turn = threading.Condition()

    def tile(number: int) -> None:
        nonlocal added
        i, s = tiles[number]
        part = slice(s, s + cols)
        tx, tp = metric.bank_grads(
            bank, x3[i, :, part].to(dtype), g3[i, :, part].to(dtype), d3[i, :, part].to(dtype), ops=ops
        )
        if gx is not None:
            gx[i, :, part] = tx
        with turn:
            turn.wait_for(lambda: number - added <= workers)
            done[number] = tp
            while added in done:
                gp.add_(done.pop(added))
                added += 1
            turn.notify_all()

    share_out(range(len(tiles)), tile, workers, name="densematch-distance")
    grad_x = None if gx is None else gx.view(n, d, h, w)
    return grad_x, metric.bank_grad_finish(bank, gp).to(p.dtype)


def tiles_of(n: int, hw: int, cols: int) -> list[tuple[int, int]]:
    """(map, first pixel) of every tile of ``cols`` pixels."""
    return [(i, s) for i in range(n) for s in range(0, hw, cols)]
