"""Matching: every pixel's best pixels of another map (:func:`match`, the engine's search with
masks, filters and coordinates, and its options), their sub-pixel refinement, the soft
(differentiable) match, and k-NN over memory banks."""

from .dense import DenseMatcher, Matches, match
from .neighbours import KNNIndex, knn
from .options import MatchOptions
from .soft import SoftMatches, soft_match

__all__ = ["DenseMatcher", "KNNIndex", "MatchOptions", "Matches", "SoftMatches", "knn", "match", "soft_match"]
