"""The densematch command: match, align, distance, demo and bench."""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from . import __version__
from ._align import OBJECTIVES, align
from ._distance import nearest_prototype, pairwise_distance
from ._match import Matches, match
from .features import FEATURES, dense_features
from .io import check_output, is_image, load_any, load_array, load_image, save_npy, save_npz
from .metrics import METRICS
from .precision import PRECISIONS, RANKINGS

EXPECTED = (ValueError, TypeError, OSError, ImportError, RuntimeError)
_PRECISION_HELP = "exact (default: float32 results, half precision where faster), float32, fast (approximate)"


class CommandError(Exception):
    """A problem to report in one line, without a traceback."""


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda: no CUDA device is available here")
    return torch.device(name)


def _features(path: str, args: argparse.Namespace, what: str) -> tuple[torch.Tensor, np.ndarray | None]:
    """(H, W, C) features, and the picture to show (the image, or None for a feature file)."""
    if is_image(path):
        if args.features is None:
            raise CommandError(f"{what} {path!r} is an image: pass --features ({'|'.join(FEATURES)}) to describe it")
        img = load_image(path, what)
        return dense_features(img, args.features), img
    arr = load_array(path, what)
    if arr.ndim != 3:
        raise CommandError(f"{what} {path!r} must hold features of shape (H, W, C), got {arr.shape}")
    return torch.from_numpy(np.ascontiguousarray(arr)), None


def _preview(feat: torch.Tensor, img: np.ndarray | None) -> np.ndarray:
    """What to show for a map: the image itself, its colours, or the feature norm."""
    if img is not None:
        return img
    f = feat.float()
    if f.shape[-1] in (1, 3):
        return f.squeeze(-1).numpy().clip(0, 1)
    norm = f.norm(dim=-1)
    return (norm / norm.max().clamp_min(1e-12)).numpy()


def _sharded(args: argparse.Namespace) -> bool:
    """Whether torchrun launched this command with more than one process: the process group is
    then initialised (gloo on CPUs, NCCL on GPUs) and the search sharded over it."""
    from .distributed import init_from_env

    return init_from_env(getattr(args, "device", "cpu"))


def _is_first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def cmd_match(args: argparse.Namespace) -> int:
    sharded = _sharded(args)
    dev = _device(args.device)
    fa, ia = _features(args.a, args, "A")
    fb, ib = _features(args.b, args, "B")
    if fa.shape[-1] != fb.shape[-1]:
        raise CommandError(f"A and B must have the same number of channels, got {fa.shape[-1]} and {fb.shape[-1]}")
    t0 = time.perf_counter()
    search: Callable[..., Matches] = match
    if sharded:
        from . import distributed

        search = functools.partial(distributed.match, shard="queries")
    r = search(
        fa.to(dev),
        fb.to(dev),
        metric=args.metric,
        k=args.k,
        mutual=args.mutual,
        ratio=args.ratio,
        memory=args.memory,
        precision=args.precision,
        progress=_progress(args),
    )
    if not _is_first_rank():  # sharded: rank 0 alone writes and reports
        return 0
    seconds = time.perf_counter() - t0
    out = r.numpy()
    if args.output:
        save_npz(args.output, **out)
    if args.viz:
        from .viz import match_figure, save_figure

        coords, score, valid = out["coords"], out["score"], out["valid"]
        if args.k > 1:  # the picture shows each pixel's best match
            coords, score, valid = coords[..., 0, :], score[..., 0], valid[..., 0]
        figure = match_figure(_preview(fa, ia), _preview(fb, ib), coords, score, valid, args.metric)
        save_figure(figure, args.viz)
    if not args.quiet:
        v = out["valid"]
        print(
            f"matched {fa.shape[0]}x{fa.shape[1]} against {fb.shape[0]}x{fb.shape[1]} (C={fa.shape[-1]}, "
            f"{args.metric}, k={args.k}) in {seconds:.2f} s; valid {v.mean():.1%}; "
            f"mean score {np.nanmean(out['score'][v]) if v.any() else float('nan'):.4f}"
        )
        for path in (args.output, args.viz):
            if path:
                print(f"wrote {path}")
    return 0


def _grey_input(path: str, what: str) -> np.ndarray:
    arr = load_any(path, what, grey=True)
    if arr.ndim != 2:
        raise CommandError(f"{what} {path!r} must be a grey image or a 2-D array, got shape {arr.shape}")
    return arr


def cmd_align(args: argparse.Namespace) -> int:
    tpl = _grey_input(args.template, "TEMPLATE")
    img = _grey_input(args.image, "IMAGE")
    mask = _grey_input(args.mask, "--mask") if args.mask else None
    t0 = time.perf_counter()
    a = align(
        tpl,
        img,
        scale_h=tuple(args.scale_h),
        scale_w=tuple(args.scale_w),
        objective=args.objective,
        template_mask=mask,
        memory=args.memory,
    )
    seconds = time.perf_counter() - t0
    answer = a.as_dict()
    if args.viz:
        from .viz import align_figure, save_figure

        save_figure(
            align_figure(
                np.asarray(tpl, dtype=np.float32),
                a.warped.numpy(),
                a.landscape[0].numpy(),
                a.scales_h.numpy(),
                a.scales_w.numpy(),
                answer,
            ),
            args.viz,
        )
    if args.json:
        print(json.dumps(answer))
    elif not args.quiet:
        print(f"scale_h {a.scale_h:.5f}  scale_w {a.scale_w:.5f}  shift_y {a.shift_y:.3f}  shift_x {a.shift_x:.3f}")
        print(f"error ({args.objective}) {a.error:.6f} per pixel; found in {seconds * 1e3:.0f} ms")
        if args.viz:
            print(f"wrote {args.viz}")
    return 0


def cmd_distance(args: argparse.Namespace) -> int:
    x = load_array(args.features, "FEATURES")
    p = load_array(args.prototypes, "PROTOTYPES")
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise CommandError(f"FEATURES must have shape (N, D, H, W) or (D, H, W), got {x.shape}")
    xt, pt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(p))
    if args.nearest:
        nearest: Callable[..., tuple[torch.Tensor, torch.Tensor]] = nearest_prototype
        if _sharded(args):
            from . import distributed

            nearest = functools.partial(distributed.nearest_prototype, shard="pixels")
        d, i = nearest(xt, pt, args.metric, k=args.k, memory=args.memory, precision=args.precision)
        if not _is_first_rank():
            return 0
        if args.output:
            save_npz(args.output, distance=d.numpy(), index=i.numpy())
        summary = f"nearest prototypes {tuple(i.shape)}; mean distance {d.float().mean():.4f}"
    else:
        if _sharded(args) and not _is_first_rank():  # the full tensor is not sharded: rank 0 writes it
            return 0
        d = pairwise_distance(xt, pt, args.metric, memory=args.memory)
        if args.output:
            save_npy(args.output, d.numpy())
        summary = f"distances {tuple(d.shape)}; mean {d.float().mean():.4f}"
    if not args.quiet:
        print(f"{summary} ({args.metric})")
        if args.output:
            print(f"wrote {args.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.out), quiet=args.quiet, progress=_progress(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from .demo import run_bench

    return run_bench(quick=args.quick)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, pointing at --help, rather than the whole usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="densematch",
        description="Exact, memory-bounded dense matching, stretch-and-shift alignment and prototype distances.",
    )
    p.add_argument("--version", action="version", version=f"densematch {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--quiet", action="store_true", help="print nothing but errors and no progress bar")
        sp.add_argument("--debug", action="store_true", help="show a traceback on errors")

    m = sub.add_parser(
        "match",
        help="best pixel(s) of B for every pixel of A",
        description="For every pixel of A, its best pixel(s) in B, exactly, inside a memory budget.",
    )
    m.add_argument("a", metavar="A", help="features (.npy/.pt, shape (H, W, C)) or an image (needs --features)")
    m.add_argument("b", metavar="B", help="the same for the second map")
    m.add_argument("-o", "--output", metavar="OUT.npz", help="write coords, score, valid and index here")
    m.add_argument("--metric", default="cosine", choices=tuple(METRICS), help="similarity or distance (default cosine)")
    m.add_argument("--k", type=int, default=1, help="matches per pixel, best first (default 1)")
    m.add_argument("--mutual", action="store_true", help="keep only mutual nearest neighbours valid")
    m.add_argument("--ratio", type=float, help="Lowe's ratio test threshold in (0, 1]")
    m.add_argument("--memory", default=None, help="working-memory cap, e.g. 1GiB (default: from free memory)")
    m.add_argument("--precision", default="exact", choices=PRECISIONS, help=_PRECISION_HELP)
    m.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    m.add_argument("--features", choices=FEATURES, help="describe image inputs: patch (7x7 patches), color, dsift")
    m.add_argument("--viz", metavar="OUT.png", help="write a picture of the matches")
    common(m)
    m.set_defaults(run=cmd_match)

    a = sub.add_parser(
        "align",
        help="stretch and shift that fit TEMPLATE into IMAGE",
        description="Find scale_h, scale_w, shift_y, shift_x with TEMPLATE = IMAGE stretched and cropped.",
    )
    a.add_argument("template", metavar="TEMPLATE", help="a grey image or a 2-D .npy/.pt array")
    a.add_argument("image", metavar="IMAGE", help="the larger image")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.add_argument("--objective", default="l1", choices=OBJECTIVES)
    a.add_argument("--scale-h", nargs=2, type=float, default=(0.8, 1.2), metavar=("LOW", "HIGH"))
    a.add_argument("--scale-w", nargs=2, type=float, default=(0.8, 1.2), metavar=("LOW", "HIGH"))
    a.add_argument("--mask", metavar="MASK", help="template weights (image or array); 0 ignores a pixel")
    a.add_argument("--memory", default=None, help="working-memory cap of the search")
    a.add_argument("--viz", metavar="OUT.png", help="write template, warped image, difference and landscape")
    common(a)
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
    d.add_argument("--metric", default="l2", choices=tuple(METRICS))
    d.add_argument("--nearest", action="store_true", help="only the nearest prototype(s), never the full tensor")
    d.add_argument("--k", type=int, default=1, help="with --nearest: how many")
    d.add_argument("--precision", default="exact", choices=RANKINGS, help="with --nearest: " + _PRECISION_HELP)
    d.add_argument("--memory", default=None, help="working-memory cap")
    common(d)
    d.set_defaults(run=cmd_distance)

    e = sub.add_parser("demo", help="match, align and distance on bundled sample images, with pictures")
    e.add_argument("--out", default="demo-out", metavar="DIR", help="where to write the pictures (default demo-out)")
    common(e)
    e.set_defaults(run=cmd_demo)

    b = sub.add_parser("bench", help="a short benchmark of this machine")
    b.add_argument("--quick", action="store_true", help="smaller sizes")
    common(b)
    b.set_defaults(run=cmd_bench)
    return p


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
        for flag, name in (("-o", "output"), ("--viz", "viz")):
            if getattr(args, name, None):
                check_output(getattr(args, name), flag)
        return args.run(args)
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


if __name__ == "__main__":
    sys.exit(main())
