"""The tiled top-k engine: for every query row, the k best reference rows under a metric.

Queries are cut into tiles of ``tile_a`` rows and references into tiles of ``tile_b`` rows. One
(tile_a, tile_b) block of scores lives at a time, in a buffer reused for every block, and a
running top-k per query row is merged block by block, so memory is bounded by the plan and never
by Na * Nb. The merge is cheap: a block's row maxima (a fast vectorised reduction) say which rows
can improve at all, and only those rows pay for an argmax or a top-k. After the first few blocks
most rows cannot, so the block is read once more in cache rather than written and re-read from
main memory.

Everything here works on flat (N, C) rows. Layouts, batches, masks and filters live in
:mod:`densematch.match`; this package only ranks. Its modules:

- ``driver``: :func:`topk` chooses a strategy once, plans with its memory model, runs the tiles.
- ``plan``: :func:`plan.fit_tiles`, tile sizes within a budget for any memory model.
- ``strategy``: what every strategy shares (prepared rows, the scan, re-scoring, final values).
- ``plain``, ``half``, ``fused``: the strategies (compute dtype with near-ties settled;
  certified half precision; the fused Triton kernel), each with its memory model.
- ``merge``, ``pool``: running top-k merges, and the candidate pool.
- ``products``: IEEE products for the length of a search.
- ``op``: :func:`search`, the top-k as the ``densematch::topk`` operator.
"""

from .driver import plan_tiles, prepare, topk
from .op import search
from .plan import TilePlan
from .strategy import Prepared

__all__ = ["Prepared", "TilePlan", "plan_tiles", "prepare", "search", "topk"]
