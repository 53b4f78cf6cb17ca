"""How a feature file holds its map, (H, W, C) or (C, H, W), decided once for every command:
named (``--layout hwc`` or ``chw``), or ``auto``, which takes the one reading under which the
files agree with each other (one channel count, masks the size of the grid, the prototypes'
depth) and refuses, naming both readings, where both or neither fit. Without ``--layout`` the
command reads as ``auto`` does, except that where both readings fit it takes (H, W, C) and warns,
naming the other. No reading is ever picked by how plausible a shape looks: (64, 100, 120) is a
64x100 map of 120 channels as readily as a 100x120 map of 64."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

__all__ = ["FILE_LAYOUTS", "reading", "resolve_layout"]

FILE_LAYOUTS = ("auto", "hwc", "chw")


def reading(shape: Sequence[int], layout: str) -> tuple[tuple[int, int], int]:
    """The grid (H, W) and channel count of a 3-D ``shape`` read in ``layout``."""
    if layout == "hwc":
        return (shape[0], shape[1]), shape[2]
    return (shape[1], shape[2]), shape[0]


def _told(name: str, shape: tuple[int, ...]) -> str:
    (h, w), c = reading(shape, "hwc")
    (hc, wc), cc = reading(shape, "chw")
    return (
        f"{name} of shape {tuple(shape)} reads as (H, W, C), a {h}x{w} map of {c} channels, "
        f"or as (C, H, W), a {hc}x{wc} map of {cc}"
    )


def resolve_layout(
    layout: str | None,
    maps: Sequence[tuple[str, Sequence[int]]],
    *,
    grids: Sequence[tuple[str, Sequence[int], int]] = (),
    channels: int | None = None,
) -> str:
    """``"hwc"`` or ``"chw"`` for the 3-D feature maps ``maps`` ((name, shape) pairs).

    Parameters
    ----------
    layout : {"auto", "hwc", "chw"} or None
        A named layout is returned as it is; "auto" looks for the one reading that fits; None
        (no ``--layout``) as "auto", but where both fit, "hwc" with a UserWarning naming both.
    maps : sequence of (str, shape)
        The files' names (for the message) and their 3-D shapes; under a reading they must
        share one channel count.
    grids : sequence of (str, shape, int)
        Other inputs whose 2-D shape must equal the grid of ``maps[i]`` (a mask of A, say).
    channels : int, optional
        The channel count every map must have under the reading (the prototypes' depth).

    Raises
    ------
    ValueError
        For "auto", where both readings fit (one line naming both and the option that
        chooses) or neither does.
    """
    if layout not in (None, "auto"):
        return layout
    by_channels = []
    for candidate in ("hwc", "chw"):
        read = [reading(shape, candidate) for _, shape in maps]
        if len({c for _, c in read}) == 1 and (channels is None or read[0][1] == channels):
            by_channels.append(candidate)
    # masks settle a tie; where the channels already decide, a mask of the wrong size is the
    # caller's own error to report
    fits = by_channels
    if len(by_channels) == 2:
        fits = [c for c in by_channels if all(tuple(g) == reading(maps[i][1], c)[0] for _, g, i in grids)] or fits
    if len(fits) == 1:
        return fits[0]
    shapes: dict[tuple[int, ...], list[str]] = {}
    for name, shape in maps:
        shapes.setdefault(tuple(shape), []).append(name)
    told = "; ".join(_told(" and ".join(names), shape) for shape, names in shapes.items())
    if fits and layout is None:
        warnings.warn(f"read as (H, W, C), where both layouts fit: {told}; pass --layout hwc or chw", stacklevel=2)
        return "hwc"
    if fits:
        raise ValueError(f"--layout auto cannot tell how the files hold their maps: {told}; pass --layout hwc or chw")
    want = "one channel count" if channels is None else f"{channels} channels (as the other input)"
    raise ValueError(f"no layout gives {want}: {told}")
