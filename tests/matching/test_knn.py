"""densematch.knn and KNNIndex: exact k nearest rows of a memory bank."""

import pytest
import torch

import densematch
from densematch.metrics import Metric

from .._memory import peak_extra
from .._reference import METRICS, assert_same_up_to_ties, reference_scores


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("k", [1, 4])
def test_knn_equals_brute_force_and_the_index_equals_knn(metric, k):
    g = torch.Generator().manual_seed(k)
    bank, queries = torch.randn(700, 24, generator=g), torch.randn(90, 24, generator=g)
    d, i = densematch.knn(queries, bank, k=k, metric=metric)
    assert d.shape == i.shape == (90, k)
    want = reference_scores(queries, bank, metric).topk(k, dim=1).indices
    assert_same_up_to_ties(queries, bank, i, want, metric)
    direct = densematch.metrics.get_metric(metric).pair_value(queries[:, None].double(), bank[i].double())
    torch.testing.assert_close(d.double(), 1 - direct if metric == "cosine" else direct, atol=1e-4, rtol=1e-5)
    index = densematch.KNNIndex(bank, metric=metric)
    d2, i2 = index.search(queries, k=k)
    # the same products from the same prepared rows, only prepared once: equal to the bit
    assert torch.equal(i2, i) and torch.equal(d2, d)


def test_the_index_prepares_the_bank_once(monkeypatch):
    g = torch.Generator().manual_seed(1)
    bank = torch.randn(3000, 16, generator=g)
    index = densematch.KNNIndex(bank, metric="cosine")
    prepared = []
    real = type(index.metric).prepare

    def spy(self: Metric, x, role, *args, **kw):
        prepared.append((role, x.shape[0]))
        return real(self, x, role, *args, **kw)

    monkeypatch.setattr(type(index.metric), "prepare", spy)
    for n in (5, 50, 500):
        index.search(torch.randn(n, 16, generator=g), k=2)
    assert prepared and all(role == "query" for role, _ in prepared)
    monkeypatch.undo()
    # without the index, every call prepares the bank again
    prepared.clear()
    monkeypatch.setattr(type(index.metric), "prepare", spy)
    densematch.knn(torch.randn(5, 16, generator=g), bank, metric="cosine")
    assert ("ref", 3000) in prepared or sum(n for role, n in prepared if role == "ref") >= 3000


def test_real_patch_features_with_duplicates(camera_small):
    from .._reference import patch_features

    f = patch_features(camera_small, 5).reshape(-1, 25)
    bank, queries = f[::2], f[1::7]
    d, i = densematch.knn(queries, bank, k=3, metric="l2", memory="2MiB")
    want = reference_scores(queries, bank, "l2").topk(3, dim=1).indices
    assert_same_up_to_ties(queries, bank, i, want, "l2")
    assert (d[:, :-1] <= d[:, 1:]).all()


def test_gradients_reach_queries_and_bank():
    g = torch.Generator().manual_seed(2)
    q = torch.rand(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.rand(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, b: densematch.knn(q, b, k=2)[0], (q, b))


@pytest.mark.parametrize(
    ("queries", "bank", "kw", "error", "text"),
    [
        (torch.randn(5), torch.randn(9, 5), {}, ValueError, r"queries must have shape \(N, D\)"),
        (torch.randn(5, 4), torch.randn(9, 5), {}, ValueError, "queries and bank must have one D, got 4 and 5"),
        (torch.randn(5, 4), torch.randn(0, 4), {}, ValueError, r"bank must have shape \(N, D\) with N, D >= 1"),
        (torch.randn(5, 4), torch.randn(9, 4), {"k": 10}, ValueError, "k must be"),
        (torch.full((5, 4), float("nan")), torch.randn(9, 4), {}, ValueError, "queries"),
        (torch.randn(5, 4), torch.randn(9, 4), {"metric": "hamming"}, ValueError, "metric must be one of"),
        # complex rows raised torch's NotImplementedError from the finiteness check
        (torch.randn(5, 4, dtype=torch.complex64), torch.randn(9, 4), {}, TypeError, "queries must hold real floats"),
        (torch.randn(5, 4), torch.randn(9, 4, dtype=torch.complex128), {}, TypeError, "bank must hold real floats"),
        (torch.randn(5, 4), torch.randn(9, 4), {"check_finite": "no"}, TypeError, "check_finite must be True or False"),
    ],
)
def test_bad_input(queries, bank, kw, error, text):
    with pytest.raises(error, match=text):
        densematch.knn(queries, bank, **kw)


def test_the_index_follows_its_bank_changed_in_place():
    # it returned the index from its prepared copy and the distance from the changed tensor
    g = torch.Generator().manual_seed(4)
    bank = torch.randn(200, 8, generator=g)
    queries = bank[:5].clone()
    index = densematch.KNNIndex(bank)
    assert index.search(queries)[1][:, 0].tolist() == list(range(5))
    bank[:5] += 10.0  # the queries' own rows move away
    d, i = index.search(queries, k=2)
    want_d, want_i = densematch.knn(queries, bank, k=2)
    assert torch.equal(i, want_i) and torch.equal(d, want_d)
    assert (i[:, 0] >= 5).all()
    bank[0, 0] = float("nan")
    with pytest.raises(ValueError, match="bank must hold only finite"):
        index.search(queries)


def test_an_index_of_a_numpy_bank_holds_a_copy():
    # numpy's writes to the array cannot be seen by torch: the index keeps what it was given
    import numpy as np

    bank = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float32)
    queries = torch.from_numpy(bank[:4].copy())
    index = densematch.KNNIndex(bank)
    bank[:] = 0.0
    d, i = index.search(queries)
    assert i[:, 0].tolist() == [0, 1, 2, 3] and torch.allclose(d[:, 0], torch.zeros(4), atol=1e-3)


def test_knn_never_builds_the_distance_matrix():
    # 2000 x 100,000 float32 distances would take 763 MiB
    extra = peak_extra(
        """
        g = torch.Generator().manual_seed(0)
        bank, queries = torch.randn(100_000, 32, generator=g), torch.randn(2000, 32, generator=g)
        def run(small):
            n = 50 if small else 2000
            densematch.knn(queries[:n], bank, k=4, memory="16MiB")
        """
    )
    assert extra < 24 * 2**20, f"{extra / 2**20:.1f} MiB above the inputs"


def test_searches_return_named_values_and_indices():
    # one result type for nearest_prototype, knn and KNNIndex.search: a named tuple, so the
    # unpacking code written for plain tuples keeps working
    bank = torch.randn(300, 8)
    x = torch.randn(2, 8, 5, 6)
    for got in (
        densematch.knn(bank[:7], bank, k=3),
        densematch.KNNIndex(bank).search(bank[:7], k=3),
        densematch.nearest_prototype(x, bank, k=3),
    ):
        assert isinstance(got, densematch.Nearest) and got._fields == ("values", "indices")
        d, i = got
        assert d is got.values and i is got.indices and i.dtype == torch.int64
    queries = bank[:7]
    want = torch.arange(7)[:, None]  # each query's own row, at distance 0
    assert_same_up_to_ties(queries, bank, densematch.knn(queries, bank).indices, want, "l2")
