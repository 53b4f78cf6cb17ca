"""precision=: the rounding certificate, the certified half-precision search, "fast", the choice."""

import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch import engine, precision
from densematch.engine import driver
from densematch.engine.half import HalfSearch
from densematch.engine.strategy import Strategy
from densematch.kernels import native
from densematch.metrics import get_metric
from densematch.precision import Precision, query_terms, ref_terms, resolve_precision

from .._reference import MATRIX, assert_same_up_to_ties, assert_topk_exact, patch_features, reference_scores
from .._threads import torch_threads

BF16 = Precision(half=torch.bfloat16)

HALVES = [torch.bfloat16, torch.float16]


def photo_pair(camera_small, c=None):
    """Patch features of a photo and of a shifted, noisy copy: (N, C) rows each."""
    img = camera_small.astype(np.float32)
    noisy = np.roll(img, (3, -2), axis=(0, 1)) + np.random.default_rng(0).normal(0, 2, img.shape)
    a = patch_features(img, 7).reshape(-1, 49)
    b = patch_features(noisy.clip(0, 255), 7).reshape(-1, 49)
    return a.contiguous(), b.float().contiguous()


def prepared(x, metric, role, centre=None):
    return get_metric(metric).prepare(x, role, torch.float32, centre)


@pytest.mark.parametrize(
    ("metric", "half"), [(m, torch.bfloat16) for m in MATRIX] + [("cosine", torch.float16)]
)  # float16 operands are only used for unit rows
def test_pair_bounds_hold_for_every_pair(camera_small, metric, half):
    a, b = photo_pair(camera_small)
    a = torch.cat([a[:500], 30 * torch.randn(40, 49)])  # real rows and large noisy ones
    centre = b.mean(0) if metric in ("l2", "sqeuclidean") else None
    q, r = prepared(a, metric, "query", centre), prepared(b, metric, "ref", centre)
    qh, rh = q.to(half), r.to(half)
    half_scores = (qh @ rh.T).double()  # what the torch path ranks by: half products, half output
    u = precision.unit_roundoff(half)
    e = (query_terms(q, qh) @ ref_terms(r, rh).T).double() + u / (1 - u) * half_scores.abs()
    exact = q.double() @ r.double().T
    float32 = q @ r.T
    assert ((half_scores - float32.double()).abs() <= e).all()
    assert ((half_scores - exact).abs() <= e).all()
    # and it is not vacuous: a few units of the half precision's resolution, relative to |a||b|
    scale = q.norm(dim=1, keepdim=True).double() * r.norm(dim=1).double()
    assert (e <= 8 * precision.unit_roundoff(half) * scale + 1e-20).all()


def centred_bounds(q, r, half, centre):
    """The half scores plus bias of prepared rows ``q`` and ``r`` with the queries centred on
    ``centre`` (as HalfSearch forms them) and their per-pair bounds."""
    qc = q - centre
    qh, rh = qc.to(half), r.to(half)
    cross = r @ centre
    terms = ref_terms(r, rh)
    terms[:, 2] += precision.cross_terms(terms, centre, cross, half)
    stored = (qh @ rh.T).double()
    u = precision.unit_roundoff(half)
    rounding = u / (1 - u) * (1 + 2**-12) + 4 * precision.unit_roundoff(torch.float32)
    e = (query_terms(qc, qh, uncentred=q) @ terms.T).double() + rounding * stored.abs()
    return stored + cross.double(), e


@pytest.mark.parametrize("metric", ["cosine", "dot"])
@pytest.mark.parametrize("where", ["mean", "far"])
def test_centred_query_bounds_hold_for_every_pair(camera_small, metric, where):
    # queries less a centre, the centre's products added back in float32: the bound holds
    # for every pair of a photo's rows and of large noisy ones, centred on their mean or on a
    # point far from every row (where the centring only costs)
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(24, 24, 64)
    a = torch.cat([fa.reshape(-1, 64), 30 * torch.randn(40, 64)])
    b = fb.reshape(-1, 64)
    q, r = prepared(a, metric, "query"), prepared(b, metric, "ref")
    r = r - r.mean(0)  # the references' own shift, as HalfSearch makes it
    centre = q[:-40].mean(0) if where == "mean" else 50 * torch.randn(64)
    scores, e = centred_bounds(q, r, torch.bfloat16, centre)
    exact = q.double() @ r.double().T
    assert ((scores - exact).abs() <= e).all()


def test_centred_queries_tighten_the_bound_on_same_scene_features():
    # raw patches of two crops of one photo look alike: less their mean, the rows multiplied
    # are a fraction of their norms, and so is every term of the bound
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(24, 24, 64)
    q, r = prepared(fa.reshape(-1, 64), "cosine", "query"), prepared(fb.reshape(-1, 64), "cosine", "ref")
    r = r - r.mean(0)
    _, centred = centred_bounds(q, r, torch.bfloat16, q.mean(0))
    _, plain = centred_bounds(q, r, torch.bfloat16, torch.zeros(64))
    assert float(centred.median()) < 0.5 * float(plain.median())


def rows_over_the_cap(monkeypatch, switch, metric):
    """Rows of a 48x48x64 same-scene pair searched again in float32 by the certified bfloat16
    search (k=1), with HalfSearch's ``switch`` on and off, each answer checked exact."""
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(48, 48, 64)
    a, b = fa.reshape(-1, 64), fb.reshape(-1, 64)
    over = {}
    for on in (True, False):
        monkeypatch.setattr(HalfSearch, switch, on)
        stats: dict[str, int] = {}
        _, got = engine.topk(a, b, metric=metric, k=1, budget=2**26, precision=BF16, stats=stats)
        assert_topk_exact(a, b, got, metric, 1)
        over[on] = stats["fallback"]
    return over


def test_centred_queries_send_fewer_same_scene_rows_over_the_cap(monkeypatch):
    over = rows_over_the_cap(monkeypatch, "centre_queries", "cosine")
    assert over[True] < 0.5 * over[False]  # 117 and 998 of 2304 rows on an AMD EPYC


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_grouped_references_prepared_per_tile_are_bounded_by_their_grouped_rows(monkeypatch, metric):
    # under a budget too small to prepare every reference once, each tile's bound terms are
    # those of the rows the half product reads (less their group's centre). They were the rows'
    # own, which the centre had been taken from: a bound as large as the centre, every row over
    # the cap and searched again in float32 (the default 1.4x float32's time at 96x96x1536)
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(48, 48, 256)
    a, b = fa.reshape(-1, 256), fb.reshape(-1, 256)
    kept: list[bool] = []
    group_centres = HalfSearch._group_centres

    def spy(self, **kwargs):  # type: ignore[no-untyped-def]
        kept.append(group_centres(self, **kwargs))
        return kept[-1]

    monkeypatch.setattr(HalfSearch, "_group_centres", spy)
    budget = 2**22
    plan = engine.plan_tiles(2304, 2304, 256, 1, budget, metric=metric, device=torch.device("cpu"), precision=BF16)
    assert not plan.whole_b
    stats: dict[str, int] = {}
    _, got = engine.topk(a, b, metric=metric, k=1, budget=budget, precision=BF16, stats=stats)
    assert kept == [True]
    assert stats["fallback"] < 0.1 * stats["rows"] and stats["candidates"] > stats["rows"]  # (151 and 126 of 2304)
    assert_topk_exact(a, b, got, metric, 1)


def grouped_bounds(q, r, centre, centres, offset):
    """Every pair's lower and upper bounds (m, n) from the certified C step, for prepared rows
    ``q`` (m, C) and references ``r`` (n, C; rows ``offset`` onwards) whose half rows are centred
    per group of native.GROUP on ``centres``, with the queries centred on ``centre``, as
    HalfSearch forms them: k and the cap hold every pair, so every lower bound is merged and
    every upper bound listed."""
    from densematch.engine.half import _BIAS_ROUNDING, _GROUP_ROUNDING

    m, n = q.shape[0], r.shape[0]
    first = offset // native.GROUP
    groups = torch.arange(offset, offset + n) // native.GROUP - first
    t = centres[groups]
    d = r - t
    qc = q - centre
    qh, dh = qc.bfloat16(), d.bfloat16()
    cross = r @ centre
    terms = ref_terms(d, dh)
    terms[:, 2] += precision.cross_terms(terms, centre, cross, torch.bfloat16, torch.linalg.vector_norm(r, dim=1))
    terms[:, 2] += _GROUP_ROUNDING * cross.abs()
    qt = query_terms(qc, qh, uncentred=q) * (1 + 2 * _GROUP_ROUNDING)
    largest = torch.zeros(centres.shape[0], 2)
    for col, rows in enumerate((r, d)):
        largest[:, col].scatter_reduce_(0, groups, torch.linalg.vector_norm(rows, dim=1), "amax")
    gq, gt = precision.group_terms(qc, q), precision.group_norms(centres, largest)
    u = precision.unit_roundoff(torch.bfloat16)
    rounding = u / (1 - u) * (1 + 2**-12) + _BIAS_ROUNDING + _GROUP_ROUNDING
    best_v, best_i = torch.full((m, n), -math.inf), torch.full((m, n), -1, dtype=torch.int64)
    listed = native.Candidates(m, n, torch.float32)
    groups = (qc @ centres.T, gq, gt)
    native.merge_certified(qh @ dh.T, offset, best_v, best_i, qt, terms, cross, rounding, listed, groups)
    low = torch.empty(m, n).scatter_(1, best_i - offset, best_v)
    up = torch.empty(m, n).scatter_(1, listed.cols - offset, listed.vals)
    assert bool((listed.counts == n).all()) and not bool(listed.over.any())
    return low.double(), up.double()


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="needs the C kernels")
@pytest.mark.parametrize("metric", ["cosine", "dot"])
@pytest.mark.parametrize("where", ["mean", "far"])
@pytest.mark.parametrize("offset", [0, 7])
def test_grouped_reference_bounds_hold_for_every_pair(metric, where, offset):
    # the references' half rows less their group's centre (the group means, or points far from
    # every row), the queries' products with the centres added back in float32: every pair's
    # bounds hold the exact score, in whole groups and in a tile starting mid-group
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(12, 12, 64)
    a = torch.cat([fa.reshape(-1, 64), 30 * torch.randn(16, 64)])
    q, r = prepared(a, metric, "query"), prepared(fb.reshape(-1, 64), metric, "ref")
    r = r - r.mean(0)
    g = torch.Generator().manual_seed(2)
    count = (offset + r.shape[0] - 1) // native.GROUP - offset // native.GROUP + 1
    ahead = torch.cat([torch.zeros(offset % native.GROUP, 64), r])  # the groups as the whole set has them
    centres = precision.group_centres(ahead, native.GROUP)[:count]
    if where == "far":
        centres = centres + 50 * torch.randn(centres.shape, generator=g)
    low, up = grouped_bounds(q, r, q[:-16].mean(0), centres, offset)
    exact = q.double() @ r.double().T
    assert bool((low <= exact).all()) and bool((exact <= up).all())
    if where == "mean":  # and they are tight where the centres are the groups' means
        assert float((up - low).median()) < 0.05 * float((exact.max(1).values - exact.min(1).values).median())


def test_group_centres_skip_rows_that_are_not_finite():
    r = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    r[5] = float("nan")
    r[40] = float("inf")
    r[64:] = float("nan")  # a group of NaN alone (and the last group's missing rows)
    t = precision.group_centres(r, 32)
    assert t.shape == (3, 3) and bool(torch.isfinite(t).all())
    assert torch.allclose(t[0], torch.cat([r[:5], r[6:32]]).mean(0))
    assert torch.allclose(t[1], torch.cat([r[32:40], r[41:64]]).mean(0))
    assert torch.equal(t[2], torch.zeros(3))
    big = torch.full((32, 2), 3e38)  # a mean whose plain sum would overflow
    assert torch.allclose(precision.group_centres(big, 32), torch.full((1, 2), 3e38))


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="needs the C kernels")
def test_references_are_grouped_only_where_their_neighbours_look_alike(monkeypatch):
    from densematch.app.synthetic import same_scene_pair

    seen = []
    original = HalfSearch._group_centres
    monkeypatch.setattr(HalfSearch, "_group_centres", lambda self, **kw: seen.append(original(self, **kw)) or seen[-1])
    fa, fb = same_scene_pair(32, 32, 64)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1024, 64, generator=g), torch.randn(1024, 64, generator=g)
    for a, b in ((fa.reshape(-1, 64), fb.reshape(-1, 64)), noise):
        _, got = engine.topk(a, b, metric="l2", k=2, budget=2**26, precision=BF16)
        assert_topk_exact(a, b, got, "l2", 2)
    assert seen == [True, False]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("in_c", [True, False])
def test_the_grouping_blocks_leave_the_grouped_references_half_rows_and_terms(monkeypatch, threads, in_c):
    # each worker's block of grouped references leaves its bfloat16 rows and bound terms; they
    # are the ones made from every grouped reference at once (the certificate would stay exact
    # with others, only looser: this checks the blocks themselves), by the one C pass
    # (native.group_rows) or, where it declines a block (not finite), by torch's operators
    from densematch.app.synthetic import same_scene_pair

    searches, passes = [], []
    real = HalfSearch.__init__
    group_rows = native.group_rows

    def spy(self, *args):
        real(self, *args)
        searches.append(self)

    monkeypatch.setattr(HalfSearch, "__init__", spy)
    monkeypatch.setattr(native, "group_rows", lambda *a: passes.append(1) or (group_rows(*a) if in_c else None))
    fa, fb = same_scene_pair(48, 48, 64)
    a, b = fa.reshape(-1, 64), fb.reshape(-1, 64)
    with torch_threads(threads):
        engine.topk(a, b, metric="l2", k=1, budget=2**28, precision=BF16)
    (search,) = searches
    assert search.inputs.workers == threads and search.centres is not None and search.whole is not None
    assert passes  # every block offered to the C pass
    if not in_c:
        assert torch.equal(search.centres, precision.group_centres(search._body(search.whole), native.GROUP))
    grouped = search._grouped(search.whole, 0)
    want_h = grouped.to(torch.bfloat16)
    assert torch.equal(search.whole_h, want_h)
    assert torch.equal(search.whole_t, search._terms(grouped, want_h))


def test_group_products_made_in_blocks_equal_each_tiles_own():
    from densematch.engine.half import _GroupProducts

    g = torch.Generator().manual_seed(0)
    centres, rows = torch.randn(50, 8, generator=g), torch.randn(6, 8, generator=g)
    products = _GroupProducts(centres, tile_b=7)  # blocks of 7 groups
    # outward from the middle on both sides, a tile across two blocks, the last partial block
    for first, last in [(21, 24), (24, 28), (14, 21), (28, 35), (6, 8), (35, 42), (0, 7), (49, 50)]:
        got = products(rows, first, last)
        torch.testing.assert_close(got, rows @ centres[first:last].T)
        assert got.is_contiguous() and len(products.kept) <= 2
    keep = torch.tensor([0, 2, 5])  # rows that went over the cap leave
    products.take(keep)
    for first, last in [(49, 50), (43, 47)]:
        torch.testing.assert_close(products(rows[keep], first, last), rows[keep] @ centres[first:last].T)


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="needs the C kernels")
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_grouped_search_is_exact_over_many_blocks_of_group_products(metric):
    # reference tiles of 40 (not whole groups of 32), so blocks of 40 groups: 72 groups make two
    # blocks, visited from both sides, and rows leave the blocks once over the cap
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(48, 48, 16)
    a, b = fa.reshape(-1, 16), fb.reshape(-1, 16)
    stats: dict[str, int] = {}
    with densematch.config_context(kernel="auto"):
        _, got = engine.topk(
            a, b, metric=metric, k=2, budget=2**26, precision=Precision(half=torch.bfloat16, candidates=8),
            tiles=(300, 40), stats=stats,
        )  # fmt: skip
    assert_topk_exact(a, b, got, metric, 2)
    assert stats["fallback"] > 0  # some rows went over the cap


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="needs the C kernels")
def test_grouped_references_send_fewer_same_scene_rows_over_the_cap(monkeypatch):
    # raw patches under l2 (not normalised): neighbouring references share most of their norm,
    # which the groups' centres take out of the half product
    over = rows_over_the_cap(monkeypatch, "centre_groups", "l2")
    assert over[True] < 0.5 * over[False]  # 130 and 493 of 2304 rows on an AMX Xeon


@pytest.mark.parametrize("metric", MATRIX)
@pytest.mark.parametrize("k", [1, 3])
def test_certified_search_equals_float32_on_a_photo(camera_small, metric, k):
    a, b = photo_pair(camera_small)
    _, want = engine.topk(a, b, metric=metric, k=k, budget=2**28)
    stats: dict[str, int] = {}
    _, got = engine.topk(a, b, metric=metric, k=k, budget=2**28, precision=BF16, stats=stats, tiles=(700, 300))
    assert_same_up_to_ties(a, b, got, want, metric)
    assert_topk_exact(a, b, got, metric, k)
    assert stats["rows"] == a.shape[0] and stats["candidates"] >= k * (a.shape[0] - stats["fallback"])
    # most rows fit; the photo's flat sky, under l2, holds the most near-ties (about 20% overflow)
    assert stats["fallback"] < a.shape[0] // 4


@pytest.mark.parametrize("half", HALVES)
def test_certified_search_on_noise(half):
    a, b = torch.randn(300, 40), torch.randn(450, 40)
    _, want = engine.topk(a, b, metric="cosine", k=2, budget=2**28)
    _, got = engine.topk(a, b, metric="cosine", k=2, budget=2**28, precision=Precision(half=half), tiles=(64, 100))
    assert_same_up_to_ties(a, b, got, want, "cosine")


@pytest.mark.parametrize("metric", MATRIX)
def test_planted_near_ties_far_below_half_resolution(metric):
    # every query has 40 references whose scores differ by ~1e-5 relative: bfloat16 cannot tell
    # them apart (its resolution is 4e-3), float32 and float64 can, and agree
    g = torch.Generator().manual_seed(7)
    q = torch.randn(25, 32, generator=g)
    q = q / q.norm(dim=1, keepdim=True)
    steps = torch.arange(40, dtype=torch.float32).roll(17)  # the best is not the first
    noise = torch.randn(25, 40, 32, generator=g)
    noise = noise - (noise * q[:, None]).sum(-1, keepdim=True) * q[:, None]  # orthogonal to q
    noise = noise / noise.norm(dim=-1, keepdim=True)
    b = (q[:, None] + (1e-3 * (1 + steps) ** 0.5)[None, :, None] * noise).reshape(-1, 32)
    b = torch.cat([b, torch.randn(300, 32, generator=g)])
    _, want = engine.topk(q, b, metric=metric, k=3, budget=2**28)
    _, got = engine.topk(q, b, metric=metric, k=3, budget=2**28, precision=BF16)
    ref = reference_scores(q, b, metric)
    # the planted steps (~5e-7) sit inside float32's own rounding bound (~2e-6 here): ties
    assert_same_up_to_ties(q, b, got, ref.topk(3, dim=1).indices, metric)
    assert_same_up_to_ties(q, b, got, want, metric)
    plain = prepared(q, metric, "query").bfloat16() @ prepared(b, metric, "ref").bfloat16().T
    assert not torch.equal(plain.float().topk(3, dim=1).indices, want)  # they fool a plain bfloat16 product


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_that_overflow_fall_back_to_float32(monkeypatch, backend):
    # a flat region: 60 references equal to the query up to tiny noise, so every such row has
    # far more candidates than fit; ties in float32 still go to the lowest index
    if backend == "triton":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, 16, generator=g)
    b = torch.cat([base + 1e-6 * torch.randn(60, 16, generator=g), torch.randn(40, 16, generator=g)])
    a = torch.cat([base.repeat(5, 1), torch.randn(20, 16, generator=g)])
    stats: dict[str, int] = {}
    kw = dict(metric="cosine", k=1, budget=2**28, tiles=(16, 32))
    _, want = engine.topk(a, b, **kw, precision=Precision(candidates=4))
    few = Precision(half=torch.bfloat16, backend=backend, candidates=4)
    _, got = engine.topk(a, b, **kw, precision=few, stats=stats)
    assert stats["fallback"] >= 5
    # the 60 near-copies tie within float32's rounding: which one wins depends on the kernel's
    # summation order, and both are right
    assert_same_up_to_ties(a, b, got, want, "cosine")


@pytest.mark.parametrize(
    ("budget", "kernel"), [(60_000, False), (300_000, False), (2**20, False), (100_000, True), (2**20, True)]
)
def test_small_budgets_plan_within_them_and_give_the_same_answer(budget, kernel):
    if kernel:
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(90, 8, generator=g), torch.randn(77, 8, generator=g)
    precision = Precision(half=torch.bfloat16, backend="triton" if kernel else "torch")
    plan = engine.plan_tiles(90, 77, 8, 2, budget, metric=get_metric("l2"), device=a.device, precision=precision)
    assert plan.bytes <= budget
    _, want = engine.topk(a, b, metric="l2", k=2, budget=2**30)
    _, got = engine.topk(a, b, metric="l2", k=2, budget=budget, precision=precision)
    assert_same_up_to_ties(a, b, got, want, "l2")


@settings(max_examples=40, deadline=None)
@given(
    na=st.integers(1, 50),
    nb=st.integers(1, 60),
    c=st.integers(1, 20),
    k=st.integers(1, 4),
    metric=st.sampled_from(MATRIX),
    tiles=st.tuples(st.integers(1, 17), st.integers(1, 17)),
    masked=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_certified_search_property(na, nb, c, k, metric, tiles, masked, scale, seed):
    g = torch.Generator().manual_seed(seed)
    a = scale * torch.randn(na, c, generator=g)
    b = scale * torch.randn(nb, c, generator=g)
    allowed = torch.rand(nb, generator=g) < 0.6 if masked else torch.ones(nb, dtype=torch.bool)
    allowed[0] = True
    rows_b = allowed.nonzero().squeeze(1) if masked else None
    k = min(k, int(allowed.sum()))
    kw = dict(metric=metric, k=k, budget=2**28, rows_b=rows_b)
    _, want = engine.topk(a, b, **kw)
    _, got = engine.topk(a, b, **kw, precision=BF16, tiles=tiles)
    assert_topk_exact(a, b, got, metric, k, allowed_b=allowed)
    assert_same_up_to_ties(a, b, got, want, metric)


class TestPrecisionArgument:
    def test_exact_is_the_default_and_equals_float32_through_match(self, camera_small):
        f = patch_features(camera_small, 5)
        g = torch.roll(f, (2, 3), dims=(0, 1))
        want = densematch.match(f, g, precision="float32", k=2, mutual=True)
        with densematch.config_context(half="bfloat16"):
            got = densematch.match(f, g, k=2, mutual=True)
        assert_same_up_to_ties(
            f.reshape(-1, 25), g.reshape(-1, 25), got.index.reshape(-1, 2), want.index.reshape(-1, 2), "cosine"
        )
        # mutual checks re-rank b against a, whose near-ties may fall either way: rare
        assert (got.valid != want.valid).float().mean() < 0.01

    def test_fast_is_approximate_and_close(self, camera_small):
        a, b = photo_pair(camera_small)
        with densematch.config_context(half="bfloat16"):
            fast = densematch.match(a, b, layout="flat", precision="fast")
        exact = densematch.match(a, b, layout="flat", precision="float32")
        disagree = (fast.index != exact.index).float().mean().item()
        assert 0 < disagree < 0.2
        # scores are recomputed in float32 for whatever was chosen
        direct = get_metric("cosine").pair_value(a, b[fast.index])
        torch.testing.assert_close(fast.score, direct, rtol=0, atol=1e-6)
        assert "approximate" in densematch.match.__doc__

    def test_nearest_prototype_precisions_agree(self):
        x = torch.randn(2, 12, 9, 11)
        p = torch.randn(40, 12)
        want = densematch.nearest_prototype(x, p, metric="l2", k=2, precision="float32")
        with densematch.config_context(half="bfloat16"):
            got = densematch.nearest_prototype(x, p, metric="l2", k=2)
        rows = x.permute(0, 2, 3, 1).reshape(-1, 12)
        assert_same_up_to_ties(rows, p, got[1].permute(0, 2, 3, 1), want[1].permute(0, 2, 3, 1), "l2")
        torch.testing.assert_close(got[0], want[0])

    def test_resolution(self):
        cpu = torch.device("cpu")
        assert resolve_precision("float32", cpu, "cosine").half is None
        assert resolve_precision("float64", cpu, "cosine").dtype == torch.float64
        assert resolve_precision("exact", cpu, "l1").half is None  # no product to speed up
        with densematch.config_context(half="float16"):
            p = resolve_precision("exact", cpu, "cosine")
            assert (p.half, p.certify) == (torch.float16, True)
            assert resolve_precision("fast", cpu, "l2").certify is False
        with densematch.config_context(half="off"):
            assert resolve_precision("exact", cpu, "cosine").half is None

    def test_auto_choice_follows_what_the_device_is(self, monkeypatch):
        # no timing: the same device gives the same path in every process
        cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
        monkeypatch.setattr(precision, "cpu_bf16_unit", lambda: None)
        assert precision.device_half(cpu, "cosine") is None
        assert resolve_precision("exact", cpu, "cosine").half is None
        for unit in ("AMX", "AVX512-BF16"):
            monkeypatch.setattr(precision, "cpu_bf16_unit", lambda unit=unit: unit)
            assert precision.device_half(cpu, "cosine") == torch.bfloat16
            assert precision.device_half(cpu, "l2") == torch.bfloat16
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert precision.device_half(gpu, "cosine") == torch.float16  # unit rows: the tighter bound
        assert precision.device_half(gpu, "l2") == torch.bfloat16
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
        assert precision.device_half(gpu, "cosine") is None  # no tensor cores
        assert "perf_counter" not in inspect.getsource(precision)

    @pytest.mark.parametrize(
        ("probe", "unit"),
        [
            ({"amx_bf16": True, "amx_tile": True, "avx512_bf16": True, "cpu_name": "Intel Xeon"}, "AMX"),
            ({"amx_bf16": False, "amx_tile": False, "avx512_bf16": True, "cpu_name": "AMD EPYC"}, "AVX512-BF16"),
            # an Intel core's bfloat16 products without AMX ran at 0.5-0.6x float32's rate
            ({"amx_bf16": False, "amx_tile": False, "avx512_bf16": True, "cpu_name": "Intel Xeon"}, None),
            ({"avx512_bf16": True, "avx512_fp16": True, "cpu_name": "Intel Xeon"}, None),
            ({"avx512_bf16": True}, None),  # no name: the vendor is unknown, float32 is never slower
            ({"avx512_f": True, "avx512_bf16": False}, None),  # bfloat16 emulated: slower
            ({"avx2": True}, None),
        ],
    )
    def test_the_cpu_unit_for_bfloat16_is_read_from_torchs_probe(self, monkeypatch, probe, unit):
        monkeypatch.setattr(precision, "cpu_capabilities", lambda: probe)
        assert precision.cpu_bf16_unit() == unit
        half = precision.device_half(torch.device("cpu"), "cosine")
        assert half == (torch.bfloat16 if unit else None)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"precision": "half"}, "precision must be one of 'exact', 'float32', 'fast', 'float64'"),
            ({"precision": None}, "precision must be one of"),
        ],
    )
    def test_bad_precision(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            densematch.match(torch.randn(4, 4, 3), torch.randn(4, 4, 3), **kwargs)

    def test_nearest_prototype_takes_no_float64_precision(self):
        # its dtype follows its inputs: float64 inputs are searched in float64
        with pytest.raises(ValueError, match="precision must be one of 'exact', 'float32', 'fast', got 'float64'"):
            densematch.nearest_prototype(torch.randn(1, 3, 4, 4), torch.randn(5, 3), precision="float64")

    def test_bad_settings(self):
        with pytest.raises(ValueError, match="half must be one of 'auto', 'bfloat16', 'float16', 'off'"):
            with densematch.config_context(half="fp8"):
                pass
        with pytest.raises(ValueError, match="kernel must be one of"):
            with densematch.config_context(kernel="cuda"):
                pass
        with pytest.raises(ValueError, match="needs a matrix metric"):
            engine.topk(torch.randn(3, 2), torch.randn(3, 2), metric="l1", k=1, budget=2**20, precision=BF16)
        with pytest.raises(ValueError, match=r"half must be torch\.bfloat16 or torch\.float16 with dtype float32"):
            Precision(dtype=torch.float64, half=torch.bfloat16)

    def test_products_stay_ieee_whatever_the_process_set(self, monkeypatch):
        # TF32 (or bfloat16 on some CPUs) for float32 products, and reduced-precision sums in
        # cuBLAS's half products, would void the results and the bound: the search turns them off
        seen = []
        rank = Strategy.finalise
        cuda = torch.backends.cuda.matmul

        def spy(self, *args):
            seen.append((torch.get_float32_matmul_precision(), cuda.allow_bf16_reduced_precision_reduction))
            return rank(self, *args)

        monkeypatch.setattr(Strategy, "finalise", spy)
        saved = torch.get_float32_matmul_precision(), cuda.allow_bf16_reduced_precision_reduction
        torch.set_float32_matmul_precision("medium")
        cuda.allow_bf16_reduced_precision_reduction = True
        try:
            engine.topk(torch.randn(20, 8), torch.randn(30, 8), metric="dot", k=2, budget=2**26)
            after = torch.get_float32_matmul_precision(), cuda.allow_bf16_reduced_precision_reduction
        finally:
            torch.set_float32_matmul_precision(saved[0])
            cuda.allow_bf16_reduced_precision_reduction = saved[1]
        assert seen == [("highest", False)]
        assert after == ("medium", True)

    def test_settings_nest(self):
        with densematch.config_context(memory="64MiB"), densematch.config_context(half="off"):
            assert densematch.get_config() == {"memory": "64MiB", "half": "off", "kernel": "auto"}
        assert densematch.get_config()["half"] == "auto"


def test_fast_resolves_raw_patch_features_that_all_look_alike(camera_small):
    # raw (not centred) patches: every cosine is near 0.9999, far below bfloat16's resolution
    # unless the references' common part is taken out first (it shifts a row's scores alike)
    x = torch.as_tensor(camera_small, dtype=torch.float32)[None, None] / 255 + 0.5
    p = torch.nn.functional.unfold(x, 7, padding=3)[0].T.contiguous()
    a, b = p[: 64 * 40], p[64 * 8 :]
    want = densematch.match(a, b, layout="flat", precision="float32")
    with densematch.config_context(half="bfloat16"):
        fast = densematch.match(a, b, layout="flat", precision="fast")
        exact = densematch.match(a, b, layout="flat")
    assert (fast.index != want.index).float().mean() < 0.45  # 0.35 here; 0.62 without the shift
    assert_same_up_to_ties(a, b, exact.index, want.index, "cosine")


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean"])
def test_the_l2_column_stays_out_of_the_half_product(metric):
    # -|r|^2 / 2 rounded to bfloat16 (a step of 2 near 384 at C=768) made every row's bound
    # wider than its score gaps: 99-100% of rows were resolved again. Added in float32 as a
    # bias, the candidates are as few as cosine's
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 768, generator=g), torch.randn(500, 768, generator=g)
    stats: dict[str, int] = {}
    _, got = engine.topk(a, b, metric=metric, k=8, budget=2**28, precision=BF16, stats=stats)
    _, want = engine.topk(a, b, metric=metric, k=8, budget=2**28)
    assert stats["fallback"] == 0 and stats["candidates"] / stats["rows"] < 4 * 8
    assert_same_up_to_ties(a, b, got, want, metric)


def test_the_default_cap_grows_with_the_references():
    # the rule: max(32, 8 k, min(nb / 16, 256)), 512 in place of 256 from C=256; an explicit
    # candidates= keeps max(candidates, 8 k)
    p = Precision(half=torch.bfloat16)
    assert [p.cap(1, nb) for nb in (0, 100, 1024, 3200, 9216, 10**7)] == [32, 32, 64, 200, 256, 256]
    assert [p.cap(1, 10**7, c) for c in (0, 64, 255, 256, 1536)] == [256, 256, 256, 512, 512]
    assert p.cap(1, 6400, 256) == 400 and p.cap(1, 6400, 64) == 256
    assert p.cap(8, 100) == 64 and p.cap(80, 10**6) == 640
    assert Precision(candidates=4).cap(1, 10**6) == 8 and Precision(candidates=100).cap(1, 10) == 100


def test_the_grown_cap_is_kept_unless_it_costs_many_more_tiles(monkeypatch) -> None:
    # k=8: the grown cap (nb / 16) needs narrower query tiles than the base cap (8 k) under the
    # same budget; kept where its tile pairs are at most driver._GROWN_CAP_TILES times the base
    # cap's (a row over the cap costs about two float32 product rows, a tile its step), the base
    # cap where the budget binds so hard that it would take many more
    # (the rule at the strategy's own caps: the device's narrower ones left out)
    monkeypatch.setattr(HalfSearch, "narrower_caps", classmethod(lambda cls, *a: None))

    def plan(nb: int, c: int, budget: int, candidates: int | None) -> tuple[int, engine.TilePlan]:
        p = Precision(half=torch.bfloat16, candidates=candidates)
        dims, tiles = driver._plan(
            HalfSearch, nb, nb, c, 8, budget, metric=get_metric("cosine"), device=torch.device("cpu"),
            precision=p, in_dtype=torch.float32, tiles=None, reserved=0,
        )  # fmt: skip
        return dims.cap, tiles

    kept = []
    for nb, c, budget in ((2304, 1536, 2**28), (9216, 64, 2**26), (9216, 64, 2**22), (6400, 256, 2**23)):
        grown, base = BF16.cap(8, nb, c), BF16.cap(8, 0, c)
        wide, narrow = plan(nb, c, budget, grown)[1], plan(nb, c, budget, base)[1]
        assert wide.tile_a <= narrow.tile_a and grown > base
        cheap = driver._tiles(nb, nb, wide) <= driver._GROWN_CAP_TILES * driver._tiles(nb, nb, narrow)
        cap, chosen = plan(nb, c, budget, None)
        assert (cap, chosen) == ((grown, wide) if cheap else (base, narrow))
        kept.append(cheap)
    assert kept == [True, True, False, False]
    assert driver._tiles(9216, 9216, plan(9216, 64, 2**26, BF16.cap(8, 9216, 64))[1]) > driver._tiles(
        9216, 9216, plan(9216, 64, 2**26, BF16.cap(8, 0, 64))[1]
    )  # (kept at more tiles)


def test_the_grown_cap_is_kept_where_workers_take_shares_narrower_than_either_tile(monkeypatch) -> None:
    # two workers split 2304 query rows into shares (HalfSearch.items_per_worker to a worker),
    # under half the budget each: tiles are counted as the shares cut them, so a query tile wider
    # than a share costs the grown cap nothing (at 48x48x1536 same-scene, 1-6% of the rows went
    # over the base cap before)
    from densematch.app.synthetic import same_scene_pair
    from densematch.threads import share_size

    monkeypatch.setattr(HalfSearch, "narrower_caps", classmethod(lambda cls, *a: None))  # (the rule alone)

    def plan(c: int, share: int | None, budget: int) -> tuple[int, engine.TilePlan]:
        dims, tiles = driver._plan(
            HalfSearch, 2304, 2304, c, 1, budget, metric=get_metric("l2"), device=torch.device("cpu"),
            precision=BF16, in_dtype=torch.float32, tiles=None, reserved=0, share=share,
        )  # fmt: skip
        return dims.cap, tiles

    grown = BF16.cap(1, 2304)
    share = share_size(2304, 2, HalfSearch.items_per_worker)
    shared = plan(64, share, 2**25)
    assert shared[0] == grown and shared[1].tile_a >= share
    assert driver._tiles(2304, 2304, shared[1], share) == -(-2304 // share) * -(-2304 // shared[1].tile_b)
    assert driver._tiles(2304, 2304, shared[1]) == -(-2304 // shared[1].tile_a) * -(-2304 // shared[1].tile_b)
    assert plan(1536, None, 2**27)[0] == plan(1536, share, 2**27)[0] == grown  # (2**28 shared by two)
    # and a search on two threads plans with its workers' share: 32 MiB each
    chosen = []
    real = driver._plan

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        chosen.append(got[0].cap)
        return got

    monkeypatch.setattr(driver, "_plan", spy)
    fa, fb = same_scene_pair(48, 48, 64)
    a, b = fa.reshape(-1, 64), fb.reshape(-1, 64)
    with torch_threads(2):
        _, got = engine.topk(a, b, metric="l2", k=1, budget=2**26, precision=Precision(half=torch.bfloat16))
    assert chosen == [grown]
    assert_topk_exact(a, b, got, "l2", 1)


def test_the_half_search_takes_wider_cpu_tiles_and_fewer_query_tiles_a_worker(monkeypatch) -> None:
    # the rule: on a CPU the half-precision search's reference tiles are twice the plain
    # search's and its workers take two query tiles each, not four (fewer Python steps between
    # its C calls and products, and fewer of each query tile's fixed costs); elsewhere the
    # device's caps hold. Whichever shapes run, the answer is the exact one.
    from densematch.app.synthetic import same_scene_pair
    from densematch.engine.plain import PlainSearch
    from densematch.engine.plan import MAX_TILES

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert PlainSearch.tile_caps(cpu, 10**4, 10**4) == MAX_TILES["cpu"]
    assert HalfSearch.tile_caps(cpu, 10**4, 10**4) == (MAX_TILES["cpu"][0], 2 * MAX_TILES["cpu"][1])
    assert HalfSearch.tile_caps(gpu, 10**4, 10**4) == MAX_TILES["cuda"]
    assert (PlainSearch.items_per_worker, HalfSearch.items_per_worker) == (4, 2)

    # the grown cap planned at the device's narrower caps too, and the fewer tiles of the two
    # taken (2304x256, k=1 under 8 MiB: 105 tiles of 1024 columns, 85 of 512)
    def plan(budget: int, fallback: bool = True) -> tuple[int, engine.TilePlan]:
        with monkeypatch.context() as m:
            if not fallback:
                m.setattr(HalfSearch, "narrower_caps", classmethod(lambda cls, *a: None))
            dims, tiles = driver._plan(
                HalfSearch, 2304, 2304, 256, 1, budget, metric=get_metric("l2"), device=cpu, precision=BF16,
                in_dtype=torch.float32, tiles=None, reserved=0,
            )  # fmt: skip
        return dims.cap, tiles

    grown = BF16.cap(1, 2304, 256)
    wide, got = plan(2**23, fallback=False), plan(2**23)
    assert wide[0] == got[0] == grown and wide[1].tile_b == 2 * MAX_TILES["cpu"][1]
    assert got[1].tile_b == MAX_TILES["cpu"][1]
    assert driver._tiles(2304, 2304, got[1]) < driver._tiles(2304, 2304, wide[1])
    got = plan(2**28)
    assert got[0] == grown and got[1].tile_b == 2 * MAX_TILES["cpu"][1]
    seen: dict[str, list[int]] = {"plain": [], "half": []}
    for name, cls in (("plain", PlainSearch), ("half", HalfSearch)):
        real = cls.rank

        def spy(self, best_v, *args, real=real, name=name):
            seen[name].append(best_v.shape[0])
            return real(self, best_v, *args)

        monkeypatch.setattr(cls, "rank", spy)
    fa, fb = same_scene_pair(48, 48, 32)
    a, b = fa.reshape(-1, 32), fb.reshape(-1, 32)
    with torch_threads(2):
        _, plain = engine.topk(a, b, metric="cosine", k=1, budget=2**28)
        _, half = engine.topk(a, b, metric="cosine", k=1, budget=2**28, precision=BF16)
    assert sorted(seen["plain"]) == [288] * 8 and sorted(seen["half"]) == [576] * 4
    assert_topk_exact(a, b, plain, "cosine", 1)
    assert_topk_exact(a, b, half, "cosine", 1)


def test_reference_tiles_nearest_the_query_tile_come_first():
    from densematch.engine.plan import TilePlan
    from densematch.engine.strategy import Inputs
    from densematch.metrics import get_metric

    a, b = torch.randn(1000, 8), torch.randn(2000, 8)
    inputs = Inputs(a, b, None, None, get_metric("cosine"), BF16, 1, cap=32)
    search = HalfSearch(inputs, TilePlan(100, 300, True, 0))
    for start in (0, 450, 900):
        order = search._tile_order(start, 100)
        assert sorted(order) == list(range(0, 2000, 300))  # every tile once
        centre = (start + 50) * 2
        assert order[0] <= centre < order[0] + 300  # the tile holding the query tile's place first
        gaps = [abs(j + min(300, 2000 - j) / 2 - centre) for j in order]
        assert gaps == sorted(gaps)


@pytest.mark.parametrize("k", [1, 4])
def test_fast_merges_bfloat16_tiles_in_c_as_torch_does(k):
    # precision="fast" ranks by the bfloat16 scores: the C merge of those tiles must pick what
    # torch's merge picks, equal scores (common in bfloat16) to the lowest index
    if not native.usable(torch.device("cpu"), torch.float32):
        pytest.skip("the C kernels do not load here")
    g = torch.Generator().manual_seed(k)
    a, b = torch.randn(300, 16, generator=g), torch.randn(900, 16, generator=g)
    got = {}
    for kernel in ("auto", "torch"):
        with densematch.config_context(kernel=kernel):
            p = Precision("fast", half=torch.bfloat16, certify=False, backend=kernel)
            got[kernel] = engine.topk(a, b, metric="cosine", k=k, budget=2**26, precision=p, tiles=(None, 128))[1]
    assert torch.equal(got["auto"], got["torch"])
    s = torch.randn(7, 70, generator=g).bfloat16()
    s[:, 40] = s[:, 3]  # exact ties
    v, i = torch.full((7, k), -math.inf), torch.full((7, k), -1, dtype=torch.int64)
    native.merge(s[:, 35:], 35, v, i)
    native.merge(s[:, :35], 0, v, i)  # tiles in any order
    want_v, want_i = torch.full((7, k), -math.inf), torch.full((7, k), -1, dtype=torch.int64)
    native.merge(s.float(), 0, want_v, want_i)
    assert torch.equal(i, want_i) and torch.equal(v, want_v)


@pytest.mark.parametrize(
    ("half", "kernel"), [("bfloat16", "auto"), ("bfloat16", "torch"), ("float16", "auto"), ("bfloat16", "triton")]
)
def test_each_certified_path_takes_the_step_its_rule_names(monkeypatch, half, kernel):
    # the rules, from what the device and dtype are: bfloat16 on a CPU with the C kernels runs
    # one C call per tile, any other half type or kernel="torch" torch's operators; the torch
    # engine centres its query tiles, the fused kernel (no bias per reference) does not
    import importlib.util

    if kernel == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: the kernel path cannot run here")
    seen = {"c calls": 0, "centred": []}
    real_step, real_query = native.CertifiedStep.__call__, HalfSearch._half_query

    def step(*args, **kwargs):
        seen["c calls"] += 1
        return real_step(*args, **kwargs)

    def half_query(self, q):
        got = real_query(self, q)
        seen["centred"].append(got[2] is not None)
        return got

    monkeypatch.setattr(native.CertifiedStep, "__call__", step)
    monkeypatch.setattr(HalfSearch, "_half_query", half_query)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(60, 16, generator=g), torch.randn(90, 16, generator=g)
    with densematch.config_context(half=half, kernel=kernel):
        chosen = resolve_precision("exact", torch.device("cpu"), "cosine")
        _, got = engine.topk(a, b, metric="cosine", k=2, budget=2**24, precision=chosen)
    c_step = half == "bfloat16" and kernel == "auto" and native.usable(torch.device("cpu"), torch.float32)
    assert (seen["c calls"] > 0) == c_step
    if kernel == "triton":
        assert seen["centred"] == []
    else:
        assert seen["centred"] and all(seen["centred"])
    assert_topk_exact(a, b, got, "cosine", 2)
