"""Tile sizes that fit a budget, for any search strategy: the strategy says what it holds for
tiles of (ta, tb) (its ``working_set``), the planner only searches that function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..budget import chunk_rows

__all__ = ["MAX_TILES", "Dims", "TilePlan", "fit_tiles"]

# Tile caps (query rows, reference rows). On a CPU a block of about 2 MB won: with the C merge
# and two workers, 1024 x 512 ran 1.25-1.34x faster than 4096 x 512 at C=64, and level at C=384
# (benchmarks/suites/bench_match.py --sweep-tiles,
# benchmarks/history/2026-12-01-tile-shapes-again-and-int8-products-measured.md).
MAX_TILES = {"cpu": (1024, 512), "cuda": (8192, 16384)}


@dataclass(frozen=True)
class Dims:
    """The sizes one search's working set depends on.

    Attributes
    ----------
    na, nb : int
        Query and reference rows searched.
    c, cp : int
        Columns of a raw row, and of a prepared one (``c + metric.extra_columns``).
    k : int
        Best rows kept per query.
    item, in_item, half_item : int
        Bytes of one value in the compute dtype, in the inputs' dtype, and of a half-precision
        operand (0: none).
    cdist : bool
        Whether tiles are scored by ``torch.cdist`` (which makes its own copy of the block).
    cap : int
        Candidates kept per row by the strategy (0: none).
    """

    na: int
    nb: int
    c: int
    cp: int
    k: int
    item: int
    in_item: int
    half_item: int = 0
    cdist: bool = False
    cap: int = 0

    def ref_rows(self, tb: int, whole_b: bool) -> int:
        """Reference rows held prepared at once: all of them, or one tile."""
        return self.nb if whole_b else tb


@dataclass(frozen=True)
class TilePlan:
    """Tile sizes, and whether the prepared references are kept whole, with its byte count."""

    tile_a: int
    tile_b: int
    whole_b: bool
    bytes: int


WorkingSet = Callable[[Dims, int, int, bool], int]


def fit_tiles(
    d: Dims,
    budget: int,
    working_set: WorkingSet,
    *,
    caps: tuple[int, int],
    narrowest_b: int = 1,
    tiles: tuple[int | None, int | None] | None = None,
    reserved: int = 0,
    workers: int = 1,
) -> TilePlan:
    """Choose tile sizes whose whole working set, ``working_set(d, ta, tb, whole_b)`` bytes,
    fits in ``budget``; with ``workers`` threads, each holds its own tiles' working set, and the
    references prepared whole (what ``whole_b`` adds to a working set of no tiles) once for all.

    References are tiled first at ``caps[1]`` rows, query tiles take what is left (at most
    ``caps[0]``), and the reference tile halves, down to ``narrowest_b``, while query tiles would
    drop below 64 rows. References are prepared once, whole, when they take at most half the
    budget. ``tiles`` forces either size (tests use tiny tiles to force many merges).

    Raises
    ------
    ValueError
        When even tiles of one row do not fit, naming the minimum budget. ``reserved`` bytes
        of the budget are already taken by the caller and count towards that minimum.
    """
    if workers > 1:
        working_set = _held_by(workers, working_set)
    fixed_a, fixed_b = tiles if tiles is not None else (None, None)
    cap_a = min(fixed_a or caps[0], d.na)
    cap_b = min(fixed_b or caps[1], d.nb)
    minimum = working_set(d, 1, 1, False) + reserved
    chunk_rows(budget, minimum, "one tile", fix=f"raise memory (C={d.c}, k={d.k}, {d.na} query rows)")

    total, budget = budget, budget - reserved

    def fit(tb: int, whole_b: bool) -> int:
        spare = budget - working_set(d, 0, tb, whole_b)
        per_row = working_set(d, 1, tb, whole_b) - working_set(d, 0, tb, whole_b)
        return min(cap_a, spare // per_row) if spare > 0 else 0

    whole_b = working_set(d, 0, 0, True) <= budget // 2 and fit(cap_b, True) >= min(d.na, 64)
    tb = cap_b
    widest = (0, 0)  # the (ta, tb) of the largest tile tried
    while True:
        ta = fit(tb, whole_b)
        widest = max(widest, (ta, tb), key=lambda t: t[0] * t[1])
        if fixed_b or tb <= narrowest_b or ta >= min(cap_a, 64):
            break
        tb = max(1, tb // 2)
    if ta < min(cap_a, 64) and widest[0] >= 1:
        # narrower reference tiles never freed room for 64 query rows (what each query row holds
        # beside the tile took it: its pool, its re-scoring): the largest tile tried, not
        # a 30 x 1 one (86,400 tiles of a 1600 x 1600 search under 300 KiB)
        ta, tb = widest
    if ta < 1:  # raises: not even one query row fits beside this reference tile
        chunk_rows(total, working_set(d, 1, tb, whole_b) + reserved, f"one tile of tile_b={tb}")
    return TilePlan(int(ta), int(tb), whole_b, working_set(d, int(ta), tb, whole_b))


def _held_by(workers: int, working_set: WorkingSet) -> WorkingSet:
    """The bytes ``workers`` threads hold at once, each with the working set of its own tiles,
    the references prepared whole shared."""

    def held(d: Dims, ta: int, tb: int, whole_b: bool) -> int:
        shared = working_set(d, 0, 0, True) - working_set(d, 0, 0, False) if whole_b else 0
        return workers * working_set(d, ta, tb, whole_b) - (workers - 1) * shared

    return held


def device_caps(device: torch.device) -> tuple[int, int]:
    """The preferred tile caps of a device (:data:`MAX_TILES`)."""
    return MAX_TILES.get(device.type, MAX_TILES["cuda"])
