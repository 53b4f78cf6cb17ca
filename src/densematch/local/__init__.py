"""Local-window matching: the public calls and module twins (:mod:`.api`), the windows and how
they are read (:mod:`.windows`), the differentiable values band by band (:mod:`.volume`) and the
exact top-k (:mod:`.topk`)."""

from .api import LocalCostVolume, LocalMatcher, local_cost_volume, local_match
from .windows import SAMPLINGS

__all__ = ["SAMPLINGS", "LocalCostVolume", "LocalMatcher", "local_cost_volume", "local_match"]
