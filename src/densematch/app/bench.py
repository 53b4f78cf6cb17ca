"""``densematch bench``: each job of densematch beside the plain recipe a user would write instead
(:mod:`densematch.app.recipes`), on this machine, with a verdict per row: ahead, level, or
behind and why.

The two are alternated round by round (a busy spell slows both) and the medians compared, with
the span of the speed-ups the repeats allow; a row is called ahead or behind only where the two
sets of times do not overlap (else "level (noisy)"). The
header names the CPU, its features and the path match's default takes on it, since the figures
differ between an AVX2 machine and one with AMX.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._info import config_report
from ..alignment import align, warp
from ..distances.prototypes import nearest_prototype, pairwise_distance
from ..local import local_cost_volume, local_match
from ..matching.dense import match
from ..matching.soft import soft_match
from . import recipes
from .synthetic import same_scene_pair

__all__ = ["run_bench", "verdict"]

AHEAD, LEVEL = 1.1, 0.9  # speed-ups at or above AHEAD are "ahead", below LEVEL "behind"
_EXACT = 'precision="exact" on the CPU'  # the report's line naming match's default path


@dataclass
class Job:
    """One row: densematch's call and the recipe's, and why densematch may be behind it (every
    row says, since timings on a shared machine can put any row there)."""

    name: str
    ours: Callable[[], Any]
    recipe_name: str
    recipe: Callable[[], Any]
    why_behind: str


def _alternated(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each of ``repeats`` calls of ``a`` and of ``b``, timed in turn after one
    untimed call of each."""
    a(), b()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return ta, tb


def verdict(ours: list[float], theirs: list[float]) -> tuple[str, float, tuple[float, float]]:
    """The row's verdict from the repeats' seconds, its median speed-up and the speed-ups'
    range (the recipe's slowest over densematch's fastest, and the other way round). "ahead" or
    "behind" only where the median speed-up says so and the two sets of times do not overlap:
    where they do, the machine's noise could flip it ("level (noisy)"), as one job read
    "behind 0.77x" and then "ahead 1.96x"."""
    ratio = statistics.median(theirs) / statistics.median(ours)
    spread = (min(theirs) / max(ours), max(theirs) / min(ours))
    apart = min(theirs) > max(ours) or min(ours) > max(theirs)
    if LEVEL <= ratio < AHEAD:
        return "level", ratio, spread
    if not apart:
        return "level (noisy)", ratio, spread
    return ("ahead" if ratio >= AHEAD else "behind"), ratio, spread


def _jobs(quick: bool) -> list[Job]:
    g = torch.Generator().manual_seed(0)
    side = 64 if quick else 112
    fa, fb = (torch.randn(side, side, 64, generator=g) for _ in range(2))
    x, p = torch.randn(2, 64, 64, 64, generator=g), torch.randn(128, 64, generator=g)
    flat = x.flatten(2).transpose(1, 2)
    bank = torch.randn(1024, 64, generator=g)
    local_side = 64 if quick else 96
    la, lb = (
        torch.randn(1, 64, local_side, local_side, generator=g),
        torch.randn(1, 64, local_side, local_side, generator=g),
    )
    soft_side = 64 if quick else 96
    sa, sb = (torch.randn(soft_side, soft_side, 64, generator=g) for _ in range(2))
    img = F.avg_pool2d(torch.rand(1, 1, 125, 125, generator=g), 3, 1, 1)[0, 0]
    tpl = warp(img, 1.07, 0.93, 7.3, 4.6, (100, 100))
    exact = config_report()[_EXACT]
    scene_side = 64 if quick else 96
    # two overlapping crops of one photograph, raw colour patches: smooth regions full of near-ties
    ca, cb = same_scene_pair(scene_side, scene_side, 64)
    return [
        Job(
            f"match {side}x{side}x64 cosine, top-1",
            lambda: match(fa, fb),
            "blockwise loop",
            lambda: recipes.blockwise_argmax(fa, fb),
            f"match's exact default here is {exact}: its top-k merge and the re-check of near ties "
            "cost about what the loop's argmax does at this size; the margin grows with the maps",
        ),
        Job(
            f"match {scene_side}x{scene_side}x64 same scene, top-1",
            lambda: match(ca, cb),
            "blockwise loop",
            lambda: recipes.blockwise_argmax(ca, cb),
            f"match's exact default here is {exact}; two views of one scene have, in every smooth "
            "region, many references within rounding of the best, and each is re-checked so that "
            "ties go to the lowest index, where the loop's argmax takes whichever its sums favour",
        ),
        Job(
            "pairwise_distance l2 2x64x64x64, F=128",
            lambda: pairwise_distance(x, p, metric="l2"),
            "torch.cdist",
            lambda: torch.cdist(flat, p),
            "densematch centres the features on the prototypes' mean and recomputes the pairs whose "
            "digits cancel; cdist's product path does neither (pixels 1e-3 from a prototype: cdist "
            "off by up to 190%, densematch by 4e-6)",
        ),
        Job(
            "pairwise_distance l1 2x64x64x64, F=128",
            lambda: pairwise_distance(x, p, metric="l1"),
            "torch.cdist",
            lambda: torch.cdist(flat, p, p=1.0),
            "at this size both are a few milliseconds; densematch's C kernel, which keeps blocks of pairs "
            "in registers, pulls ahead as the maps grow",
        ),
        Job(
            "nearest_prototype 2x64x64x64, F=1024",
            lambda: nearest_prototype(x, bank, metric="l2"),
            "cdist + argmin",
            lambda: torch.cdist(flat, bank).argmin(-1),
            "as for pairwise_distance l2: centred features and near pairs recomputed",
        ),
        Job(
            f"local_cost_volume {local_side}x{local_side}x64, r=4",
            lambda: local_cost_volume(la, lb, 4, metric="dot", layout="chw"),
            "shifted products",
            lambda: recipes.shifted_volume(la, lb, 4),
            "densematch marks the offsets that leave b (the recipe's zero padding reads as a match) and "
            "writes its own layout; on small maps the recipe's vectorised products cost as little",
        ),
        Job(
            f"local_match {local_side}x{local_side}x64, r=4, top-1",
            lambda: local_match(la, lb, 4, layout="chw"),
            "shifted products",
            lambda: recipes.shifted_top1(la, lb, 4),
            "densematch also returns each best's score and validity at b's edges; on small maps the "
            "recipe's argmax over its volume costs as little as the ranking",
        ),
        Job(
            f"soft_match dual softmax {soft_side}x{soft_side}x64",
            lambda: soft_match(sa, sb, temperature=0.1, mode="dual_softmax"),
            "dense softmaxes",
            lambda: recipes.dense_dual_softmax(sa, sb, 0.1),
            "the recipe's (HW)^2 matrices still fit in memory at this size, and densematch's weights, "
            "taken in the log domain so that low temperatures cannot underflow to 0/0, cost a third "
            "exponential per pair; it pulls ahead from about 96x96",
        ),
        Job(
            "align 100x100 into 125x125",
            lambda: align(tpl, img),
            "coarse-to-fine grid",
            lambda: recipes.coarse_to_fine_align(tpl, img),
            "densematch searches every shift at every scale of its grid and refines to sub-pixel "
            "precision, where the recipe stops at 1% and one pixel",
        ),
    ]


def run_bench(quick: bool = False, repeats: int | None = None) -> int:
    """Time every job against its recipe and print one table, with a verdict per row
    (:func:`verdict`): medians of ``repeats`` alternated rounds (default 3 quick, 5 full), and
    the span of the speed-ups."""
    repeats = repeats or (3 if quick else 5)
    report = config_report()
    exact = report[_EXACT]
    print(
        f"densematch bench: {report['cpu']} ({report['cpu features']}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; match's exact default: {exact}; "
        f"C kernels: {report['kernels']}; medians of {repeats}, alternated"
    )
    heads = f"{'job':44} {'densematch':>11} {'recipe':>20} {'recipe time':>12} {'speed-up':>9}"
    print(f"{heads} {'repeats span':>13}  verdict")
    behind = 0
    for job in _jobs(quick):
        with torch.inference_mode():
            ours, theirs = _alternated(job.ours, job.recipe, repeats)
        said, ratio, (low, high) = verdict(ours, theirs)
        if said == "behind":
            behind += 1
            said = f"behind: {job.why_behind}"
        print(
            f"{job.name:44} {statistics.median(ours) * 1e3:8.1f} ms {job.recipe_name:>20} "
            f"{statistics.median(theirs) * 1e3:9.1f} ms {ratio:8.2f}x {low:6.2f}-{high:<6.2f}  {said}"
        )
    if behind:
        print(f"{behind} row(s) behind their recipe on this machine; the reasons are printed beside them")
    return 0
