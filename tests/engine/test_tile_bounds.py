"""The plain search's bounds per reference tile for wide pure products (densematch/engine/plain.py):
each tile's largest norm bounds its pairs, the references shifted by their mean where that shrinks
those norms; the bounds sound, and the search exact wherever they are used, against a float64
reference (exact ties on integer rows, near-ties through tests/_reference.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densematch import engine
from densematch.engine import plain
from densematch.metrics import get_metric
from densematch.precision import Precision, product_slack, resolve_precision, shifted_slack

from .._paths import TORCH_PATHS, on_path
from .._reference import assert_exact_ties_lowest, assert_same_up_to_ties, reference_scores

PLAIN_PATHS = [p for p in TORCH_PATHS if p.startswith("float32")]  # the C merge and torch's


def common_rows(n: int, c: int, seed: int, spread: float = 0.1) -> torch.Tensor:
    """Rows that share most of their length (one common vector, a little of their own), as raw
    photo patches do in smooth regions."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c, generator=g) + spread * torch.randn(n, c, generator=g)


def integer_rows(n: int, c: int, seed: int, offset: float = 50.0, levels: int = 2) -> torch.Tensor:
    """Integer rows far from the origin: their dot products exact in float32, ties everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels + 1, (n, c), generator=g).float() + offset


def prepared(b: torch.Tensor, metric: str, precision: Precision | None = None) -> engine.Prepared:
    return engine.prepare(b, metric=metric, k=1, precision=precision or Precision())


def test_which_references_get_tile_bounds_and_a_shift():
    # the rule: cosine from C=512, whatever the machine
    b = common_rows(600, plain.TILE_BOUNDS_FROM, 0)
    state = prepared(b, "cosine").state
    assert state["shift"] is not None and state["row_norms"] is not None
    assert state["ref_norms"][0] < plain.SHIFT_GAIN * state["unshifted"]
    # rows that share little: their own tile bounds, no shift
    spread = prepared(torch.randn(600, plain.TILE_BOUNDS_FROM), "cosine").state
    assert spread["shift"] is None and spread["unshifted"] == 0.0 and spread["row_norms"] is not None
    # narrower rows, dot (rows of uneven norms), l2 (centred, with an extra column), or no
    # near-ties settled ("fast"): one bound for every tile, no shift
    for metric, rows in (("cosine", b[:, :-1]), ("dot", b), ("l2", b)):
        state = prepared(rows, metric).state
        assert state["row_norms"] is None and state.get("shift") is None, metric
    assert "row_norms" not in prepared(b, "cosine", Precision("fast", certify=False)).state


@pytest.fixture()
def wide(monkeypatch):
    """Tile bounds for dot too, from C=256: the machinery on integer rows, whose dot products
    float32 holds exactly (exact ties to judge), and on narrower rows."""
    monkeypatch.setattr(plain, "tile_bounds_for", lambda metric, c: metric.shiftable and c >= 256)


@pytest.mark.parametrize("metric", ["cosine", "dot"])
@pytest.mark.parametrize("c", [256, 777])
def test_each_tiles_products_lie_within_its_slack(wide, metric, c):
    # the search's own prepared references: every product of a tile lies within that tile's
    # slack of the exact one less q . m (one amount a row, which moves no ranking)
    a, b = common_rows(200, c, 2, spread=0.02), common_rows(1200, c, 3, spread=0.02)
    p = prepared(b, metric)
    shift, refs, norms = p.state["shift"], p.whole, p.state["row_norms"]
    assert shift is not None and refs is not None
    q = get_metric(metric).prepare(a, "query", torch.float32)
    got = (q @ refs.T).double()
    a64, b64 = a.double(), b.double()
    if metric == "cosine":
        a64, b64 = a64 / a64.norm(dim=1, keepdim=True), b64 / b64.norm(dim=1, keepdim=True)
    exact = a64 @ b64.T - (a64 @ shift.double())[:, None]
    q_norms = torch.linalg.vector_norm(q, dim=1)
    unshifted = p.state["unshifted"]
    for j in range(0, b.shape[0], 500):
        slack = shifted_slack(q_norms, c, torch.float32, float(norms[j : j + 500].amax()), unshifted).double()
        assert ((got[:, j : j + 500] - exact[:, j : j + 500]).abs() <= slack[:, None]).all()
    # and well inside the bound of the rows unshifted: what the shift is for
    whole = product_slack(q, (unshifted, 0.0)).double()
    assert (shifted_slack(q_norms, c, torch.float32, float(norms.amax()), unshifted) < 0.5 * whole).all()


@pytest.mark.parametrize("memory", [None, "2MiB"])
def test_every_reference_tile_multiplied_is_shifted(wide, monkeypatch, memory):
    # the references the search multiplies (prepared once, or tile by tile under a small
    # budget) are the precisely prepared rows less the shift its bounds were taken for
    a, b = common_rows(100, 300, 11), common_rows(2000, 300, 12)
    seen = []
    original = plain.PlainSearch._prepare_refs

    def spy(self, start, stop, out=None):
        refs = original(self, start, stop, out)
        if self.shift is not None:
            seen.append((start, stop, refs.clone(), self.shift))
        return refs

    monkeypatch.setattr(plain.PlainSearch, "_prepare_refs", spy)
    engine.topk(a, b, metric="cosine", k=2, budget=_budget(memory), precision=Precision())
    assert seen
    want = get_metric("cosine").prepare(b, "ref", torch.float32, precise=True)
    for start, stop, refs, shift in seen:
        torch.testing.assert_close(refs, want[start:stop] - shift, rtol=0, atol=1e-6)


@pytest.mark.parametrize("path", PLAIN_PATHS)
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("memory", [None, "2MiB"])
def test_integer_rows_far_from_the_origin_keep_exact_ties_lowest(wide, path, k, memory):
    # dot of few-level integer rows: more exact ties than the cap holds, every one decided by
    # the lowest index; "2MiB": references prepared and shifted tile by tile
    a, b = integer_rows(150, 256, 4), integer_rows(900, 256, 5)
    b = torch.cat([b, b[:300]])  # exact duplicates, far apart
    with on_path(path, "dot") as name:
        precision = resolve_precision(name, torch.device("cpu"), "dot")
        _, got = engine.topk(a, b, metric="dot", k=k, budget=_budget(memory), precision=precision)
    assert_exact_ties_lowest(a, b, got, "dot", k)


@pytest.mark.parametrize("path", PLAIN_PATHS)
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("c", [256, 1536])
def test_cosine_of_rows_sharing_most_of_their_length(wide, path, k, c):
    a, b = common_rows(120, c, 6, spread=0.05), common_rows(1400, c, 7, spread=0.05)
    with on_path(path, "cosine") as name:
        precision = resolve_precision(name, torch.device("cpu"), "cosine")
        _, got = engine.topk(a, b, metric="cosine", k=k, budget=2**26, precision=precision)
    ref = reference_scores(a, b, "cosine")
    # float32's direct form of a cosine errs by at most about C u: a tighter judge than the
    # helper's default, which is as wide as the bound the tiles narrow
    assert_same_up_to_ties(a, b, got, ref.topk(k, dim=1).indices, "cosine", tol=4 * c * 2.0**-24)


@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_same_scene_wide_features(wide, metric):
    # raw colour patches of two crops of one photograph at C=768: smooth regions full of near-ties
    from densematch.app.synthetic import same_scene_pair

    fa, fb = same_scene_pair(24, 24, 768)
    a, b = fa.reshape(-1, 768), fb.reshape(-1, 768)
    _, got = engine.topk(a, b, metric=metric, k=4, budget=2**26, precision=Precision())
    ref = reference_scores(a, b, metric)
    tol = 4 * 768 * 2.0**-24 * (1 if metric == "cosine" else float(a.norm(dim=1).max() * b.norm(dim=1).max()))
    assert_same_up_to_ties(a, b, got, ref.topk(4, dim=1).indices, metric, tol=tol)


def test_prepared_references_serve_other_queries(wide):
    b = integer_rows(500, 300, 8)
    p = prepared(b, "dot")
    assert p.state["shift"] is not None
    for seed in (9, 10):
        a = integer_rows(80, 300, seed)
        _, got = engine.topk(a, b, metric="dot", k=3, budget=2**26, precision=Precision(), prepared=p)
        assert_exact_ties_lowest(a, b, got, "dot", 3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    na=st.integers(1, 30),
    nb=st.integers(1, 120),
    c=st.integers(256, 300),
    k=st.integers(1, 6),
    levels=st.integers(1, 3),
    offset=st.sampled_from([0.0, 3.0, 50.0]),
    candidates=st.sampled_from([1, 4, None]),
    tile_b=st.integers(1, 50),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_integer_rows_with_tile_bounds(wide, na, nb, c, k, levels, offset, candidates, tile_b, seed):
    # any cap, any tile, with and without a shift taken: exact ties to the lowest index
    a, b = integer_rows(na, c, seed, offset, levels), integer_rows(nb, c, seed + 1, offset, levels)
    k = min(k, nb)
    precision = Precision(candidates=candidates)
    _, got = engine.topk(a, b, metric="dot", k=k, budget=2**26, precision=precision, tiles=(None, tile_b))
    assert_exact_ties_lowest(a, b, got, "dot", k)


def _budget(memory: str | None) -> int:
    return 2**21 if memory == "2MiB" else 2**26


@pytest.mark.parametrize("path", PLAIN_PATHS)
@pytest.mark.parametrize("k", [1, 3])
def test_each_tile_lists_with_its_own_margin(wide, monkeypatch, path, k):
    # tile J's slack made 8 (J + 1) (scores exact integers, no shift): a pair is listed iff its score
    # plus its tile's slack reaches the row's k-th best of scores less their tiles' slacks
    g = torch.Generator().manual_seed(13)
    a = torch.randint(-2, 3, (30, 256), generator=g).float()
    b = torch.randint(-2, 3, (300, 256), generator=g).float()
    assert prepared(b, "dot").state["shift"] is None
    width = 64
    monkeypatch.setattr(plain.PlainSearch, "_tile_norm", lambda self, start, n: 8.0 * (start // width + 1))
    monkeypatch.setattr(plain, "shifted_slack", lambda q_norms, c, dtype, norm, unshifted: q_norms * 0 + norm)
    stats = {"candidates": 0, "most": 0, "fallback": 0}
    with on_path(path, "dot") as name:
        precision = resolve_precision(name, torch.device("cpu"), "dot")
        precision = Precision(name, backend=precision.backend, candidates=300)
        engine.topk(a, b, metric="dot", k=k, budget=2**26, precision=precision, tiles=(None, width), stats=stats)
    s = a.double() @ b.double().T
    slack = 8.0 * (torch.arange(300) // width + 1).double()
    kth = (s - slack).topk(k, dim=1).values[:, -1:]
    assert stats["fallback"] == 0
    assert stats["candidates"] == int((s + slack >= kth).sum())
    # and with the least cap (8 k), rows searched again against their tiles' floors: still exact
    stats = {"candidates": 0, "most": 0, "fallback": 0}
    with on_path(path, "dot") as name:
        backend = resolve_precision(name, torch.device("cpu"), "dot").backend
        precision = Precision(name, backend=backend, candidates=2)
        _, got = engine.topk(
            a, b, metric="dot", k=k, budget=2**26, precision=precision, tiles=(None, width), stats=stats
        )
    assert stats["fallback"] > 0
    assert_exact_ties_lowest(a, b, got, "dot", k)


@settings(max_examples=20, deadline=None)
@given(
    na=st.integers(1, 20),
    nb=st.integers(1, 100),
    c=st.integers(plain.TILE_BOUNDS_FROM, plain.TILE_BOUNDS_FROM + 40),
    k=st.integers(1, 5),
    spread=st.sampled_from([0.0, 0.01, 0.3, 3.0]),
    duplicates=st.booleans(),
    candidates=st.sampled_from([1, None]),
    tile_b=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_cosine_as_the_rule_takes_it(na, nb, c, k, spread, duplicates, candidates, tile_b, seed):
    # the rule's own path (cosine from C=512, shifted or not): rows sharing much, little or all
    # of their length (spread 0: every row equal, all tied), duplicated references, any cap and tile
    a, b = common_rows(na, c, seed, spread), common_rows(nb, c, seed + 1, spread)
    if duplicates:
        b = torch.cat([b, b[: nb // 2 + 1]])
    k = min(k, b.shape[0])
    _, got = engine.topk(
        a, b, metric="cosine", k=k, budget=2**26, precision=Precision(candidates=candidates), tiles=(None, tile_b)
    )
    ref = reference_scores(a, b, "cosine")
    assert_same_up_to_ties(a, b, got, ref.topk(k, dim=1).indices, "cosine", tol=4 * c * 2.0**-24)
