"""densematch: exact, memory-bounded dense matching, alignment and prototype distances."""

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from ._info import show_config
from .alignment import Alignment, Certificate, align, certify_alignment, shift_landscape, warp
from .budget import parse_memory
from .config import config_context, get_config
from .distances.prototypes import Nearest, PrototypeDistance, nearest_prototype, pairwise_distance
from .local import LocalCostVolume, LocalMatcher, local_cost_volume, local_match
from .matching.dense import DenseMatcher, Matches, match
from .matching.neighbours import KNNIndex, knn
from .matching.options import MatchOptions
from .matching.soft import SoftMatches, soft_match

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
    "Nearest",
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
    "shift_landscape",
    "show_config",
    "soft_match",
    "warp",
]


# submodules with optional dependencies or their own start-up, imported when first used; the
# application layer's modules (densematch.app) stay reachable under their old names too
# (``densematch.batch.run``, ``from densematch import synthetic``)
_APP = ("batch", "cli", "demo", "features", "io", "synthetic", "tasks", "viz")
# and modules that moved into a package keep their public old path (``densematch.options``)
_MOVED = {**{name: f"app.{name}" for name in _APP}, "options": "matching.options"}
_LAZY = {"distributed": ".distributed", "kornia": ".kornia", **{name: f".{path}" for name, path in _MOVED.items()}}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(_LAZY[name], __name__)
    raise AttributeError(f"module 'densematch' has no attribute {name!r}")


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import densematch.batch`` and ``from densematch.options import ...`` give the module
    that moved (_MOVED) under its old name: the very module object, not a copy."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        assert module.__spec__ is not None
        module.__spec__ = module.__spec__.loader_state  # its own again: run already, by its own name


sys.meta_path.append(_OldPaths())
