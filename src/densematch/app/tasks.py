"""One pair of files in, one result out: the work of ``densematch align|match|distance``, shared
by the single-pair commands and the batch runner (:mod:`densematch.batch`), so that both give the
same answers.

Each function reads its inputs from paths, runs the public API and returns a :class:`PairResult`:
a JSON-able summary, the arrays the command writes, and a picture when asked for. Nothing here
writes a file, except the full distance tensor, streamed to its file in slices within the budget.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

import numpy as np
import torch

from ..alignment import align, shift_landscape
from ..budget import chunk_rows
from ..checks import check_choice
from ..choices import MetricName, PrecisionName
from ..config import resolve_memory
from ..distances.prototypes import nearest_prototype, pairwise_distance
from ..matching.dense import Matches
from ..matching.dense import run as run_match
from ..matching.options import MatchOptions
from .features import FEATURES, dense_features
from .io import atomic_write, is_image, load_any, load_array, load_image
from .layouts import FILE_LAYOUTS, resolve_layout
from .summary import match_summary

__all__ = [
    "PairResult",
    "align_pairs",
    "align_warnings",
    "distance_pair",
    "match_pair",
    "picture_bytes",
    "poor_fit",
    "redraw",
    "verdicts",
]


@dataclass
class PairResult:
    """What one pair gave.

    Attributes
    ----------
    result : dict
        Plain numbers (and lists of them): what ``results.jsonl`` and ``--json`` report.
    arrays : dict of str to ndarray
        What ``-o`` writes (an .npz of these; a lone "distance" array as .npy).
    figure : matplotlib Figure, optional
        The picture, when one was asked for.
    page : str, optional
        The result's HTML page (:mod:`densematch.app.view`), when one was asked for.
    """

    result: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    figure: Any = None
    page: str | None = None


def picture_bytes(figure: Any) -> bytes:
    """A figure as PNG bytes (figures do not travel between processes; bytes do), closed."""
    from .viz import _plt

    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=110)
    finally:
        _plt().close(figure)
    return buffer.getvalue()


def grey_input(path: str, what: str) -> np.ndarray:
    """A grey image or a 2-D array."""
    arr = load_any(path, what, grey=True)
    if arr.ndim != 2:
        raise ValueError(f"{what} {path!r} must be a grey image or a 2-D array, got shape {arr.shape}")
    return arr


def align_pairs(
    pairs: Sequence[tuple[str, str]],
    *,
    mask: str | None = None,
    viz: bool = False,
    page: bool = False,
    **options: Any,
) -> list[PairResult | Exception]:
    """Align each (template, image) pair of paths; pairs of one shape are aligned as one batch
    (:func:`densematch.align` gives each item of a batch what it gives the item alone).

    Returns, per pair in order, its :class:`PairResult` or the exception it raised (a bad pair
    never stops the others). ``options`` are :func:`densematch.align`'s keywords; ``viz`` adds
    each pair's picture, ``page`` its HTML page.
    """
    out: list[PairResult | Exception | None] = [None] * len(pairs)
    loaded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    weights = grey_input(mask, "--mask") if mask else None
    for i, (template, image) in enumerate(pairs):
        try:
            loaded[i] = (grey_input(template, "TEMPLATE"), grey_input(image, "IMAGE"))
        except (ValueError, TypeError, OSError, ImportError) as err:
            out[i] = err
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, (t, x) in loaded.items():
        groups.setdefault((t.shape, x.shape), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            tpl = np.stack([loaded[i][0] for i in members])
            try:
                batch = align(tpl, np.stack([loaded[i][1] for i in members]), template_mask=weights, **options)
                for n, i in enumerate(members):
                    out[i] = _align_result(batch, n, loaded[i], weights, viz, page, options)
                continue
            except Exception:  # one bad pair fails its batch: each pair again alone, for its own answer
                pass
        for i in members:
            t, x = loaded[i]
            try:
                found = align(t, x, template_mask=weights, **options)
                out[i] = _align_result(found, None, (t, x), weights, viz, page, options)
            except Exception as err:
                out[i] = err
    return [r if r is not None else RuntimeError("not aligned") for r in out]


POOR_FIT = 0.5  # align's relative error above which the command and the batch index warn


def poor_fit(answer: dict[str, Any], objective: str) -> str | None:
    """What to tell the reader of align's ``answer`` (its ``as_dict()``) whose fit is poor, or None."""
    relative = answer.get("relative_error", 0.0)
    if relative <= POOR_FIT:
        return None
    hint = "" if objective == "ncc" else "; where the brightness differs, try --objective ncc"
    return (
        f"a poor fit: its error is {relative:.2f} of the template's own spread (0 is a perfect fit, 1 no better "
        f"than a flat one){hint}"
    )


def align_warnings(answer: dict[str, Any], objective: str) -> list[str]:
    """Everything to tell the reader of align's ``answer``: a scale at an end of the range
    searched (which :func:`densematch.align` itself warns of), a poor fit."""
    said = []
    bound = answer.get("at_bound") or []
    if bound:
        flags = ", ".join("--" + name.replace("_", "-") for name in bound)
        said.append(
            f"{' and '.join(bound)} at an end of the range searched: the truth may lie beyond it; widen {flags}"
        )
    poor = poor_fit(answer, objective)
    return said if poor is None else [*said, poor]


def _align_result(
    a: Any,
    n: int | None,
    pair: tuple[np.ndarray, np.ndarray],
    weights: np.ndarray | None,
    viz: bool,
    page: bool,
    options: dict[str, Any],
) -> PairResult:
    """Item ``n`` of a batched alignment (None: an unbatched one) of the (template, image)
    ``pair`` as a PairResult; its page adds the error over the shifts at the answer's scales."""
    answer = a.as_dict()
    if n is not None:
        answer = {key: value[n] for key, value in answer.items()}
    item = 0 if n is None else n
    objective = options.get("objective", "l1")
    template = np.asarray(pair[0], dtype=np.float32)
    shown = (
        template,
        a.warped.numpy() if n is None else a.warped[n].numpy(),
        a.landscape[item].numpy(),
        a.scales_h.numpy(),
        a.scales_w.numpy(),
        answer,
        objective,
    )
    figure = html = None
    if viz:
        from .viz import align_figure

        figure = align_figure(*shown)
    if page:
        from .view import align_page

        around = shift_landscape(
            pair[0],
            pair[1],
            answer["scale_h"],
            answer["scale_w"],
            objective=objective,
            template_mask=weights,
            memory=options.get("memory"),
        )
        html = align_page(*shown, shifts=a.landscape_shifts[item].numpy(), around=around.numpy())
    return PairResult(answer, figure=figure, page=html)


def _features(path: str, features: str | None, what: str) -> tuple[torch.Tensor | np.ndarray, np.ndarray | None]:
    """The (H, W, C) features of an image (and the image, to show), or a feature file's 3-D
    array as it lies (a leading batch of one dropped; :func:`_as_maps` reads it) and None."""
    if is_image(path):
        if features is None:
            raise ValueError(f"{what} {path!r} is an image: pass --features ({'|'.join(FEATURES)}) to describe it")
        img = load_image(path, what)
        return dense_features(img, features), img
    arr = load_array(path, what)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 3:
        raise ValueError(
            f"{what} {path!r} must hold one feature map, (H, W, C) or (C, H, W) (or with a leading batch of one), "
            f"got {arr.shape}"
        )
    return arr, None


def _as_maps(
    found: list[tuple[str, torch.Tensor | np.ndarray]], layout: str, grids: Sequence[tuple[str, Sequence[int], int]]
) -> list[torch.Tensor]:
    """Every map of ``found`` ((name, map) pairs) as (H, W, C): the feature files in the one
    layout :func:`.layouts.resolve_layout` gives them, with ``grids`` (name, 2-D shape, index of
    its map in ``found``); images' features are (H, W, C) already."""
    at = {i: j for j, i in enumerate(i for i, (_, x) in enumerate(found) if isinstance(x, np.ndarray))}
    if at:
        files = [(found[i][0], tuple(found[i][1].shape)) for i in at]
        # an image's features fix the channel count the files must have
        images = [x for _, x in found if not isinstance(x, np.ndarray)]
        channels = images[0].shape[2] if images else None
        placed = [(name, shape, at[i]) for name, shape, i in grids if i in at]
        layout = resolve_layout(layout, files, grids=placed, channels=channels)
    maps = []
    for _, x in found:
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 2, 0) if layout == "chw" else x))
        maps.append(x)
    return maps


def _preview(feat: torch.Tensor, img: np.ndarray | None) -> np.ndarray:
    """What to show for a map: the image itself, its colours, or the feature norm."""
    if img is not None:
        return img
    f = feat.float()
    if f.shape[-1] in (1, 3):
        return f.squeeze(-1).numpy().clip(0, 1)
    norm = f.norm(dim=-1)
    return (norm / norm.max().clamp_min(1e-12)).numpy()


def match_pair(
    a: str,
    b: str,
    *,
    features: str | None = None,
    device: str = "cpu",
    viz: bool = False,
    search: Callable[..., Matches | None] = run_match,
    mask_a: str | None = None,
    mask_b: str | None = None,
    page: bool = False,
    **settings: Any,
) -> PairResult | None:
    """Match the features (or images, described by ``features``) at paths ``a`` and ``b``.

    ``settings`` are :func:`densematch.match`'s keywords (:class:`densematch.MatchOptions`),
    checked before any file is read; ``layout`` also says how feature files hold their maps
    ("hwc" or "chw", a leading batch of one allowed). ``mask_a`` / ``mask_b`` are paths of grey
    images or 2-D arrays the size of the maps, nonzero where a pixel may match. ``search(a, b,
    options, mask_a=, mask_b=)`` replaces the search (the sharded one under torchrun, which
    returns None on every rank but the first: so does this). ``viz`` adds the picture, ``page``
    the HTML page, with what explains each pixel's verdict: the reverse pass for ``mutual`` and
    each pixel's ratio of its best two distances for ``ratio`` (two more local searches).
    """
    layout = settings.pop("layout", "hwc")
    if layout is not None:
        check_choice(layout, "layout", FILE_LAYOUTS)
    options = MatchOptions(**settings)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():  # before any file is read
        raise ValueError("--device cuda: no CUDA device is available here")
    (raw_a, ia), (raw_b, ib) = _features(a, features, "A"), _features(b, features, "B")
    read_masks = {
        name: grey_input(path, f"--{name.replace('_', '-')}")
        for name, path in (("mask_a", mask_a), ("mask_b", mask_b))
        if path is not None
    }
    grids = [(f"--{n.replace('_', '-')}", m.shape, int(n == "mask_b")) for n, m in read_masks.items()]
    fa, fb = _as_maps([(f"A {a!r}", raw_a), (f"B {b!r}", raw_b)], layout, grids)
    if fa.shape[-1] != fb.shape[-1]:
        hint = f" (feature files read as {layout}; --layout chooses)" if ia is None or ib is None else ""
        raise ValueError(f"A and B must have the same number of channels, got {fa.shape[-1]} and {fb.shape[-1]}{hint}")
    masks = {}
    for name, path, f in (("mask_a", mask_a, fa), ("mask_b", mask_b, fb)):
        if path is not None:
            m = read_masks[name]
            if m.shape != tuple(f.shape[:2]):
                raise ValueError(
                    f"--{name.replace('_', '-')} {path!r} must have its map's size {tuple(f.shape[:2])}, got {m.shape}"
                )
            masks[name] = torch.from_numpy(m != 0).to(dev)
    # the maps are (H, W, C) once read, whatever layout their files had
    r = search(fa.to(dev), fb.to(dev), options, **masks)
    if r is None:
        return None
    out = r.numpy()
    valid = out["valid"]
    # what explains each pixel's verdict, where the page shows it or two filters share the blame
    explained = page or (options.mutual and options.ratio is not None)
    cpu_masks = {name: m.cpu() for name, m in masks.items()}
    reverse, ratio_value = verdicts(fa.cpu(), fb.cpu(), options, cpu_masks) if explained else (None, None)
    allowed = cpu_masks["mask_a"].numpy() if "mask_a" in cpu_masks else None
    summary = match_summary(
        out, mutual=options.mutual, ratio=options.ratio, mask_a=allowed, reverse=reverse, ratio_value=ratio_value
    )
    result = {
        "shape_a": list(fa.shape),
        "shape_b": list(fb.shape),
        "valid": summary["valid_fraction"],
        "mean_score": float(np.nanmean(out["score"][valid])) if valid.any() else None,
        "summary": summary,
    }
    figure = None
    if viz:
        from .viz import invalid_note, match_figure

        index, score, shown = out["index"], out["score"], valid
        if index.ndim == 3:  # k > 1: the picture shows each pixel's best match
            index, score, shown = index[..., 0], score[..., 0], shown[..., 0]
        # b's grid positions (coords may be refined or in image pixels)
        coords = np.stack((index // fb.shape[1], index % fb.shape[1]), -1)
        figure = match_figure(
            _preview(fa, ia), _preview(fb, ib), coords, score, shown, options.metric, invalid_note(summary)
        )
    html = None
    if page:
        html = _match_page(fa, fb, ia, ib, out, options, (reverse, ratio_value), summary, f"{a} against {b}")
    return PairResult(result, out, figure, html)


def verdicts(
    fa: torch.Tensor, fb: torch.Tensor, options: MatchOptions, masks: dict[str, torch.Tensor] | None = None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """What says why a pixel of a match of (H, W, C) maps passed its filters or not, each from a
    search of its own: for ``mutual``, b's best pixel in a (the reverse pass, flat indices,
    (hb, wb)); for ``ratio``, each pixel's best over second-best distance, as the ratio test
    compares them ((h, w); not with ``exclude_radius``, whose runner-up is another)."""
    from ..metrics import get_metric

    masks = masks or {}
    plain = replace(options, k=1, mutual=False, ratio=None, exclude_radius=None, refine=None, stride=None, offset=None)
    reverse = ratio_value = None
    if options.mutual:
        back = run_match(fb, fa, plain, mask_a=masks.get("mask_b"), mask_b=masks.get("mask_a"))
        reverse = back.index.numpy()
    if options.ratio is not None and options.exclude_radius is None and fb.shape[0] * fb.shape[1] >= 2:
        two = run_match(fa, fb, replace(plain, k=2), **masks).score
        distance = get_metric(options.metric).ratio_distance
        ratio_value = (distance(two[..., 0].clone()) / distance(two[..., 1].clone())).numpy()
    return reverse, ratio_value


def _match_page(
    fa: torch.Tensor,
    fb: torch.Tensor,
    ia: np.ndarray | None,
    ib: np.ndarray | None,
    out: dict[str, np.ndarray],
    options: MatchOptions,
    explained: tuple[np.ndarray | None, np.ndarray | None],
    summary: dict[str, Any],
    title: str,
) -> str:
    """The match's page: the images (or the features in false colour), what explains each
    pixel's verdict (:func:`verdicts`) and the match's summary."""
    from .view import at_grid, false_colour, match_page

    fa, fb = fa.cpu(), fb.cpu()
    reverse, ratio_value = explained
    if ia is not None and ib is not None:
        pa, pb = at_grid(ia, tuple(fa.shape[:2])), at_grid(ib, tuple(fb.shape[:2]))
    else:
        pa, pb = false_colour(fa.float().numpy(), fb.float().numpy())
    arrays = dict(out)
    if options.stride is not None or options.offset is not None:  # positions back in b's grid
        arrays["coords"] = np.stack((out["index"] // fb.shape[1], out["index"] % fb.shape[1]), -1)
    return match_page(
        pa, pb, arrays, metric=options.metric, mutual=options.mutual, ratio=options.ratio,
        reverse=reverse, ratio_value=ratio_value, summary=summary, title=title,
    )  # fmt: skip


def distance_pair(
    features: str,
    prototypes: str,
    *,
    metric: MetricName = "l2",
    nearest: bool = False,
    k: int = 1,
    precision: PrecisionName = "exact",
    memory: int | str | None = None,
    search: Callable[..., tuple[torch.Tensor, torch.Tensor]] = nearest_prototype,
    to: str | None = None,
    keep: bool = True,
    page: bool = False,
    layout: str | None = "chw",
) -> PairResult:
    """Distances from every pixel of the (N, D, H, W) or (D, H, W) array at ``features`` to the
    (F, D) prototypes at ``prototypes``: all of them (array "distance", (N, F, H, W)), or with
    ``nearest`` the k nearest (arrays "distance" and "index", (N, k, H, W)). ``layout`` says how
    the file holds each map, as :func:`.layouts.resolve_layout` reads it ("hwc": (N, H, W, D) or
    (H, W, D)).

    Without ``nearest``, given ``to`` (an .npy path), or with ``keep=False`` (the summary alone),
    the distances are computed in slices that fit ``memory``, written there or only summed,
    never held whole: no arrays come back. ``page`` adds the HTML page of the first map's
    nearest prototypes (its k nearest, at least 3 where there are as many)."""
    x = load_array(features, "FEATURES")
    p = load_array(prototypes, "PROTOTYPES")
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise ValueError(
            f"FEATURES must hold maps, (N, D, H, W) or (D, H, W) (or (N, H, W, D), (H, W, D)), got {x.shape}"
        )
    if p.ndim == 2:
        layout = resolve_layout(layout, [(f"FEATURES {features!r}", x.shape[1:])], channels=p.shape[1])
    if layout == "hwc":
        x = x.transpose(0, 3, 1, 2)
    xt, pt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(p))
    found = search(xt, pt, metric=metric, k=k, memory=memory, precision=precision) if nearest else None
    # every distance, held whole: the command's own output (and the page's heat maps)
    whole = pairwise_distance(xt, pt, metric=metric, memory=memory) if not nearest and to is None and keep else None
    html = None
    if page:
        from .view import HEAT_VALUES, distance_page, false_colour

        shown = max(k, min(3, pt.shape[0])) if nearest else min(3, pt.shape[0])
        if found is not None and k >= shown:  # the command's own nearest, when it lists enough
            d1, i1 = found[0][:1], found[1][:1]
        else:
            d1, i1 = nearest_prototype(xt[:1], pt, metric=metric, k=shown, memory=memory, precision=precision)
        (picture,) = false_colour(x[0].transpose(1, 2, 0))
        items = f" (the first of {x.shape[0]} maps)" if x.shape[0] > 1 else ""
        every = None  # each prototype's heat map, where the page can carry them
        if pt.shape[0] * x.shape[2] * x.shape[3] <= HEAT_VALUES:
            first = whole[0] if whole is not None else pairwise_distance(xt[:1], pt, metric=metric, memory=memory)[0]
            every = first.numpy()
        html = distance_page(
            picture, i1[0].numpy(), d1[0].numpy(), metric, pt.shape[0], f"{features} against {prototypes}{items}", every
        )
    if found is not None:
        d, i = found
        arrays = {"distance": d.numpy(), "index": i.numpy()}
    elif to is not None:
        with atomic_write(to) as fh:
            shape, mean = _distance_slices(xt, pt, metric, memory, fh)
        return PairResult({"shape": list(shape), "mean_distance": mean, "output": str(to)}, page=html)
    elif not keep:
        shape, mean = _distance_slices(xt, pt, metric, memory, None)
        return PairResult({"shape": list(shape), "mean_distance": mean}, page=html)
    else:
        assert whole is not None
        d = whole
        arrays = {"distance": d.numpy()}
    return PairResult({"shape": list(d.shape), "mean_distance": float(d.float().mean())}, arrays, page=html)


def _distance_slices(
    x: torch.Tensor, p: torch.Tensor, metric: MetricName, memory: int | str | None, out: IO[bytes] | None
) -> tuple[tuple[int, ...], float]:
    """Every distance of ``x`` (N, D, H, W) to ``p``, one item and a band of prototypes at a
    time: half the budget for the band's output, half for its search. Written to ``out`` as one
    .npy (header, then the bands in C order) when given. Returns the shape and the mean."""
    n, _, h, w = x.shape
    f = p.shape[0]
    budget = resolve_memory(memory, x.device)
    band = chunk_rows(budget // 2, 8 * h * w, "one prototype's distances")
    total, count = 0.0, 0
    for item in range(n):
        for start in range(0, f, band):
            d = pairwise_distance(x[item : item + 1], p[start : start + band], metric=metric, memory=budget // 2)
            if out is not None:
                if item == 0 and start == 0:
                    header = {"descr": np.lib.format.dtype_to_descr(d.numpy().dtype), "fortran_order": False}
                    np.lib.format.write_array_header_1_0(out, {**header, "shape": (n, f, h, w)})
                out.write(d.numpy().tobytes())
            total += float(d.double().sum())
            count += d.numel()
    return (n, f, h, w), total / max(1, count)


def redraw(path: str) -> PairResult:
    """The result saved at ``path`` (an .npz of ``match -o`` or ``distance --nearest -o``) with
    its page: the run it records (task, inputs, options) is repeated, and must give the saved
    arrays again, else a ValueError says that the inputs changed since."""
    import json

    with np.load(path, allow_pickle=False) as archive:
        saved = {name: archive[name] for name in archive.files}
    if "_run" not in saved:
        raise ValueError(
            f"RESULT {path!r} records no run to draw it from: give a batch folder, its results.jsonl, or an .npz "
            "written by this version's match -o or distance --nearest -o (or run the command again with --html)"
        )
    run = json.loads(saved.pop("_run").tobytes().decode("utf-8"))
    first, second = run["inputs"]
    if run["task"] == "match":
        r = match_pair(first, second, page=True, **run["options"])
    else:
        r = distance_pair(first, second, page=True, **run["options"])
    assert r is not None  # a local search always answers
    changed = [
        name
        for name, value in saved.items()
        if name not in r.arrays or not np.array_equal(r.arrays[name], value, equal_nan=value.dtype.kind == "f")
    ]
    if changed:
        raise ValueError(
            f"RESULT {path!r}: its inputs ({first}, {second}) now give other {', '.join(changed)}: they changed "
            "since it was written; run the command again with --html"
        )
    return r
