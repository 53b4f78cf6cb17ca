"""Pages to inspect a result in a browser: one self-contained HTML file each (``densematch view``,
``--html`` on match, align, distance and batch).

Every picture is an inlined PNG and every array an inlined little-endian typed array in base64,
read by the page's own script (viewer/page.html): the page needs no network and no server, and
its Content-Security-Policy forbids both. Maps are drawn at their grid's resolution, magnified by
a whole factor; hovering reads the full arrays, so nothing is subsampled for the data.

The colour maps are those of the static pictures (:mod:`densematch.app.viz`): viridis for scores,
distances and the alignment's landscape, magma for differences, and :func:`prototype_colors` for
prototypes.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .io import save_with
from .summary import match_summary, summary_line
from .viz import alignment_difference

__all__ = [
    "align_page",
    "at_grid",
    "batch_page",
    "distance_page",
    "false_colour",
    "match_page",
    "prototype_colors",
    "write_page",
]

# colour-blind-safe categories (Okabe and Ito) while they last, then matplotlib's tab20
OKABE_ITO = ("#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#000000")


def prototype_colors(n: int) -> list[str]:
    """One colour per prototype, as '#rrggbb': Okabe-Ito's eight for up to eight, else tab20's."""
    if n <= len(OKABE_ITO):
        return list(OKABE_ITO[:n])
    from matplotlib import colormaps

    cmap = colormaps["tab20"].resampled(max(n, 2))
    return ["#{:02x}{:02x}{:02x}".format(*(int(255 * v) for v in cmap(i)[:3])) for i in range(n)]


def _array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    kind = {"int32": "<i4", "float32": "<f4", "uint8": "u1"}[dtype]
    data = np.ascontiguousarray(a, dtype=kind)
    return {"dtype": dtype, "shape": list(data.shape), "b64": base64.b64encode(data.tobytes()).decode("ascii")}


def _png(img: np.ndarray) -> str:
    """A data URI of ``img``: (H, W) grey or (H, W, 3 | 4) colour, floats in [0, 1] or uint8."""
    from PIL import Image

    a = np.asarray(img)
    if a.dtype != np.uint8:
        a = (np.clip(np.nan_to_num(a.astype(np.float64)), 0.0, 1.0) * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(a).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _colour(values: np.ndarray, cmap: str, lo: float, hi: float, shown: np.ndarray | None = None) -> np.ndarray:
    """(H, W, 4) uint8 of ``values`` through a matplotlib colour map; transparent where not
    ``shown`` (or not finite)."""
    from matplotlib import colormaps

    span = hi - lo if hi > lo else 1.0
    rgba = colormaps[cmap]((np.nan_to_num(values, nan=lo) - lo) / span, bytes=True)
    keep = np.isfinite(values) if shown is None else shown & np.isfinite(values)
    rgba[..., 3] = np.where(keep, 255, 0)
    return rgba


def _bar(cmap: str, lo: float, hi: float, label: str) -> dict[str, Any]:
    ramp = np.linspace(0.0, 1.0, 256)[None, :].repeat(8, 0)
    return {"png": _png(_colour(lo + ramp * (hi - lo), cmap, lo, hi)), "min": lo, "max": hi, "label": label}


def _range(v: np.ndarray) -> tuple[float, float]:
    finite = v[np.isfinite(v)]
    return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)


def false_colour(*maps: np.ndarray) -> list[np.ndarray]:
    """(H, W, 3) pictures of (H, W, C) feature maps, one projection for all: their three
    principal components over every map's pixels, each scaled to [0, 1] by the 1st and 99th
    percentiles, so that one colour means one feature in every picture."""
    flat = np.concatenate([m.reshape(-1, m.shape[-1]) for m in maps]).astype(np.float64)
    if flat.shape[1] in (1, 3):  # already a picture
        pictures = [m.astype(np.float64) for m in maps]
        lo, hi = np.percentile(flat, 1), np.percentile(flat, 99)
        return [np.clip((p - lo) / max(hi - lo, 1e-12), 0, 1) for p in pictures]
    mean = flat.mean(0)
    sample = flat[:: max(1, flat.shape[0] // 20000)] - mean
    _, _, vt = np.linalg.svd(sample, full_matrices=False)
    axes = vt[:3].T  # (C, <= 3)
    proj = (flat - mean) @ axes
    lo, hi = np.percentile(proj, 1, axis=0), np.percentile(proj, 99, axis=0)
    proj = np.clip((proj - lo) / np.maximum(hi - lo, 1e-12), 0.0, 1.0)
    if proj.shape[1] < 3:
        proj = np.concatenate([proj, np.zeros((proj.shape[0], 3 - proj.shape[1]))], 1)
    out, start = [], 0
    for m in maps:
        n = m.shape[0] * m.shape[1]
        out.append(proj[start : start + n].reshape(m.shape[0], m.shape[1], 3))
        start += n
    return out


def at_grid(img: np.ndarray, grid: tuple[int, ...]) -> np.ndarray:
    """``img`` at the grid's size (a feature grid may be smaller than its image)."""
    if img.shape[:2] == grid:
        return img
    from PIL import Image

    a = (np.clip(img, 0, 1) * 255).astype(np.uint8)
    return np.asarray(Image.fromarray(a).resize((grid[1], grid[0]), Image.Resampling.BILINEAR)) / 255.0


def _render(data: dict[str, Any]) -> str:
    template = resources.files("densematch.app").joinpath("viewer/page.html").read_text(encoding="utf-8")
    # no "<" reaches the script element: "</script" would end it early, and "<!--" with
    # "<script" would keep its end tag from ending it (the HTML parser's double-escaped state);
    # in JSON a "<" lies only inside strings, where \u003c reads back as the same character
    payload = json.dumps(data, allow_nan=False).replace("<", "\\u003c")
    return template.replace("/*DATA*/", payload).replace(
        "<title>densematch</title>", f"<title>{html.escape(data['title'])}</title>"
    )


def match_page(
    a_picture: np.ndarray,
    b_picture: np.ndarray,
    arrays: dict[str, np.ndarray],
    *,
    metric: str,
    mutual: bool = False,
    ratio: float | None = None,
    reverse: np.ndarray | None = None,
    ratio_value: np.ndarray | None = None,
    summary: dict[str, Any] | None = None,
    title: str = "densematch match",
) -> str:
    """The page of one match.

    Parameters
    ----------
    a_picture, b_picture : ndarray of shape (h, w[, 3]) and (hb, wb[, 3])
        What to draw for each map, in [0, 1], at its grid's size (see :func:`false_colour`).
    arrays : dict
        :meth:`densematch.Matches.numpy` of a match with a 2-D grid: "index" and "score" of shape
        (h, w) or (h, w, k), "valid", and "coords" (..., 2) in b's grid (refined positions float).
    mutual, ratio : the match's filters, for the page's explanation of each pixel's verdict
    reverse : ndarray of shape (hb, wb), optional
        b's best pixel in a (flat index), the reverse pass: shown from B's side, and mutual's why.
    ratio_value : ndarray of shape (h, w), optional
        Each pixel's best over second-best distance, what the ratio test compared.
    summary : dict, optional
        The match's :func:`.summary.match_summary`, whose figures the page states (made here
        from ``arrays`` and the verdicts when not given).
    """
    index, score, valid = arrays["index"], arrays["score"], arrays["valid"]
    if index.ndim == 2:
        index, score, valid = index[..., None], score[..., None], valid[..., None]
    coords = arrays["coords"]
    if coords.ndim == 3:
        coords = coords[..., None, :]
    h, w, k = index.shape
    hb, wb = b_picture.shape[:2]
    refined = bool(np.issubdtype(coords.dtype, np.floating))
    coords = np.where(index[..., None] >= 0, coords, np.nan).astype(np.float32)
    best, shown = index[..., 0], valid[..., 0] & (index[..., 0] >= 0)
    rows, cols = np.clip(best // wb, 0, hb - 1), np.clip(best % wb, 0, wb - 1)
    b_grey = b_picture if b_picture.ndim == 3 else np.repeat(b_picture[..., None], 3, -1)
    pull = np.where(shown[..., None], b_grey[rows, cols], 0.5)
    lo, hi = _range(score[..., 0][shown]) if shown.any() else (0.0, 1.0)
    veil = np.zeros((h, w, 4), np.uint8)
    veil[~shown] = (40, 40, 40, 170)
    if summary is None:
        summary = match_summary(arrays, mutual=mutual, ratio=ratio, reverse=reverse, ratio_value=ratio_value)
    notes = [
        {
            "text": f"{h}x{w} against {hb}x{wb}, {metric}, k={k}"
            + (", mutual" if mutual else "")
            + (f", ratio {ratio}" if ratio is not None else "")
            + f"; {summary_line(summary)}. "
            "Move over A (or focus it and use the arrow keys); click or Enter pins a pixel."
        }
    ]
    data = {
        "kind": "match",
        "title": title,
        "notes": notes,
        "a": {"png": _png(a_picture), "h": h, "w": w},
        "b": {"png": _png(b_picture), "h": hb, "w": wb},
        "k": k,
        "metric": metric,
        "mutual": mutual,
        "ratio": ratio,
        "refined": refined,
        "arrays": {
            "index": _array(index, "int32"),
            "score": _array(score, "float32"),
            "valid": _array(valid, "uint8"),
            # grid positions follow from the index; only refined ones travel
            **({"coords": _array(coords, "float32")} if refined else {}),
            **({"reverse": _array(reverse, "int32")} if reverse is not None else {}),
            **({"ratio_value": _array(ratio_value, "float32")} if ratio_value is not None else {}),
        },
        "layers": {
            "valid": _png(veil),
            "pullback": _png(pull),
            "score": _png(_colour(score[..., 0], "viridis", lo, hi, shown)),
            "score_bar": _bar("viridis", lo, hi, f"score ({metric})"),
        },
    }
    return _render(data)


def _landscape(
    values: np.ndarray, rows: list[Any], cols: list[Any], answer: list[float], label: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A landscape (n_rows, n_cols) for the page: its picture (viridis), its rows' and columns'
    axis values, its values and the answer's (row, column) position; and its colour bar."""
    lo, hi = _range(values)
    picture = {
        "png": _png(_colour(values, "viridis", lo, hi)),
        "h": values.shape[0],
        "w": values.shape[1],
        "rows": rows,
        "cols": cols,
        "values": _array(values, "float32"),
        "answer": answer,
    }
    return picture, _bar("viridis", lo, hi, label)


def align_page(
    template: np.ndarray,
    warped: np.ndarray,
    landscape: np.ndarray,
    scales_h: np.ndarray,
    scales_w: np.ndarray,
    answer: dict[str, Any],
    objective: str,
    title: str = "densematch align",
    *,
    shifts: np.ndarray | None = None,
    around: np.ndarray | None = None,
) -> str:
    """The page of one alignment: template (h, w), the image warped onto it (h, w), the search's
    landscape (n_h, n_w) over ``scales_h`` and ``scales_w``, and the answer
    (:meth:`densematch.Alignment.as_dict`). ``shifts`` (n_h, n_w, 2): each scale pair's best
    shift (:attr:`densematch.Alignment.landscape_shifts`), told on hover; ``around`` (n_y, n_x):
    the error at every integer shift at the answer's scales (:func:`densematch.shift_landscape`),
    drawn as a second landscape with ticks in shift."""
    lo, hi = min(float(template.min()), float(warped.min())), max(float(template.max()), float(warped.max()))
    span = hi - lo if hi > lo else 1.0
    diff, what, top = alignment_difference(template, warped, objective)
    error = "1 - NCC" if objective == "ncc" else "squared error"

    def where(value: float, scales: np.ndarray) -> float:
        return float(np.interp(value, scales, np.arange(len(scales)))) if len(scales) > 1 else 0.0

    at = [where(answer["scale_h"], scales_h), where(answer["scale_w"], scales_w)]
    grid, grid_bar = _landscape(landscape, [float(v) for v in scales_h], [float(v) for v in scales_w], at, error)
    if shifts is not None:
        grid["shifts"] = _array(shifts.reshape(-1), "float32")
    notes = []
    if answer.get("at_bound"):
        notes.append(
            {
                "warn": True,
                "text": f"at an end of the range searched: {', '.join(answer['at_bound'])}; "
                "the truth may lie beyond it (widen the scale range)",
            }
        )
    data = {
        "kind": "align",
        "title": title,
        "notes": notes,
        "objective": objective,
        "answer": {key: value for key, value in answer.items() if key != "at_bound"},
        "template": {"png": _png((template - lo) / span), "h": template.shape[0], "w": template.shape[1]},
        "warped": _png((warped - lo) / span),
        "difference": _png(_colour(diff, "magma", 0.0, top)),
        "difference_bar": _bar("magma", 0.0, top, what),
        "landscape": grid,
        "landscape_bar": grid_bar,
    }
    if around is not None:
        n_y, n_x = around.shape
        at = [float(answer["shift_y"]), float(answer["shift_x"])]
        data["shifts"], data["shifts_bar"] = _landscape(around, list(range(n_y)), list(range(n_x)), at, error)
    return _render(data)


# the most values (prototypes x pixels) of a page's heat maps of every prototype's distance:
# one byte each on the page, 4 MiB, more than a page should carry beyond the pictures
HEAT_VALUES = 1 << 22


def distance_page(
    picture: np.ndarray,
    index: np.ndarray,
    distance: np.ndarray,
    metric: str,
    n_prototypes: int,
    title: str = "densematch distance",
    every: np.ndarray | None = None,
) -> str:
    """The page of one map's nearest prototypes: its picture (H, W[, 3]), and ``index`` and
    ``distance`` of shape (k, H, W), the k nearest of ``n_prototypes``, nearest first.

    A heat map shows the distance to the nearest prototype, or, given ``every`` (the (F, H, W)
    distance to each prototype, at most :data:`HEAT_VALUES` values), to the prototype chosen on
    the page. One colour scale covers every choice (its bar beside the map); the heat maps
    travel as 256 levels of that scale, the nearest distances in float32."""
    if every is not None and (every.ndim != 3 or every.shape[1:] != index.shape[1:] or every.size > HEAT_VALUES):
        raise ValueError(
            f"every must be the (F, H, W) distances to each prototype, H, W = {index.shape[1:]}, with at most "
            f"{HEAT_VALUES} values; got shape {every.shape}: pass None for the nearest prototype's heat map alone"
        )
    colors = prototype_colors(n_prototypes)
    rgb = np.array([[int(c[i : i + 2], 16) for i in (1, 3, 5)] for c in colors], dtype=np.uint8)
    maps = distance[:1] if every is None else np.concatenate([distance[:1], every])
    lo, hi = _range(maps)
    levels = np.clip(np.nan_to_num((maps - lo) / (hi - lo if hi > lo else 1.0) * 255, nan=0.0), 0, 255)
    from matplotlib import colormaps

    notes = [
        {
            "text": f"{picture.shape[0]}x{picture.shape[1]} pixels against {n_prototypes} prototypes "
            f"({metric}); move over a map for each pixel's {index.shape[0]} nearest."
        }
    ]
    if every is None and n_prototypes > 1:
        notes.append({"text": "heat map of the nearest prototype's distance only (every prototype's was not kept)"})
    data = {
        "kind": "distance",
        "title": title,
        "notes": notes,
        "metric": metric,
        "k": int(index.shape[0]),
        "image": {"png": _png(picture), "h": picture.shape[0], "w": picture.shape[1]},
        "nearest": _png(rgb[index[0]]),
        "colors": colors,
        "heat": {
            "every": every is not None,
            "lo": lo,
            "hi": hi,
            "lut": _array(colormaps["viridis"](np.arange(256), bytes=True)[:, :3], "uint8"),
            "bar": _bar("viridis", lo, hi, f"distance ({metric})"),
        },
        "arrays": {
            "index": _array(index, "int32"),
            "distance": _array(distance, "float32"),
            "heat": _array(levels.round(), "uint8"),
        },
    }
    return _render(data)


def batch_page(
    records: list[dict[str, Any]],
    out_dir: str | os.PathLike[str],
    page_dir: str | os.PathLike[str],
    title: str = "densematch batch",
) -> str:
    """The index of a batch run: one row per record of its results.jsonl, with its status, its
    figures, its picture (``<id>.png`` in ``out_dir``, shrunk) and a link to its page
    (``<id>.html``) where those were written; links relative to ``page_dir``, the index's folder."""
    folder = Path(out_dir)
    rows = []
    for r in records:
        result = r.get("result") or {}
        figures = ", ".join(
            f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
            for key, value in result.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        thumb = None
        if result.get("picture") and (folder / result["picture"]).exists():
            thumb = _thumbnail(folder / result["picture"])
        page = None
        if result.get("page") and (folder / result["page"]).exists():
            page = Path(os.path.relpath(folder / result["page"], page_dir)).as_posix()
        rows.append(
            {
                "id": r["id"],
                "ok": r.get("status") == "ok",
                "error": r.get("error", ""),
                "warning": r.get("warning", ""),
                "figures": figures,
                "thumb": thumb,
                "page": page,
            }
        )
    done = sum(row["ok"] for row in rows)
    warned = sum(bool(row["ok"] and row["warning"]) for row in rows)
    flagged = f" ({warned} with a warning)" if warned else ""
    notes = [{"text": f"{len(rows)} pairs: {done} done{flagged}, {len(rows) - done} failed."}]
    return _render({"kind": "batch", "title": title, "notes": notes, "rows": rows})


def _thumbnail(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as img:
        img.thumbnail((160, 64))
        return _png(np.asarray(img.convert("RGB")))


def write_page(path: str | os.PathLike[str], page: str) -> None:
    """Write a page atomically (never half a file)."""
    save_with(path, lambda fh: fh.write(page.encode("utf-8")))
