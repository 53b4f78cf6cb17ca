"""Pixel-to-prototype distances: the whole (N, F, H, W) tensor (:func:`pairwise_distance`, its
module twin) and the nearest prototypes without it (:func:`nearest_prototype`)."""

from .prototypes import Nearest, PrototypeDistance, nearest_prototype, pairwise_distance

__all__ = ["Nearest", "PrototypeDistance", "nearest_prototype", "pairwise_distance"]
