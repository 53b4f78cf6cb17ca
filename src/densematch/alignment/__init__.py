"""Stretch-and-shift alignment: the public call (:mod:`.api`), the warp (:mod:`.warp`), the grid
search and its candidates (:mod:`.search`), and the continuous refinement (:mod:`.refine`)."""

from .api import OBJECTIVES, Alignment, align
from .warp import warp

__all__ = ["OBJECTIVES", "Alignment", "align", "warp"]
