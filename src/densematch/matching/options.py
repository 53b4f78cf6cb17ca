"""The settings of a :func:`densematch.match` call, checked once where they enter.

:class:`MatchOptions` is what :func:`densematch.match`, :class:`densematch.DenseMatcher`, the
``densematch match`` and ``batch`` commands, :mod:`densematch.app.tasks` and
:func:`densematch.distributed.match` all build from their arguments: one list of settings, one
set of checks, one repr. What depends on the data (``k`` against b's pixels, 2-D grids for the
placing, masks) is checked when the options meet the features (``densematch.matching.dense.validate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ..budget import parse_memory
from ..checks import LAYOUTS, check_bool, check_choice, check_int, check_real
from ..choices import LayoutName, MetricName, PrecisionName, RefineName
from ..metrics import get_metric
from ..precision import PRECISIONS
from .subpixel import REFINES

__all__ = ["MatchOptions"]

# shown by repr whatever their value; the other settings only where they differ from the default
_ALWAYS_SHOWN = ("metric", "k", "layout", "precision")


@dataclass(frozen=True, kw_only=True)
class MatchOptions:
    """The settings of :func:`densematch.match`, validated and normalised at construction.

    Parameters
    ----------
    metric, k, mutual, ratio, layout, memory, progress, precision, refine, stride, offset, exclude_radius
        As in :func:`densematch.match`. ``stride`` and ``offset`` are stored as (row, col)
        pairs of floats; ``ratio`` and ``exclude_radius`` as floats.

    Raises
    ------
    ValueError, TypeError
        As :func:`densematch.match` does for the same setting.

    Examples
    --------
    >>> MatchOptions(metric="l2", k=3, stride=14)
    MatchOptions(metric='l2', k=3, layout='hwc', precision='exact', stride=(14.0, 14.0))
    """

    metric: MetricName = "cosine"
    k: int = 1
    mutual: bool = False
    ratio: float | None = None
    layout: LayoutName = "hwc"
    memory: int | str | None = None
    progress: bool = False
    precision: PrecisionName = "exact"
    refine: RefineName | None = None
    stride: float | tuple[float, float] | None = None
    offset: float | tuple[float, float] | None = None
    exclude_radius: float | None = None

    def __post_init__(self) -> None:
        m = get_metric(self.metric)
        ratio = None
        if self.ratio is not None:
            ratio = check_real(self.ratio, "ratio", 0.0, 1.0, low_open=True)
            if not m.has_ratio:
                raise ValueError(f"ratio is undefined for metric={m.name!r} (not a distance); use 'cosine'")
        layout = check_choice(self.layout, "layout", LAYOUTS)
        if self.memory is not None:
            parse_memory(self.memory)
        exclude = None
        if self.exclude_radius is not None:
            exclude = check_real(self.exclude_radius, "exclude_radius", 0.0, math.inf)
            if ratio is None:
                raise ValueError("exclude_radius applies to the ratio test: give ratio= as well")
            if layout == "flat":
                raise ValueError("exclude_radius needs 2-D grids (layout 'hwc' or 'chw'), got layout 'flat'")
        normal = {
            "metric": m.name,
            "k": check_int(self.k, "k", 1),
            "mutual": check_bool(self.mutual, "mutual"),
            "ratio": ratio,
            "layout": layout,
            "progress": check_bool(self.progress, "progress"),
            "precision": check_choice(self.precision, "precision", PRECISIONS),
            "refine": None if self.refine is None else check_choice(self.refine, "refine", REFINES),
            "stride": None if self.stride is None else _pair(self.stride, "stride", positive=True),
            "offset": None if self.offset is None else _pair(self.offset, "offset", positive=False),
            "exclude_radius": exclude,
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def places(self) -> bool:
        """Whether coords become float: refined, or mapped by a stride or an offset."""
        return self.refine is not None or self.stride is not None or self.offset is not None

    def settings(self) -> dict[str, Any]:
        """The settings as keywords of :func:`densematch.match`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def shown(self) -> str:
        """The settings a repr shows: metric, k, layout and precision, and every other one
        that differs from its default."""
        return ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name in _ALWAYS_SHOWN or getattr(self, f.name) != f.default
        )

    def __repr__(self) -> str:
        return f"MatchOptions({self.shown()})"


def _pair(value: Any, name: str, *, positive: bool) -> tuple[float, float]:
    """A number or a (row, col) pair (a one-item list counts as a number) as two floats."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise ValueError(f"{name} must be a number or a (row, col) pair, got {value!r}")
    out = tuple(check_real(v, name, -math.inf, math.inf) for v in values)
    if positive and min(out) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return out[0], out[1]
