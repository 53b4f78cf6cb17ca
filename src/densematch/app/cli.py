"""The densematch command: match, align, distance, demo and bench."""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..alignment import OBJECTIVES
from ..matching.dense import Matches
from ..matching.dense import run as run_match
from ..matching.options import MatchOptions
from ..matching.subpixel import REFINES
from ..metrics import METRICS
from ..precision import PRECISIONS, RANKINGS
from ..progress import say
from .features import FEATURES
from .io import ARRAY_OUTPUTS, FIGURE_OUTPUTS, PAGE_OUTPUTS, check_output, is_image, save_arrays
from .layouts import FILE_LAYOUTS
from .summary import summary_line
from .tasks import PairResult, align_pairs, distance_pair, match_pair, poor_fit

EXPECTED = (ValueError, TypeError, OSError, ImportError, RuntimeError)
_PRECISION_HELP = "exact (float32 results, half precision where faster), float32, fast (approximate)"
_HTML_HELP = "write a page to inspect the result in a browser (self-contained: no network)"
_MEMORY_HELP = "working-memory cap, e.g. 256MiB or 1GiB (default: half the free memory, at most 512MiB on a CPU)"


# the match settings the command sets by flags of the same names (progress follows --quiet and
# the terminal); their defaults are MatchOptions' own
_MATCH = MatchOptions()
_MATCH_FLAGS = tuple(f.name for f in fields(MatchOptions) if f.name != "progress")


class CommandError(Exception):
    """A problem to report in one line, without a traceback."""


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _sharded(args: argparse.Namespace) -> bool:
    """Whether torchrun launched this command with more than one process: the process group is
    then initialised (gloo on CPUs, NCCL on GPUs) and the search sharded over it."""
    from ..distributed import init_from_env

    return init_from_env(getattr(args, "device", "cpu"))


def _is_first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def task_options(task: str, args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of :mod:`densematch.app.tasks`' function for ``task`` that the command's
    options set (shared by the single-pair commands and ``batch``)."""
    if task == "align":
        return {
            "scale_h": tuple(args.scale_h),
            "scale_w": tuple(args.scale_w),
            "objective": args.objective,
            "mask": args.mask,
            "memory": args.memory,
        }
    if task == "match":
        settings = {name: getattr(args, name) for name in _MATCH_FLAGS}
        return {
            "features": args.features,
            "device": args.device,
            "mask_a": args.mask_a,
            "mask_b": args.mask_b,
            **settings,
        }
    if not args.nearest and (args.k is not None or args.precision is not None):
        raise CommandError(
            "--k and --precision apply only with --nearest: without it, every prototype's distance is written"
        )
    return {
        "layout": args.layout,
        "metric": args.metric,
        "nearest": args.nearest,
        "k": 1 if args.k is None else args.k,
        "precision": args.precision or "exact",
        "memory": args.memory,
    }


def _write_picture(result: PairResult, path: str) -> None:
    from .viz import save_figure

    save_figure(result.figure, path)


def cmd_match(args: argparse.Namespace) -> int:
    if args.features and not (is_image(args.a) or is_image(args.b)):
        warnings.warn("--features is ignored: A and B are feature files, not images", stacklevel=1)
    sharded = _sharded(args)
    search: Callable[..., Matches] = run_match
    options = task_options("match", args)
    if sharded:
        from .. import distributed

        search = functools.partial(distributed.run, shard="queries")
    t0 = time.perf_counter()
    page = bool(args.html) and _is_first_rank()
    r = match_pair(args.a, args.b, viz=bool(args.viz), page=page, search=search, progress=_progress(args), **options)
    if r is None or not _is_first_rank():  # sharded: rank 0 alone writes and reports
        return 0
    seconds = time.perf_counter() - t0
    if args.output:
        save_arrays(args.output, {**r.arrays, **_recorded("match", [args.a, args.b], options)}, single="coords")
    if args.viz:
        _write_picture(r, args.viz)
    _write_page(r, args.html)
    if args.json:
        print(json.dumps({**r.result, "seconds": seconds}))
    elif not args.quiet:
        (h, w, c), (hb, wb, _) = r.result["shape_a"], r.result["shape_b"]
        mean = r.result["mean_score"]
        print(
            f"matched {h}x{w} against {hb}x{wb} (C={c}, {args.metric}, k={args.k}) in {seconds:.2f} s; "
            f"{summary_line(r.result['summary'])}; mean score {float('nan') if mean is None else mean:.4f}"
        )
        for path in (args.output, args.viz, args.html):
            if path:
                print(f"wrote {path}")
    return 0


def _write_page(result: PairResult, path: str | None) -> None:
    if path and result.page is not None:
        from .view import write_page

        write_page(path, result.page)


def _recorded(task: str, inputs: list[str], options: dict[str, Any]) -> dict[str, np.ndarray]:
    """What ``densematch view`` needs to draw a saved result again: the task, its inputs and its
    options, as the bytes of one JSON text (uint8: read back without pickle, and numeric like
    every other array of the file, for code that turns them all into tensors)."""
    shown = {key: value for key, value in options.items() if key not in ("search", "progress")}
    text = json.dumps({"task": task, "inputs": inputs, "options": shown})
    return {"_run": np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()}


def cmd_align(args: argparse.Namespace) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun one pair is too small to shard: rank 0 aligns it, once
    options = task_options("align", args)
    if args.certify is not None:
        _check_certify(args)
        # certified, and where a better fit turns up refined from it and certified again
        options.update(certify=True, time_limit=None if args.certify == float("inf") else args.certify)
    t0 = time.perf_counter()
    (r,) = align_pairs([(args.template, args.image)], viz=bool(args.viz), page=bool(args.html), **options)
    if isinstance(r, Exception):
        raise r
    seconds = time.perf_counter() - t0
    if args.viz:
        _write_picture(r, args.viz)
    _write_page(r, args.html)
    a = r.result
    lines = [
        f"scale_h {a['scale_h']:.5f}  scale_w {a['scale_w']:.5f}  "
        f"shift_y {a['shift_y']:.3f}  shift_x {a['shift_x']:.3f}",
        f"error ({args.objective}) {a['error']:.6f} per pixel; found in {seconds * 1e3:.0f} ms",
    ]
    if args.certify is not None:
        lines.append(_certificate_line(a["certificate"]))
    poor = poor_fit(a, args.objective)  # (a scale at its bound: align's own warning says so)
    if poor is not None:
        print(f"densematch: warning: {poor}", file=sys.stderr)
    if args.json:
        print(json.dumps(a))
    elif not args.quiet:
        print("\n".join(lines))
        for path in (args.viz, args.html):
            if path:
                print(f"wrote {path}")
    return 0


def _check_certify(args: argparse.Namespace) -> None:
    if not args.certify > 0:
        raise CommandError(f"--certify takes a positive number of seconds (or none), got {args.certify}")
    if args.objective not in ("l1", "l2"):
        raise CommandError(f"--certify needs --objective l1 or l2 (its bound is on differences), got {args.objective}")
    if args.mask:
        raise CommandError("--certify does not take --mask (its bound weighs every template pixel alike)")


def _certificate_line(c: dict[str, Any]) -> str:
    """The certificate (:meth:`Certificate.as_dict`) in one line."""
    ds, _, dt, _ = c["within"]
    if c["certified"]:
        return (
            f"certified: no better fit lies farther than {ds:g} in scale or {dt:g} px "
            f"({c['cells_examined']} cells, {c['seconds']:.1f} s)"
        )
    names = ("scale_h", "scale_w", "shift_y", "shift_x")
    reach = ", ".join(f"{name} {v:.3g}" for name, v in zip(names, c["within"], strict=True))
    return f"not certified ({c['reason']}); better fits lie within {reach} of it"


def cmd_distance(args: argparse.Namespace) -> int:
    options = task_options("distance", args)
    if args.nearest:
        if _sharded(args):
            from .. import distributed

            options["search"] = functools.partial(distributed.nearest_prototype, shard="pixels")
    elif _sharded(args) and not _is_first_rank():  # the full tensor is not sharded: rank 0 writes it
        return 0
    # the full tensor goes to an .npy (or only into the summary) in slices within --memory; an
    # .npz archive is written from the whole tensor
    streamed = not args.nearest and (args.output is None or args.output.lower().endswith(".npy"))
    r = distance_pair(
        args.features,
        args.prototypes,
        to=args.output if streamed else None,
        keep=not streamed,
        page=bool(args.html) and _is_first_rank(),
        **options,
    )
    if not _is_first_rank():
        return 0
    if args.output and not streamed:
        recorded = _recorded("distance", [args.features, args.prototypes], options) if args.nearest else {}
        save_arrays(args.output, {**r.arrays, **recorded}, single="index" if args.nearest else "distance")
    _write_page(r, args.html)
    if not args.quiet:
        shape = tuple(r.result["shape"])
        what = f"nearest prototypes {shape}; mean distance" if args.nearest else f"distances {shape}; mean"
        print(f"{what} {r.result['mean_distance']:.4f} ({args.metric})")
        for path in (args.output, args.html):
            if path:
                print(f"wrote {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.out), quiet=args.quiet, progress=_progress(args), parents=args.parents)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    if args.repeats is not None and args.repeats < 1:
        raise CommandError(f"--repeats must be >= 1, got {args.repeats}")
    return run_bench(quick=args.quick, repeats=args.repeats)


class _Help(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one and the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, pointing at --help, rather than the whole usage; every option's
    default shown in --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _match_options(m: argparse.ArgumentParser) -> None:
    m.add_argument("--metric", default=_MATCH.metric, choices=tuple(METRICS), help="similarity or distance")
    m.add_argument("--k", type=int, default=_MATCH.k, help="matches per pixel, best first")
    m.add_argument("--mutual", action="store_true", help="keep only mutual nearest neighbours valid")
    m.add_argument("--ratio", type=float, help="Lowe's ratio test threshold in (0, 1]")
    m.add_argument(
        "--exclude-radius", type=float, metavar="R", help="with --ratio: the runner-up lies farther than R pixels"
    )
    m.add_argument("--memory", default=None, help=_MEMORY_HELP)
    m.add_argument("--precision", default=_MATCH.precision, choices=PRECISIONS, help=_PRECISION_HELP)
    m.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the search runs")
    m.add_argument("--features", choices=FEATURES, help="describe image inputs: patch (7x7 patches), color, dsift")
    _layout_option(m, "(H, W, C) or (C, H, W), either with a leading batch of one")
    m.add_argument("--mask-a", metavar="MASK", help="grey image or 2-D .npy the size of A's map: nonzero may match")
    m.add_argument("--mask-b", metavar="MASK", help="the same for B: pixels of B that may be chosen")
    m.add_argument("--refine", choices=REFINES, help="sub-pixel positions: parabola, soft, features (the most precise)")
    m.add_argument(
        "--stride", type=float, nargs="+", metavar="S", help="grid step in image pixels: one, or row and col"
    )
    m.add_argument(
        "--offset", type=float, nargs="+", metavar="O", help="image position of grid (0, 0): one, or row and col"
    )


def _align_options(a: argparse.ArgumentParser) -> None:
    a.add_argument(
        "--objective",
        default="l1",
        choices=OBJECTIVES,
        help="mean absolute or squared difference, or 1 - NCC (robust to brightness and contrast)",
    )
    for axis, direction in (("h", "vertical"), ("w", "horizontal")):
        a.add_argument(
            f"--scale-{axis}",
            nargs=2,
            type=float,
            default=(0.8, 1.2),
            metavar=("LOW", "HIGH"),
            help=f"{direction} stretches searched",
        )
    a.add_argument("--mask", metavar="MASK", help="template weights (image or array); 0 ignores a pixel")
    a.add_argument("--memory", default=None, help=_MEMORY_HELP)


def _layout_option(p: argparse.ArgumentParser, shapes: str) -> None:
    p.add_argument(
        "--layout",
        default=None,
        choices=FILE_LAYOUTS,
        help=f"how feature files hold their maps: {shapes}; auto: the one reading under which the inputs agree, "
        "refused where both do (default: as auto, but where both fit, hwc with a warning)",
    )


def _distance_options(d: argparse.ArgumentParser) -> None:
    _layout_option(d, "hwc (N, H, W, D) or (H, W, D), chw (N, D, H, W) or (D, H, W)")
    d.add_argument("--metric", default="l2", choices=tuple(METRICS), help="the distance")
    d.add_argument("--nearest", action="store_true", help="only the nearest prototype(s), never the full tensor")
    d.add_argument("--k", type=int, default=None, help="with --nearest: how many (default: 1)")
    d.add_argument("--precision", default=None, choices=RANKINGS, help="with --nearest: " + _PRECISION_HELP)
    d.add_argument("--memory", default=None, help=_MEMORY_HELP)


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--quiet", action="store_true", help="print nothing but errors and no progress bar")
    sp.add_argument("--debug", action="store_true", help="show a traceback on errors")


def _batch_parser(sub: Any) -> None:
    from .batch import COLUMNS, ENGINES

    b = sub.add_parser(
        "batch",
        help="align, match or distance over a manifest of pairs; resumable, local or on Ray",
        description="Run align, match or distance on every pair of a CSV manifest, writing OUTDIR/results.jsonl "
        "(one JSON line per pair) and each pair's outputs. Running it again skips the pairs already done.",
    )
    tasks = b.add_subparsers(dest="task", metavar="TASK", required=True)
    options = {"align": _align_options, "match": _match_options, "distance": _distance_options}
    for task, columns in COLUMNS.items():
        t = tasks.add_parser(task, help=f"{task} every pair (manifest columns: {', '.join(columns)}, optional id)")
        t.add_argument("manifest", metavar="MANIFEST", help=f"CSV with header {','.join(columns)}[,id]")
        t.add_argument("-o", "--output", metavar="OUTDIR", required=True, help="results.jsonl and outputs go here")
        t.add_argument("--engine", default="local", choices=ENGINES, help="local processes or Ray")
        t.add_argument("--workers", type=int, default=1, help="worker processes (1: this one)")
        t.add_argument("--ray-address", metavar="ADDR", help="Ray cluster (default RAY_ADDRESS, else a local one)")
        if task != "distance":
            t.add_argument("--viz", action="store_true", help="write each pair's picture as OUTDIR/ID.png")
        t.add_argument(
            "--html", action="store_true", help="write each pair's page as OUTDIR/ID.html and OUTDIR/index.html"
        )
        options[task](t)
        _common(t)
        t.set_defaults(run=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    from .batch import INDEX, RESULTS, read_manifest, run

    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise CommandError(f"-o {args.output!r} is a file; give a folder for results.jsonl and the outputs")
    pairs = read_manifest(args.manifest, args.task)
    counts = {"ok": 0, "error": 0, "skipped": 0}

    def skip(pair: object) -> None:
        counts["skipped"] += 1

    t0 = time.perf_counter()
    bar = _progress(args)
    records = run(
        args.task,
        pairs,
        engine=args.engine,
        workers=args.workers,
        out_dir=out,
        ray_address=args.ray_address,
        viz=getattr(args, "viz", False),
        html=args.html,
        progress=bar,
        on_skip=skip,
        **task_options(args.task, args),
    )
    for record in records:
        counts[record["status"]] += 1
        if record["status"] == "error" and not args.quiet:
            say(f"densematch batch: {record['id']}: {record['error']}", bar=bar)
    seconds = time.perf_counter() - t0
    if not args.quiet:
        done = counts["ok"] + counts["error"]
        rate = f" ({done / seconds:.1f} pairs/s)" if done and seconds > 0 else ""
        print(
            f"batch {args.task}: {counts['ok']} ok, {counts['error']} error, {counts['skipped']} skipped "
            f"in {seconds:.1f} s{rate}; results in {out / RESULTS}"
        )
        if args.html:
            print(f"pages: {out / INDEX}")
    return 1 if counts["error"] else 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="densematch",
        description="Exact, memory-bounded dense matching, stretch-and-shift alignment and prototype distances.",
    )
    p.add_argument("--version", action="version", version=f"densematch {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    m = sub.add_parser(
        "match",
        help="best pixel(s) of B for every pixel of A",
        description="For every pixel of A, its best pixel(s) in B, exactly, inside a memory budget.",
    )
    m.add_argument("a", metavar="A", help="features (.npy/.pt, shape (H, W, C)) or an image (needs --features)")
    m.add_argument("b", metavar="B", help="the same for the second map")
    m.add_argument("-o", "--output", metavar="OUT.npz", help="write coords, score, valid and index here")
    m.add_argument("--json", action="store_true", help="print one JSON object: the shapes, the summary, the time")
    _match_options(m)
    m.add_argument("--viz", metavar="OUT.png", help="write a picture of the matches")
    m.add_argument("--html", metavar="PAGE.html", help=_HTML_HELP)
    _common(m)
    m.set_defaults(run=cmd_match)

    a = sub.add_parser(
        "align",
        help="stretch and shift that fit TEMPLATE into IMAGE",
        description="Find scale_h, scale_w, shift_y, shift_x with TEMPLATE = IMAGE stretched and cropped.",
    )
    a.add_argument("template", metavar="TEMPLATE", help="a grey image or a 2-D .npy/.pt array")
    a.add_argument("image", metavar="IMAGE", help="the larger image")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    _align_options(a)
    a.add_argument(
        "--certify",
        nargs="?",
        const=float("inf"),
        type=float,
        metavar="SECONDS",
        help="then prove offline that no better fit lies farther than 0.015 in scale or 1.5 px "
        "(seconds to minutes; SECONDS caps it)",
    )
    a.add_argument("--viz", metavar="OUT.png", help="write template, warped image, difference and landscape")
    a.add_argument("--html", metavar="PAGE.html", help=_HTML_HELP)
    _common(a)
    a.set_defaults(run=cmd_align)

    d = sub.add_parser("distance", help="distances from every pixel to a bank of prototypes")
    d.add_argument("features", metavar="FEATURES", help=".npy/.pt of shape (N, D, H, W) or (D, H, W)")
    d.add_argument("prototypes", metavar="PROTOTYPES", help=".npy/.pt of shape (F, D) or (F, D, 1, 1)")
    d.add_argument(
        "-o",
        "--output",
        metavar="OUT.npy",
        help="write (N, F, H, W) distances; with --nearest, an .npz of distance and index",
    )
    _distance_options(d)
    d.add_argument("--html", metavar="PAGE.html", help=_HTML_HELP + " (the first map's nearest prototypes)")
    _common(d)
    d.set_defaults(run=cmd_distance)

    v = sub.add_parser(
        "view",
        help="an HTML page to inspect a result in a browser",
        description="Write one self-contained HTML page (no network, no server) for RESULT: a batch's folder or "
        "results.jsonl (an index of its pairs), or an .npz written by match -o or distance --nearest -o "
        "(drawn again from the inputs and options it records, which must still give the same arrays).",
    )
    v.add_argument(
        "result", metavar="RESULT", help="OUTDIR or OUTDIR/results.jsonl of a batch, or a match/distance .npz"
    )
    v.add_argument("-o", "--output", metavar="PAGE.html", required=True, help="the page to write")
    _common(v)
    v.set_defaults(run=cmd_view)

    _batch_parser(sub)

    e = sub.add_parser("demo", help="match, align and distance on bundled sample images, with pictures")
    e.add_argument("--out", default="demo-out", metavar="DIR", help="where to write the pictures")
    e.add_argument("--parents", action="store_true", help="create the missing parent folders of --out too")
    _common(e)
    e.set_defaults(run=cmd_demo)

    b = sub.add_parser("bench", help="each job beside the plain recipe a user would write, on this machine")
    b.add_argument("--quick", action="store_true", help="smaller sizes")
    b.add_argument("--repeats", type=int, help="alternated rounds per row, whose medians count (default 3 quick, 5)")
    _common(b)
    b.set_defaults(run=cmd_bench)

    i = sub.add_parser("info", help="versions, CPU features, the search paths taken, whether the C kernels run")
    _common(i)
    i.set_defaults(run=cmd_info)
    return p


def cmd_view(args: argparse.Namespace) -> int:
    from .batch import RESULTS, write_index
    from .tasks import redraw
    from .view import write_page

    source = Path(args.result)
    if source.is_dir() or source.name == RESULTS:
        write_index(source if source.is_dir() else source.parent, args.output)
    elif source.suffix.lower() == ".npz":
        page = redraw(args.result).page
        assert page is not None  # redraw always draws one
        write_page(args.output, page)
    elif not source.exists():
        raise FileNotFoundError(f"RESULT {args.result!r} does not exist")
    else:
        raise ValueError(
            f"RESULT {args.result!r}: give a batch folder, its {RESULTS}, or an .npz of match -o or "
            "distance --nearest -o"
        )
    if not args.quiet:
        print(f"wrote {args.output}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .._info import show_config

    show_config(file=sys.stdout)
    return 0


def _report(args: argparse.Namespace, caught: list[warnings.WarningMessage]) -> None:
    """The run's warnings (the user's concern: a result at the edge of its range, an option
    that changes nothing), each once, one line each."""
    if args.quiet:
        return
    seen = set()
    for w in caught:
        message = str(w.message).splitlines()[0] if str(w.message) else ""
        if issubclass(w.category, UserWarning) and message and message not in seen:
            seen.add(message)
            print(f"densematch {args.command}: warning: {message}", file=sys.stderr)


class Terminated(BaseException):
    """Raised by SIGTERM, so that half-written outputs are removed as on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = (
        signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        # outputs are checked before the work, not after it
        if args.command != "batch":
            array_outputs = PAGE_OUTPUTS if args.command == "view" else ARRAY_OUTPUTS
            for flag, name, suffixes in (
                ("-o", "output", array_outputs),
                ("--viz", "viz", FIGURE_OUTPUTS),
                ("--html", "html", PAGE_OUTPUTS),
            ):
                if getattr(args, name, None):
                    check_output(getattr(args, name), flag, suffixes)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            try:
                return int(args.run(args))
            finally:
                _report(args, caught)
    except (CommandError, *EXPECTED) as err:
        if args.debug:
            raise
        message = str(err) or type(err).__name__
        print(f"densematch {args.command}: error: {message.splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("densematch: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("densematch: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _leave_process_group()


def _leave_process_group() -> None:
    """Under torchrun: wait for every rank, then take the process group down, so that no rank
    exits while another still talks to it (gloo then aborted a rank with "terminate called
    without an active exception" now and then, on a busy machine)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        torch.distributed.barrier()
    except RuntimeError:  # another rank is gone already: nothing to wait for
        pass
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
