"""densematch.distributed: sharded search on torch.distributed (gloo, two processes on a CPU).

Starting processes is slow, so one spawn runs every case on both ranks and each rank compares
its result with the one-process call on the whole input; the parent collects the failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch import engine
from densematch.app.features import dense_features
from densematch.distributed import _merge

from ._reference import METRICS, assert_same_up_to_ties, decided, patch_features, reference_scores, tolerance

WORLD = 2


# -- the merge alone, no processes -------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    na=st.integers(1, 30),
    bands=st.lists(st.integers(0, 20), min_size=1, max_size=4).filter(lambda b: sum(b) > 0),
    c=st.integers(1, 8),
    k=st.integers(1, 5),
    metric=st.sampled_from(METRICS),
    duplicates=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_merging_the_bands_equals_the_whole_search(na, bands, c, k, metric, duplicates, masked, seed):
    g = torch.Generator().manual_seed(seed)
    nb = sum(bands)
    a = torch.randn(na, c, generator=g)
    b = torch.randn(nb, c, generator=g)
    if duplicates:  # exact ties across bands: the lower global index must win
        b[nb // 2 :] = b[: nb - nb // 2].clone()
    allowed = torch.rand(nb, generator=g) < 0.7 if masked else torch.ones(nb, dtype=torch.bool)
    k = min(k, nb)
    m = densematch.metrics.get_metric(metric)
    rows_b = allowed.nonzero().squeeze(1)
    want_v, want_i = engine.topk(a, b, metric=m, k=k, budget=2**26, rows_b=rows_b)
    values, indices, start = [], [], 0
    for n in bands:
        band_rows = allowed[start : start + n].nonzero().squeeze(1)
        v, i = engine.topk(a, b[start : start + n], metric=m, k=k, budget=2**26, rows_b=band_rows)
        values.append(v)
        indices.append(torch.where(i >= 0, i + start, -1))
        start += n
    got_v, got_i = _merge(values, indices, k, m.higher_is_better)
    assert_same_up_to_ties(a, b, got_i, want_i, metric)
    same = got_i == want_i
    torch.testing.assert_close(got_v[same], want_v[same], equal_nan=True)
    if duplicates:  # exact copies score exactly alike: the tie rule decides, bands or not
        ref = reference_scores(a, b, metric)
        best = ref.masked_fill(~allowed, -torch.inf).amax(1, keepdim=True)
        exact = (ref == best) & allowed
        lowest = torch.where(exact, torch.arange(nb), nb).amin(1)
        clear = ref.masked_fill(exact | ~allowed, -torch.inf).amax(1) < best[:, 0] - tolerance(a, b, metric)
        assert torch.equal(got_i[clear, 0], lowest[clear])


def test_without_a_process_group_it_says_how_to_launch():
    with pytest.raises(RuntimeError, match="torchrun"):
        densematch.distributed.match(torch.randn(4, 4, 3), torch.randn(4, 4, 3))
    with pytest.raises(ValueError, match="shard must be one of 'queries', 'references'"):
        densematch.distributed.match(torch.randn(4, 4, 3), torch.randn(4, 4, 3), shard="pixels")


# -- two processes ---------------------------------------------------------------------------


def _band(x: torch.Tensor, rank: int, split: list[int], axis: int) -> torch.Tensor:
    start = sum(split[:rank])
    return x.narrow(axis, start, split[rank])


def _settled(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, metric: str, mask_a: Any) -> torch.Tensor:
    """(Na, k) True where the pick's reverse pass (its best allowed row of a) has no near-tie:
    there, the mutual filter cannot go either way."""
    back = reference_scores(b, a, metric)
    if mask_a is not None:
        back[:, ~mask_a.reshape(-1)] = -torch.inf
    sure = decided(back, tolerance(b, a, metric))
    return sure[index.clamp_min(0)] | (index < 0)


def _check_match(
    report: list[str],
    name: str,
    got: Any,
    want: Any,
    a: torch.Tensor,
    b: torch.Tensor,
    metric: str,
    mask_a: Any = None,
):
    """Indices equal (near-ties aside); scores and coords equal where the indices are; valid
    equal where the picks are the same and their reverse pass has no near-tie."""
    try:
        items = a.shape[0] if a.ndim == 4 else 1  # a batch of maps, else one map or list
        for i in range(items):
            ai = a[i] if a.ndim == 4 else a
            bi = b[i] if b.ndim == 4 else b
            fa, fb = ai.reshape(-1, ai.shape[-1]), bi.reshape(-1, bi.shape[-1])
            gi, wi = (got.index[i], want.index[i]) if a.ndim == 4 else (got.index, want.index)
            gi, wi = gi.reshape(fa.shape[0], -1), wi.reshape(fa.shape[0], -1)
            assert_same_up_to_ties(fa, fb, gi, wi, metric)
            vg, vw = (got.valid[i], want.valid[i]) if a.ndim == 4 else (got.valid, want.valid)
            mi = None if mask_a is None else (mask_a[i] if mask_a.ndim == ai.ndim else mask_a)
            settled = (gi == wi) & _settled(fa, fb, wi, metric, mi)
            assert settled.float().mean() > 0.5, "too few settled picks to compare"
            assert torch.equal(vg.reshape(settled.shape)[settled], vw.reshape(settled.shape)[settled]), "valid differs"
        same = got.index == want.index
        torch.testing.assert_close(got.score[same], want.score[same], equal_nan=True)
        if getattr(want, "coords", None) is not None:
            assert torch.equal(got.coords[same], want.coords[same]), "coords differ"
    except AssertionError as err:
        report.append(f"{name}: {err}")


def _match_cases(rank: int, report: list[str]) -> None:
    from skimage import data

    dm = densematch.distributed
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(9, 7, 5, generator=g), torch.randn(8, 6, 5, generator=g)
    for metric in METRICS:
        for k in (1, 3):
            want = densematch.match(a, b, metric=metric, k=k)
            _check_match(report, f"queries {metric} k={k}", dm.match(a, b, metric=metric, k=k), want, a, b, metric)
            for split in ([3, 5], [8, 0]):  # uneven bands, then an empty band
                band = _band(b, rank, split, 0)
                got = dm.match(a, band, shard="references", metric=metric, k=k)
                _check_match(report, f"references {split} {metric} k={k}", got, want, a, b, metric)
    # filters, masks, batches, the chw and flat layouts
    ma, mb = torch.rand(9, 7, generator=g) < 0.7, torch.rand(8, 6, generator=g) < 0.6
    for kw in (dict(mutual=True), dict(ratio=0.9), dict(mutual=True, ratio=0.95, k=2), dict(metric="l2", mutual=True)):
        want = densematch.match(a, b, mask_a=ma, mask_b=mb, **kw)
        got = dm.match(a, b, mask_a=ma, mask_b=mb, **kw)
        _check_match(report, f"queries masked {kw}", got, want, a, b, kw.get("metric", "cosine"), ma)
        got = dm.match(
            a, _band(b, rank, [5, 3], 0), shard="references", mask_a=ma, mask_b=_band(mb, rank, [5, 3], 0), **kw
        )
        _check_match(report, f"references masked {kw}", got, want, a, b, kw.get("metric", "cosine"), ma)
    ab, bb = torch.randn(2, 6, 5, 4, generator=g), torch.randn(2, 7, 4, 4, generator=g)
    want = densematch.match(ab, bb, mutual=True, k=2)
    _check_match(report, "queries batch", dm.match(ab, bb, mutual=True, k=2), want, ab, bb, "cosine")
    got = dm.match(ab, _band(bb, rank, [2, 5], 1), shard="references", mutual=True, k=2)
    _check_match(report, "references batch", got, want, ab, bb, "cosine")
    ac, bc = a.permute(2, 0, 1), b.permute(2, 0, 1)
    want = densematch.match(ac, bc, layout="chw", metric="l2")
    got = dm.match(ac, _band(bc, rank, [4, 4], 1), shard="references", layout="chw", metric="l2")
    _check_match(report, "references chw", got, want, a, b, "l2")
    af, bf = a.reshape(-1, 5), b.reshape(-1, 5)
    want = densematch.match(af, bf, layout="flat", k=2, ratio=0.9)
    got = dm.match(af, _band(bf, rank, [17, 31], 0), shard="references", layout="flat", k=2, ratio=0.9)
    _check_match(report, "references flat", got, want, af, bf, "cosine")
    # real features: patches of two overlapping crops of a photograph
    cam = data.camera()
    fa, fb = patch_features(cam[200:232, 200:240]), patch_features(cam[204:236, 195:235])
    for kw in (dict(), dict(metric="l2", k=2, mutual=True), dict(ratio=0.8)):
        want = densematch.match(fa, fb, **kw)
        metric = kw.get("metric", "cosine")
        _check_match(report, f"queries camera {kw}", dm.match(fa, fb, **kw), want, fa, fb, metric)
        got = dm.match(fa, _band(fb, rank, [13, 19], 0), shard="references", **kw)
        _check_match(report, f"references camera {kw}", got, want, fa, fb, metric)


def _per_pixel(t: torch.Tensor, k: int) -> torch.Tensor:
    """nearest_prototype's (N, k, H, W) or (N, H, W) as (N*H*W, k), in x's pixel order."""
    return t.reshape(t.shape[0], k, -1).transpose(1, 2).reshape(-1, k)


def _nearest_cases(rank: int, report: list[str]) -> None:
    dm = densematch.distributed
    g = torch.Generator().manual_seed(4)
    x, p = torch.randn(2, 6, 5, 7, generator=g), torch.randn(23, 6, generator=g)
    for metric in METRICS:
        for k in (1, 4):
            want = densematch.nearest_prototype(x, p, metric=metric, k=k)
            for shard, mine in (("pixels", p), ("prototypes", _band(p, rank, [9, 14], 0))):
                try:
                    d, i = dm.nearest_prototype(x, mine, metric=metric, k=k, shard=shard)
                    rows = x.permute(0, 2, 3, 1).reshape(-1, 6)
                    assert_same_up_to_ties(rows, p, _per_pixel(i, k), _per_pixel(want[1], k), metric)
                    same = i == want[1]
                    torch.testing.assert_close(d[same], want[0][same])
                except AssertionError as err:
                    report.append(f"nearest {shard} {metric} k={k}: {err}")
    try:  # an empty slice of the bank
        d, i = dm.nearest_prototype(x, _band(p, rank, [23, 0], 0), metric="l2", k=2)
        want = densematch.nearest_prototype(x, p, metric="l2", k=2)
        rows = x.permute(0, 2, 3, 1).reshape(-1, 6)
        assert_same_up_to_ties(rows, p, _per_pixel(i, 2), _per_pixel(want[1], 2), "l2")
    except AssertionError as err:
        report.append(f"nearest empty slice: {err}")


def _rescaled(a: torch.Tensor, rank: int) -> torch.Tensor:
    """``a`` with pixel (0, 0)'s three channels scaled by 2, 1/4 and 2 on rank 1."""
    if rank == 0:
        return a
    out = a.clone()
    out[0, 0] *= torch.tensor([2.0, 0.25, 2.0])
    return out


def _failure_cases(rank: int, report: list[str]) -> None:
    dm = densematch.distributed
    a, b = torch.randn(6, 5, 3), torch.randn(6, 5, 3)
    band = _band(b, rank, [3, 3], 0).clone()
    if rank == 1:
        band[0, 0, 0] = float("nan")
    cases = [
        ("NaN in rank 1's band", lambda: dm.match(a, band, shard="references"), ValueError, "(rank 1 of 2)"),
        (
            "C mismatch on rank 0",
            lambda: dm.match(a if rank else a[..., :2], b),
            ValueError,
            "same number of channels C, got 2 and 3 (rank 0 of 2)",
        ),
        (
            "bands of two widths",
            lambda: dm.match(a, b[:3, : 4 + rank], shard="references"),
            ValueError,
            "one width",
        ),
        # ranks that disagree on what must be the same: one ValueError on every rank, before
        # any exchange (these merged silently, or aborted one rank inside gloo)
        ("a differs on rank 1", lambda: dm.match(a + 1e-7 * rank, b), ValueError, "same a (checksum)"),
        # one pixel's channels scaled by 2, 1/4 and 2: exponents +1, -2, +1, which a linear
        # checksum of the bits (even weighted by position) does not see
        ("a's pixel rescaled on rank 1", lambda: dm.match(_rescaled(a, rank), b), ValueError, "same a (checksum)"),
        ("mask_b differs", lambda: dm.match(a, b, mask_b=b[..., 0] > rank - 0.5), ValueError, "mask_b (checksum)"),
        (
            "metric differs",
            lambda: dm.match(a, b[3 * rank : 3 * rank + 3], shard="references", metric=METRICS[rank]),
            ValueError,
            "metric",
        ),
        ("k differs", lambda: dm.match(a, b, k=1 + rank), ValueError, "same k"),
        ("a's size differs", lambda: dm.match(a[: 5 + rank], b), ValueError, "a's grid"),
        (
            "x differs",
            lambda: dm.nearest_prototype(a[None].permute(0, 3, 1, 2) * (1 + rank), b[0], shard="pixels"),
            ValueError,
            "x (checksum)",
        ),
        (
            "k differs over a split bank",
            lambda: dm.nearest_prototype(a[None].permute(0, 3, 1, 2), b[rank], k=1 + rank),
            ValueError,
            "same k",
        ),
    ]
    for name, call, error, text in cases:
        try:
            call()
            report.append(f"{name}: no error")
        except error as err:
            if text not in str(err):
                report.append(f"{name}: {err}")
    # a rank that never comes: the other one fails within the timeout, naming it
    if rank == 0:
        t = time.perf_counter()
        try:
            dm.match(a, b, timeout=2.0)
            report.append("absent rank: no error")
        except RuntimeError as err:
            named = "lost the other ranks" in str(err) and "1" in str(err).split("lost the other ranks")[1]
            if not named or time.perf_counter() - t > 30:
                report.append(f"absent rank: {err} after {time.perf_counter() - t:.1f} s")
    else:
        time.sleep(5)


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    report: list[str] = []
    for cases in (_match_cases, _nearest_cases, _failure_cases):
        try:
            cases(rank, report)
        except Exception as err:  # a crash of one group of cases is reported, not hidden
            report.append(f"{cases.__name__} crashed: {type(err).__name__}: {err}")
            break
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # the absent-rank case leaves the group unusable: skip its teardown


@pytest.mark.slow
def test_two_processes_give_what_one_gives():
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        torch.multiprocessing.start_processes(_worker, args=(init, tmp), nprocs=WORLD, start_method="spawn")
        reports = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(WORLD)]
    assert reports == [[]] * WORLD, "\n".join(f"rank {r}: {line}" for r, rep in enumerate(reports) for line in rep)


@pytest.mark.slow
def test_torchrun_command_writes_what_the_plain_command_writes(tmp_path, camera_small):
    from PIL import Image

    Image.fromarray(camera_small[:40, :48]).save(tmp_path / "a.png")
    Image.fromarray(camera_small[3:43, 2:50]).save(tmp_path / "b.png")
    common = ["match", "a.png", "b.png", "--features", "patch", "--mutual", "--k", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "-m", "densematch"]
    done = subprocess.run([*run, *common, "-o", "sharded.npz"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("matched 40x48") == 1, done.stdout  # sharded: rank 0 alone reports
    plain = subprocess.run(
        [sys.executable, "-m", "densematch", *common, "-o", "plain.npz"], cwd=tmp_path, capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stderr
    with np.load(tmp_path / "sharded.npz") as s, np.load(tmp_path / "plain.npz") as p:
        got, want = {n: torch.from_numpy(s[n]) for n in s.files}, {n: torch.from_numpy(p[n]) for n in p.files}
    assert sorted(got) == sorted(want)
    # the processes ran other thread counts and tile sizes: near-ties may go either way
    fa = dense_features(np.asarray(Image.open(tmp_path / "a.png")) / 255.0, "patch").reshape(-1, 49)
    fb = dense_features(np.asarray(Image.open(tmp_path / "b.png")) / 255.0, "patch").reshape(-1, 49)
    assert_same_up_to_ties(fa, fb, got["index"], want["index"], "cosine")
    same = got["index"] == want["index"]
    torch.testing.assert_close(got["score"][same], want["score"][same])
    assert torch.equal(got["coords"][same], want["coords"][same])
    # mutual: a pixel's validity may differ only where its picks or the reverse pass had a near-tie
    back_decided = decided(reference_scores(fb, fa, "cosine"), tolerance(fb, fa, "cosine"))
    settled = same.reshape(-1, 2).all(1) & back_decided[want["index"].reshape(-1, 2)].all(1)
    assert torch.equal(got["valid"].reshape(-1, 2)[settled], want["valid"].reshape(-1, 2)[settled])
    assert settled.float().mean() > 0.9


@pytest.mark.slow
def test_torchrun_takes_the_placing_options_and_aligns_once(tmp_path, camera_small):
    # --refine, --stride, --offset and --exclude-radius used to be refused by every process with
    # torchrun's traceback; align ran the whole job on every process and printed it twice
    from PIL import Image

    Image.fromarray(camera_small[:40, :48]).save(tmp_path / "a.png")
    Image.fromarray(camera_small[3:43, 2:50]).save(tmp_path / "b.png")
    placing = ["--refine", "parabola", "--stride", "2", "--offset", "0.5", "--ratio", "0.95", "--exclude-radius", "2"]
    common = ["match", "a.png", "b.png", "--features", "patch", *placing]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "-m", "densematch"]
    done = subprocess.run([*run, *common, "-o", "sharded.npz"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    plain = subprocess.run(
        [sys.executable, "-m", "densematch", *common, "-o", "plain.npz"], cwd=tmp_path, capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stderr
    with np.load(tmp_path / "sharded.npz") as s, np.load(tmp_path / "plain.npz") as p:
        same = s["index"] == p["index"]
        assert same.mean() > 0.9
        np.testing.assert_allclose(s["coords"][same], p["coords"][same], atol=1e-5)
        assert (
            np.array_equal(s["valid"][same], p["valid"][same]) or (s["valid"][same] != p["valid"][same]).mean() < 0.02
        )
    Image.fromarray(camera_small[8:40, 8:40]).save(tmp_path / "t.png")
    Image.fromarray(camera_small).save(tmp_path / "i.png")
    done = subprocess.run(
        [*run, "align", "t.png", "i.png", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("scale_h") == 1, done.stdout
