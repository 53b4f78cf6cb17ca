"""Exact means exact: every search path (tests/_paths.py) against a float64 brute force, on the
inputs that break caps and expansions: clusters far from the references' mean, more exact ties
than any candidate list holds, duplicated and mirrored rows, quantised descriptors of a real
photo, and drawn ones. Near-ties are judged by tests/_reference.py's one helper."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch import engine
from densematch.precision import CANDIDATES, Precision

from .._paths import PATHS, TORCH_PATHS, on_device, on_path
from .._reference import (
    MATRIX,
    assert_exact_ties_lowest,
    assert_same_up_to_ties,
    assert_topk_exact,
    reference_scores_exact,
)
from .._threads import torch_threads


def flat_match(a, b, metric, k, path, **kw):
    """match on the path ``path``, on the run's device (``pytest --device``); the result on the CPU."""
    a, b = on_device(a, b)
    with on_path(path, metric) as precision:
        r = densematch.match(a, b, metric=metric, k=k, layout="flat", precision=precision, **kw)
    return densematch.Matches(r.index.cpu(), None, r.score.cpu(), r.valid.cpu())


def clustered(na, nb, c, seed, spread=0.01, scale=10.0):
    """Rows in four tight clusters far from the origin and from the references' mean: every
    member of a cluster lies inside the expansion's rounding slack of every other."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, c, generator=g) * scale
    b = centres[torch.randint(0, 4, (nb,), generator=g)] + spread * torch.randn(nb, c, generator=g)
    a = centres[torch.randint(0, 4, (na,), generator=g)] + spread * torch.randn(na, c, generator=g)
    return a, b


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("metric", "k"), [("l2", 1), ("sqeuclidean", 3), ("l2", 8)])
def test_clustered_features_far_from_the_mean(path, metric, k):
    # issue 27's reproduction (400 x 1500 there; fewer rows under the kernel's interpreter)
    kernel = path.startswith("kernel")
    a, b = clustered(60 if kernel else 400, 300 if kernel else 1500, 2, seed=0)
    r = flat_match(a, b, metric, k, path)
    assert_topk_exact(a, b, r.index, metric, k)


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_clustered_wide_features(path):
    a, b = clustered(200, 1200, 64, seed=1)
    r = flat_match(a, b, "l2", 1, path)
    assert_topk_exact(a, b, r.index, "l2", 1)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "dot"])
def test_more_exact_ties_than_any_candidate_list(path, metric):
    # a few distinct integer rows, each repeated more often than the cap: each query's 8 best
    # are exact ties among the copies of its best row, and must be the 8 lowest of them
    kernel = path.startswith("kernel")
    cap = Precision().cap(8, 12 * 100)  # the cap for as many references as below, or more
    for seed in range(1 if kernel else 4):  # the kernel under Triton's interpreter: ~5 s a seed
        g = torch.Generator().manual_seed(seed)
        distinct = torch.randint(0, 3, (12, 6), generator=g).float()
        b = distinct.repeat(cap + 10, 1)[torch.randperm(12 * (cap + 10), generator=g)]
        a = torch.randint(0, 3, (40 if kernel else 300, 6), generator=g).float()
        ref = reference_scores_exact(a, b, metric)
        kth = ref.sort(dim=1, descending=True).values[:, 7:8]
        assert int((ref >= kth).sum(1).min()) > cap  # every row's candidates overrun the cap
        r = flat_match(a, b, metric, 8, path)
        assert_exact_ties_lowest(a, b, r.index, metric, 8)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("k", [1, 3])
def test_duplicated_references(path, k):
    # every reference twice: the best's duplicate ties it exactly and must follow it (k=3)
    g = torch.Generator().manual_seed(0)
    n = 80 if path.startswith("kernel") else 350
    d = torch.randn(n, 1, generator=g)
    b = torch.cat([d, d])[torch.randperm(2 * n, generator=g)]
    a = d[torch.randint(0, n, (n,), generator=g)] + 0.3 * torch.randn(n, 1, generator=g)
    r = flat_match(a, b, "l2", k, path)
    assert_topk_exact(a, b, r.index, "l2", k)
    assert_exact_ties_lowest(a, b, r.index, "l2", k)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean"])
def test_mirrored_integer_rows(path, metric):
    # each query q's near neighbour r and its mirror 2q - r are exactly as far from q
    g = torch.Generator().manual_seed(2)
    n, c = (30, 32) if path.startswith("kernel") else (200, 128)
    q = torch.randint(-20, 21, (n, c), generator=g).float()
    r = q + torch.randint(-1, 2, (n, c), generator=g).float()
    b = torch.cat([r, 2 * q - r, torch.randint(-20, 21, (n, c), generator=g).float()])
    b = b[torch.randperm(b.shape[0], generator=g)]
    got = flat_match(q, b, metric, 1, path)
    ref = reference_scores_exact(q, b, metric)
    assert ((ref == ref.max(1, keepdim=True).values).sum(1) >= 2).float().mean() > 0.9  # rows tie
    assert_exact_ties_lowest(q, b, got.index, metric, 1)


@pytest.fixture(scope="module")
def quantised_sift():
    """Dense SIFT of a real photo and of a shifted, noisier copy, quantised as SIFT files store
    it (x 512, rounded): integer rows, whose squared distances float32 holds exactly."""
    pytest.importorskip("kornia")
    from skimage import data

    from densematch.app.features import dense_features

    img = data.camera().astype(np.float32) / 255
    noisy = img + np.random.default_rng(0).normal(0, 0.02, img.shape).astype(np.float32)
    one = dense_features(img[100:164, 100:164], "dsift").reshape(-1, 128)
    two = dense_features(noisy[103:167, 98:162], "dsift").reshape(-1, 128)
    return (one * 512).round().detach(), (two * 512).round().detach()


@pytest.mark.parametrize("path", TORCH_PATHS)
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "dot", "l1"])
def test_exact_ties_go_to_the_lowest_index(quantised_sift, path, metric):
    g = torch.Generator().manual_seed(0)
    d, other = quantised_sift
    # every reference twice, shuffled: each query's best has an exact duplicate elsewhere
    b = torch.cat([d, d])[torch.randperm(2 * d.shape[0], generator=g)]
    a = other[torch.randperm(other.shape[0], generator=g)[:500]]
    # a small budget: many reference tiles, so duplicates meet in different products
    r = flat_match(a, b, metric, 2, path, memory="2MiB")
    if metric == "cosine":  # a cosine of integer rows is not exact in float64: near-ties judge
        ref = reference_scores_exact(a, b, metric)
        assert_same_up_to_ties(a, b, r.index, ref.topk(2, dim=1).indices, metric)
        return
    assert_exact_ties_lowest(a, b, r.index, metric, 2)


@pytest.mark.parametrize("path", TORCH_PATHS)
@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "l1"])
def test_exact_ties_between_different_rows_go_to_the_lowest_index(quantised_sift, path, metric):
    # each query's true nearest descriptor r and its mirror 2q - r are exactly as far from q:
    # an expansion rounds the two distances differently, the direct form does not
    d, other = quantised_sift
    a = other[:400]
    nearest = reference_scores_exact(a, d, metric).argmax(1)
    b = torch.cat([d, 2 * a - d[nearest]])
    b = b[torch.randperm(b.shape[0], generator=torch.Generator().manual_seed(1))]
    r = flat_match(a, b, metric, 1, path)
    ref = reference_scores_exact(a, b, metric)
    assert ((ref == ref.max(1, keepdim=True).values).sum(1) >= 2).float().mean() > 0.5  # most rows tie
    assert_exact_ties_lowest(a, b, r.index, metric, 1)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("metric", MATRIX)
def test_real_photo_features(camera_small, path, metric):
    from .._reference import patch_features

    f = patch_features(camera_small)
    n = 12 if path.startswith("kernel") else 40
    a, b = f[:n, :n].reshape(-1, 25), f[2 : n + 2, 1 : n + 1].reshape(-1, 25)
    r = flat_match(a, b, metric, 2, path)
    assert_topk_exact(a, b, r.index, metric, 2)


@settings(max_examples=30, deadline=None)
@given(
    na=st.integers(1, 40),
    nb=st.integers(1, 90),
    c=st.integers(1, 9),
    k=st.integers(1, 9),
    levels=st.integers(1, 4),
    offset=st.sampled_from([0.0, 50.0, 5000.0]),
    metric=st.sampled_from(["l2", "sqeuclidean", "dot"]),
    path=st.sampled_from(TORCH_PATHS),
    candidates=st.sampled_from([1, 4, CANDIDATES]),
    tile_b=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_integer_rows_on_every_path(na, nb, c, k, levels, offset, metric, path, candidates, tile_b, seed):
    # integer rows of few levels, optionally far from the origin: ties everywhere, exact in
    # float64; any cap, any tile, every path keeps them exact
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, levels + 1, (na, c), generator=g).double() + offset
    b = torch.randint(0, levels + 1, (nb, c), generator=g).double() + offset
    if metric == "dot":
        a, b = a - offset, b - offset  # dot products of large rows leave float32's integers
    a, b = a.float(), b.float()
    k = min(k, nb)
    _, config = PATHS[path]
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config["half"])
    precision = Precision(half=half, backend="torch", candidates=candidates)
    with on_path(path):  # the config's kernel setting chooses between the C and torch steps
        _, got = engine.topk(a, b, metric=metric, k=k, budget=2**26, precision=precision, tiles=(None, tile_b))
    assert_exact_ties_lowest(a, b, got, metric, k)


@pytest.fixture(scope="module")
def same_scene():
    """Two overlapping crops of the astronaut as raw colour patches (issue 39's hard case): in
    every smooth region dozens of references lie within bfloat16's bound of the best."""
    from densematch.app.synthetic import same_scene_pair

    return same_scene_pair(28, 28, 64)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("metric", "k"), [("cosine", 1), ("dot", 8), ("l2", 1), ("l2", 8)])
def test_same_scene_features(same_scene, path, metric, k):
    fa, fb = same_scene
    n = 10 if path.startswith("kernel") else 28
    a, b = fa[:n, :n].reshape(-1, 64), fb[:n, :n].reshape(-1, 64)
    r = flat_match(a, b, metric, k, path)
    assert_topk_exact(a, b, r.index, metric, k)


@pytest.mark.parametrize("path", TORCH_PATHS)
@pytest.mark.parametrize(("metric", "k"), [("cosine", 1), ("l2", 8)])
def test_same_scene_features_on_two_worker_threads(path, metric, k):
    # 2304 query rows: enough for a CPU search to share its query tiles out over two workers,
    # each path with its own shares, reference tiles and set-up blocks (issue 39)
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(48, 48, 32)
    a, b = fa.reshape(-1, 32), fb.reshape(-1, 32)
    with torch_threads(2):
        assert engine.driver.tile_workers(a.device, a.shape[0]) == 2
        r = flat_match(a, b, metric, k, path)
    assert_topk_exact(a, b, r.index, metric, k)


@pytest.mark.parametrize("path", TORCH_PATHS)
@pytest.mark.parametrize(("metric", "k"), [("cosine", 1), ("l2", 8)])
def test_same_scene_under_a_budget_too_small_for_64_query_rows(same_scene, monkeypatch, path, metric, k):
    # the planner's largest-tile rule (engine/plan.py): each query row's pool and re-scoring
    # leave no room for 64 rows beside any reference tile, so the widest tile tried is taken
    from densematch.engine import driver

    plans = []
    real = driver.fit_tiles
    monkeypatch.setattr(driver, "fit_tiles", lambda *args, **kw: plans.append(real(*args, **kw)) or plans[-1])
    fa, fb = same_scene
    a, b = fa.reshape(-1, 64), fb.reshape(-1, 64)
    r = flat_match(a, b, metric, k, path, memory="256KiB")
    assert plans and all(p.tile_a < 64 and p.tile_b > 1 for p in plans), plans
    assert_topk_exact(a, b, r.index, metric, k)


@pytest.mark.parametrize(
    ("kernel", "metric", "k"),
    [(kernel, metric, k) for kernel in ("auto", "torch") for metric, k in (("cosine", 1), ("cosine", 8), ("l2", 1))]
    + [("triton", "cosine", 1)],  # the interpreter: one case
)
def test_same_scene_rows_over_the_cap_are_searched_again_exactly(same_scene, kernel, metric, k):
    # a small cap and narrow tiles: many rows overrun their lists and are searched again from
    # float32 products, whose own near-ties go through the float32 settling and its resolution
    # (C step, torch step, and the fused kernel under Triton's interpreter)
    if kernel == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: the kernel path cannot run here")
    fa, fb = same_scene
    n = 12 if kernel == "triton" else 28
    a, b = fa[:n, :n].reshape(-1, 64), fb[:n, :n].reshape(-1, 64)
    stats: dict[str, int] = {}
    precision = Precision(half=torch.bfloat16, backend=kernel, candidates=2)
    with densematch.config_context(kernel=kernel):
        _, got = engine.topk(a, b, metric=metric, k=k, budget=2**26, precision=precision, stats=stats, tiles=(96, 160))
    if metric == "cosine":  # l2 tells these patches apart by brightness: few rows overrun
        assert stats["fallback"] > 0.2 * stats["rows"]
    assert_topk_exact(a, b, got, metric, k)
    _, want = engine.topk(a, b, metric=metric, k=k, budget=2**26, precision=Precision(candidates=2))
    assert_same_up_to_ties(a, b, got, want, metric)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize(("metric", "k"), [("cosine", 1), ("cosine", 8), ("l2", 1)])
def test_a_few_rows_over_the_cap_are_searched_again_uncapped(same_scene, monkeypatch, kernel, metric, k):
    # a handful of same-scene rows among noise: the few that overrun are searched again with
    # every reference in one product and every candidate listed (no cap, no second pass)
    from densematch.engine.half import HalfSearch

    fa, fb = same_scene
    a, b = fa.reshape(-1, 64), fb.reshape(-1, 64)
    g = torch.Generator().manual_seed(0)
    q = torch.cat([a[:12], a.mean(0) + a.std() * torch.randn(500, 64, generator=g)])
    caps: list[int | None] = []
    rank_exact = HalfSearch._rank_exact

    def spy(self, *args):  # type: ignore[no-untyped-def]
        caps.append(args[7] if len(args) > 7 else None)
        return rank_exact(self, *args)

    monkeypatch.setattr(HalfSearch, "_rank_exact", spy)
    stats: dict[str, int] = {}
    precision = Precision(half=torch.bfloat16, backend=kernel)
    with densematch.config_context(kernel=kernel):
        _, got = engine.topk(q, b, metric=metric, k=k, budget=2**26, precision=precision, stats=stats)
    assert 0 < stats["fallback"] <= 12 and caps and set(caps) == {b.shape[0]}
    assert_topk_exact(q, b, got, metric, k)
    _, want = engine.topk(q, b, metric=metric, k=k, budget=2**26)
    assert_same_up_to_ties(q, b, got, want, metric)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize(("metric", "k"), [("cosine", 1), ("cosine", 8)])
def test_rows_searched_again_share_the_lists_room(same_scene, monkeypatch, kernel, metric, k):
    # many rows over a small cap, searched again with the same share of the tile's list spread
    # over them (more candidates each than the scan's cap); rows tied with more references than
    # even that (one reference copied 300 times, those rows' own patch) are resolved without a cap
    from densematch.engine import half
    from densematch.engine.half import HalfSearch

    fa, fb = same_scene
    a, b = fa.reshape(-1, 64).clone(), fb.reshape(-1, 64)
    b = torch.cat([b, b[100].expand(300, 64)])
    a[::50] = b[100]
    seen: list[tuple[int, int, int, int]] = []
    resolved: list[int] = []
    rank_exact, resolve = HalfSearch._rank_exact, HalfSearch._resolve

    def spy(self, q, *args):  # type: ignore[no-untyped-def]
        seen.append((self.cap_rows, q.shape[0], args[6], args[5]))
        return rank_exact(self, q, *args)

    def spy_resolve(self, q, *args):  # type: ignore[no-untyped-def]
        resolved.append(q.shape[0])
        return resolve(self, q, *args)

    monkeypatch.setattr(HalfSearch, "_rank_exact", spy)
    monkeypatch.setattr(HalfSearch, "_resolve", spy_resolve)
    stats: dict[str, int] = {}
    precision = Precision(half=torch.bfloat16, backend=kernel, candidates=8 * k)
    tile_a = 196
    with densematch.config_context(kernel=kernel):
        _, got = engine.topk(
            a, b, metric=metric, k=k, budget=2**26, precision=precision, stats=stats, tiles=(tile_a, 512)
        )
    assert stats["fallback"] > 0 and seen
    for cap_rows, rows, cap, width in seen:
        assert cap_rows == 8 * k and width < b.shape[0]  # (not the few rows' single product)
        assert cap == min(b.shape[0], max(cap_rows, int(half._UNCAPPED_SHARE * tile_a * cap_rows) // rows))
    assert any(cap > 8 * k for _, _, cap, _ in seen)
    assert sum(resolved) >= len(range(0, a.shape[0], 50))  # the tied rows at least
    assert_topk_exact(a, b, got, metric, k)
    _, want = engine.topk(a, b, metric=metric, k=k, budget=2**26, precision=Precision(candidates=8 * k))
    assert_same_up_to_ties(a, b, got, want, metric)


@pytest.mark.parametrize("path", TORCH_PATHS)
@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_zero_query_rows_tie_every_reference(path, metric):
    # a black patch's row scores an exact 0 against every reference: far more ties than any
    # cap, settled from the products themselves, to the lowest indices, beside ordinary rows
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3 * Precision().cap(8, 900), 16, generator=g)
    a = torch.randn(40, 16, generator=g)
    a[::4] = 0
    r = flat_match(a, b, metric, 8, path)
    assert torch.equal(r.index[::4], torch.arange(8).expand(10, 8))
    assert_topk_exact(a, b, r.index, metric, 8)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_zero_query_rows_skip_references_that_are_not_finite(kernel, metric):
    # the engine takes references the public functions refuse: against a NaN or infinite one, a
    # zero row's product is NaN, which never ranks, so its top k are the first finite references
    # (found without a product: Strategy._first_finite)
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3 * Precision().cap(8, 900), 16, generator=g)
    b[0], b[2, 3], b[5, 0] = math.nan, math.inf, -math.inf
    a = torch.randn(40, 16, generator=g)
    a[::4] = 0
    with densematch.config_context(kernel=kernel):
        v, got = engine.topk(a, b, metric=metric, k=8, budget=2**26)
    assert torch.equal(got[::4], torch.tensor([1, 3, 4, 6, 7, 8, 9, 10]).expand(10, 8))
    assert bool((v[::4] == 0).all())
