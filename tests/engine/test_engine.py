import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch.threads
from densematch import engine
from densematch.engine.plain import PlainSearch
from densematch.metrics import METRICS, get_metric

from .._reference import assert_same_up_to_ties, assert_topk_exact, reference_scores, reported, tolerance
from .._threads import torch_threads

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@settings(max_examples=80, deadline=None)
@given(
    na=st.integers(1, 40),
    nb=st.integers(1, 40),
    c=st.integers(1, 24),
    k=st.integers(1, 5),
    metric=st.sampled_from(sorted(METRICS)),
    dtype=st.sampled_from(DTYPES),
    tiles=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    masked=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_topk_equals_brute_force(na, nb, c, k, metric, dtype, tiles, masked, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(na, c, generator=g).to(dtype)
    b = torch.randn(nb, c, generator=g).to(dtype)
    allowed = torch.rand(nb, generator=g) < 0.7 if masked else torch.ones(nb, dtype=torch.bool)
    allowed[0] = True
    rows_b = allowed.nonzero().squeeze(1) if masked else None
    k = min(k, int(allowed.sum()))
    value, index = engine.topk(a, b, metric=metric, k=k, budget=2**30, rows_b=rows_b, tiles=tiles)
    assert_topk_exact(a, b, index, metric, k, allowed_b=allowed)
    ref = reported(reference_scores(a, b, metric), metric).gather(1, index)
    torch.testing.assert_close(value.double(), ref, rtol=0, atol=tolerance(a, b, metric))
    # best first
    m = get_metric(metric)
    step = value[:, 1:] - value[:, :-1]
    assert (step <= 1e-5 if m.higher_is_better else step >= -1e-5).all()


@pytest.mark.parametrize("metric", sorted(METRICS))
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("tiles", [(1, 1), (2, 4), (3, 7), (7, 9), (None, None)])
def test_exact_ties_go_to_the_lowest_index(metric, k, tiles):
    # +-1 features and 64 reference rows keep every product, norm and mean exact in float32,
    # so equal scores are truly equal and the tie rule alone decides
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 2, (50, 4), generator=g).float() * 2 - 1
    b = torch.randint(0, 2, (64, 4), generator=g).float() * 2 - 1
    _, index = engine.topk(a, b, metric=metric, k=k, budget=2**30, tiles=tiles)
    ref = reference_scores(a, b, metric)
    key = -ref * 1000 + torch.arange(64, dtype=torch.float64)
    torch.testing.assert_close(index, key.argsort(dim=1)[:, :k])


def test_fewer_references_than_k_leave_empty_slots():
    value, index = engine.topk(
        torch.randn(4, 3), torch.randn(10, 3), metric="l2", k=3, budget=2**30, rows_b=torch.tensor([2, 7])
    )
    assert (index[:, 2] == -1).all() and value[:, 2].isnan().all()
    assert set(index[:, :2].reshape(-1).tolist()) <= {2, 7}


def test_cosine_zero_vectors_score_zero():
    a = torch.zeros(3, 5)
    b = torch.randn(6, 5)
    b[2] = 0
    value, index = engine.topk(a, b, metric="cosine", k=2, budget=2**30)
    assert not value.isnan().any() and (value == 0).all()
    assert index[:, 0].tolist() == [0, 0, 0]


def test_l2_expansion_survives_large_offsets():
    # features far from the origin: the naive expansion would cancel catastrophically
    g = torch.Generator().manual_seed(1)
    b = torch.randn(300, 16, generator=g) + 1000.0
    a = b[::3] + 1e-3 * torch.randn(100, 16, generator=g)
    value, index = engine.topk(a, b, metric="l2", k=1, budget=2**30, tiles=(17, 31))
    assert index[:, 0].tolist() == list(range(0, 300, 3))
    assert (value >= 0).all() and not value.isnan().any()


def test_plan_respects_budget_and_names_minimum():
    m = get_metric("cosine")
    plan = engine.plan_tiles(10_000, 20_000, 64, 1, 8 * 2**20, metric=m, device=torch.device("cpu"))
    assert plan.bytes <= 8 * 2**20 and plan.tile_a >= 1 and plan.tile_b >= 1
    with pytest.raises(ValueError, match=r"at least \d+ bytes"):
        engine.plan_tiles(10_000, 20_000, 64, 1, 1000, metric=m, device=torch.device("cpu"))


def test_a_small_budget_takes_the_largest_tile_not_a_one_column_one():
    # what each query row holds beside the tile (pool, re-scoring) left room for 30 rows whatever
    # the reference tile, which halved down to one column: 86,400 tiles for 1600 x 1600
    m = get_metric("l2")
    plan = engine.plan_tiles(1600, 1600, 25, 3, 300 * 1024, metric=m, device=torch.device("cpu"))
    assert plan.bytes <= 300 * 1024
    assert math.ceil(1600 / plan.tile_a) * math.ceil(1600 / plan.tile_b) <= 1000, plan  # 78,400 before
    # where 64 query rows fit, the reference tile still halves until they do
    roomy = engine.plan_tiles(1600, 1600, 25, 3, 16 * 2**20, metric=m, device=torch.device("cpu"))
    assert roomy.tile_a >= 64


@pytest.mark.parametrize("budget", [40_000, 200_000, 2**20, 2**30])
def test_any_budget_gives_the_same_answer(budget):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(300, 8, generator=g), torch.randn(257, 8, generator=g)
    value, index = engine.topk(a, b, metric="l2", k=2, budget=budget)
    ref_v, ref_i = engine.topk(a, b, metric="l2", k=2, budget=2**30, tiles=(300, 257))
    torch.testing.assert_close(value, ref_v)
    assert_same_up_to_ties(a, b, index, ref_i, "l2")
    assert not math.isnan(value.sum().item())


def test_out_of_memory_in_a_tile_halves_the_tile_and_retries(monkeypatch):
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(100, 6, generator=g), torch.randn(80, 6, generator=g)
    want = engine.topk(a, b, metric="l2", k=2, budget=2**30)
    real_rank = PlainSearch.rank
    sizes = []

    def flaky(self, best_v, best_i, start, buf):
        sizes.append(best_v.shape[0])
        if best_v.shape[0] > 30:  # as if the GPU ran out of memory for big tiles
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_rank(self, best_v, best_i, start, buf)

    monkeypatch.setattr(PlainSearch, "rank", flaky)
    got = engine.topk(a, b, metric="l2", k=2, budget=2**30, tiles=(100, 16))
    assert sizes[:3] == [100, 50, 25]
    assert_same_up_to_ties(a, b, got[1], want[1], "l2")
    torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize(("metric", "k"), [("cosine", 1), ("l2", 3), ("l1", 2)])
def test_query_tiles_on_worker_threads_give_the_single_thread_answer(monkeypatch, metric, k):
    # 3000 query rows: over the threshold where a CPU search shares its query tiles out
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3000, 12, generator=g), torch.randn(700, 12, generator=g)
    with torch_threads(2):
        assert engine.driver.tile_workers(a.device, a.shape[0]) == 2
        seen = []
        real = PlainSearch.rank

        def spy(self, best_v, best_i, start, buf):
            seen.append((torch.get_num_threads(), __import__("threading").current_thread().name))
            return real(self, best_v, best_i, start, buf)

        monkeypatch.setattr(PlainSearch, "rank", spy)
        pools = []
        real_share = engine.driver.share_out

        def share_spy(items, work, workers, *, name="densematch"):
            pools.append((name, workers, len(items)))
            return real_share(items, work, workers, name=name)

        monkeypatch.setattr(engine.driver, "share_out", share_spy)
        done = []
        value, index = engine.topk(a, b, metric=metric, k=k, budget=2**28, on_tile=done.append)
        monkeypatch.setattr(engine.driver, "share_out", real_share)
        threaded = list(seen)
        monkeypatch.setattr(densematch.threads, "THREADED", False)
        ref_v, ref_i = engine.topk(a, b, metric=metric, k=k, budget=2**28)
        # the caller's setting stays, and threads started later get it too
        assert torch.get_num_threads() == 2
        later = []
        t = __import__("threading").Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]
    assert sum(done) == 3000
    # two workers share the tiles; which of them takes how many is up to the scheduler
    assert [(w, n > 1 and n % 2 == 0) for name, w, n in pools if name == "densematch-tiles"] == [(2, True)]
    # every tile of the threaded call ran on a worker, each worker on one thread
    assert threaded and all(n == 1 and name.startswith("densematch-tiles") for n, name in threaded)
    assert_same_up_to_ties(a, b, index, ref_i, metric)
    torch.testing.assert_close(value, ref_v, rtol=0, atol=tolerance(a, b, metric))


@given(n=st.integers(1, 20000), most=st.integers(256, 2048), workers=st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_query_tiles_are_even_and_as_many_as_a_multiple_of_the_workers(n, most, workers):
    # the rule: no tile above the plan's, all of one size but the last, and (where there are at
    # least as many tiles as workers) a whole number of tiles for each worker, so that no worker
    # takes a whole tile more than another (72x72 rows in 1024s: five tiles and one of 64)
    ta = engine.driver.even_tiles(n, most, workers)
    count = -(-n // ta)
    assert 1 <= ta <= most and 0 < n - (count - 1) * ta <= ta
    if n > most * (workers - 1):
        assert count % workers == 0
    assert count <= -(-n // most) + workers - 1
    assert engine.driver.even_tiles(5184, 1024, 2) == 864


def test_an_error_in_a_worker_thread_reaches_the_caller(monkeypatch):
    a, b = torch.randn(3000, 4), torch.randn(50, 4)

    def broken(self, best_v, best_i, start, buf):
        raise RuntimeError("tile failed")

    monkeypatch.setattr(PlainSearch, "rank", broken)
    with torch_threads(2):
        with pytest.raises(RuntimeError, match="tile failed"):
            engine.topk(a, b, metric="cosine", k=1, budget=2**28)
        assert torch.get_num_threads() == 2


def test_finite_rows_reads_again_only_rows_whose_sum_is_not_finite() -> None:
    from densematch.engine.half import HalfSearch

    big = torch.finfo(torch.float32).max
    body = torch.tensor([[1.0, 2.0], [big, big], [float("nan"), 0.0], [float("inf"), -float("inf")], [0.0, -3.0]])
    assert HalfSearch._finite_rows(body).tolist() == [True, True, False, False, True]
