"""densematch: exact, memory-bounded dense matching, alignment and prototype distances."""

import importlib
from typing import Any

from ._distance import PrototypeDistance, nearest_prototype, pairwise_distance
from ._info import show_config
from ._knn import KNNIndex, knn
from ._match import DenseMatcher, Matches, match
from ._soft import SoftMatches, soft_match
from .alignment import Alignment, Certificate, align, certify_alignment, warp
from .budget import parse_memory
from .config import config_context, get_config
from .local import LocalCostVolume, LocalMatcher, local_cost_volume, local_match
from .options import MatchOptions

__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "Certificate",
    "DenseMatcher",
    "KNNIndex",
    "LocalCostVolume",
    "LocalMatcher",
    "MatchOptions",
    "Matches",
    "PrototypeDistance",
    "SoftMatches",
    "__version__",
    "align",
    "certify_alignment",
    "config_context",
    "get_config",
    "knn",
    "local_cost_volume",
    "local_match",
    "match",
    "nearest_prototype",
    "pairwise_distance",
    "parse_memory",
    "show_config",
    "soft_match",
    "warp",
]


# submodules with optional dependencies or their own start-up, imported when first used; the
# application layer's modules (densematch.app) stay reachable under their old names too
# (``densematch.batch.run``, ``from densematch import synthetic``)
_APP = ("batch", "cli", "demo", "features", "io", "synthetic", "tasks", "viz")
_LAZY = {"distributed": ".distributed", "kornia": ".kornia", **{name: f".app.{name}" for name in _APP}}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(_LAZY[name], __name__)
    raise AttributeError(f"module 'densematch' has no attribute {name!r}")
