"""densematch: exact, memory-bounded dense matching, alignment and prototype distances."""

from .budget import config_context, get_config, parse_memory
from .match import DenseMatcher, Matches, match

__version__ = "0.1.0"

__all__ = [
    "DenseMatcher",
    "Matches",
    "__version__",
    "config_context",
    "get_config",
    "match",
    "parse_memory",
]
