"""Stretch-and-shift alignment: the public call (:mod:`.api`), the warp (:mod:`.warp`), the grid
search and its candidates (:mod:`.search`), the continuous refinement (:mod:`.refine`), and an
offline certificate of an answer (:mod:`.certify`)."""

from .api import OBJECTIVES, Alignment, align, shift_landscape
from .certify import Certificate, certify_alignment
from .warp import warp

__all__ = ["OBJECTIVES", "Alignment", "Certificate", "align", "certify_alignment", "shift_landscape", "warp"]
