"""One summary of a match's verdicts, which every output reads: the command's line, its JSON,
the picture and the page. It counts A's pixels by their best candidate, and gives each invalid
one its reasons in one vocabulary."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["REASONS", "match_summary", "summary_line"]

# why a pixel's best candidate is not valid, as the picture's caption explains each; a pixel
# failing both filters counts under both
REASONS = {
    "masked": "masked out in A",
    "no candidate": "no pixel of B they may match",
    "mutual": "the mutual check: not each other's best (parts of A that B does not show, or where the two "
    "directions round differently)",
    "ratio": "the ratio test: a runner-up, usually the best match's neighbour, scores almost as well (smooth "
    "or regular texture)",
    "mutual or ratio": "the mutual check or the ratio test",
}


def match_summary(
    arrays: dict[str, np.ndarray],
    *,
    mutual: bool,
    ratio: float | None,
    mask_a: np.ndarray | None = None,
    reverse: np.ndarray | None = None,
    ratio_value: np.ndarray | None = None,
) -> dict[str, Any]:
    """The verdicts of a match with a 2-D grid, counted over A's pixels by their best candidate.

    Parameters
    ----------
    arrays : dict
        :meth:`densematch.Matches.numpy`: "index" and "valid" of shape (h, w) or (h, w, k).
    mutual, ratio : the filters the match ran with.
    mask_a : bool ndarray of shape (h, w), optional
        A's mask (True: may match).
    reverse : ndarray of shape (hb, wb), optional
        B's best pixel in A (flat index): which pixels failed the mutual check, where both
        filters ran.
    ratio_value : ndarray of shape (h, w), optional
        Each pixel's best over second-best distance: which failed the ratio test, the same.

    Returns
    -------
    dict
        ``counts`` (what is counted), ``pixels``, ``valid`` (pixels whose best candidate is
        valid) and ``valid_fraction``; ``invalid``: reason -> pixels (keys of
        :data:`REASONS`, only those that can apply); with k > 1, ``candidates_valid``: the
        fraction of all (pixel, candidate) slots valid.
    """
    index, valid = arrays["index"], arrays["valid"]
    many = index.ndim == 3
    best, ok = (index[..., 0], valid[..., 0]) if many else (index, valid)
    bad = ~ok
    masked = bad & ~mask_a if mask_a is not None else np.zeros_like(bad)
    nothing = bad & ~masked & (best < 0)
    failed = bad & ~masked & ~nothing
    invalid = {"masked": int(masked.sum()), "no candidate": int(nothing.sum())}
    if mutual and ratio is None:
        invalid["mutual"] = int(failed.sum())
    elif ratio is not None and not mutual:
        invalid["ratio"] = int(failed.sum())
    elif mutual and ratio is not None:
        if reverse is None or ratio_value is None:
            invalid["mutual or ratio"] = int(failed.sum())
        else:
            here = np.arange(best.size).reshape(best.shape)
            invalid["mutual"] = int((failed & (reverse.reshape(-1)[best.clip(0)] != here)).sum())
            invalid["ratio"] = int((failed & ~(ratio_value <= ratio)).sum())
    summary: dict[str, Any] = {
        "counts": "pixels of A, by their best candidate",
        "pixels": int(best.size),
        "valid": int(ok.sum()),
        "valid_fraction": float(ok.mean()) if best.size else 0.0,
        "invalid": invalid,
    }
    if many:
        summary["candidates_valid"] = float(valid.mean())
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    """``"72.0% of A's pixels valid (best candidate); invalid: 310 mutual, 12 masked"``, the
    reasons that count any pixel, most first."""
    text = f"{summary['valid_fraction']:.1%} of A's pixels valid (best candidate)"
    if "candidates_valid" in summary:
        text += f", {summary['candidates_valid']:.1%} of all candidates"
    reasons = sorted(((n, why) for why, n in summary["invalid"].items() if n), reverse=True)
    if reasons:
        text += "; invalid: " + ", ".join(f"{n} {why}" for n, why in reasons)
    return text
