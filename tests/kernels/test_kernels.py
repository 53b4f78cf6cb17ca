"""The fused Triton top-k kernel, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set by the
root conftest.py when no GPU is present), against the float64 reference and the torch engine."""

import pytest
import torch

pytest.importorskip("triton")

import densematch
from densematch import engine, kernels
from densematch.metrics import get_metric
from densematch.precision import Precision

from .._reference import MATRIX, assert_same_up_to_ties, assert_topk_exact, patch_features, reference_scores

TORCH = Precision(backend="torch")


def run(a, b, half=None, certify=True, **kw):
    stats: dict[str, int] = {}
    precision = Precision(half=half, certify=certify, backend="triton")
    v, i = engine.topk(a, b, budget=2**28, precision=precision, stats=stats, **kw)
    return v, i, stats


@pytest.mark.parametrize("metric", MATRIX)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_certified_kernel_equals_float32_on_odd_sizes(metric, k):
    g = torch.Generator().manual_seed(k)
    a, b = torch.randn(37, 19, generator=g), torch.randn(53, 19, generator=g)
    _, want = engine.topk(a, b, metric=metric, k=k, budget=2**28, precision=TORCH)
    value, got, stats = run(a, b, metric=metric, k=k, half=torch.bfloat16, tiles=(None, 24))
    assert_topk_exact(a, b, got, metric, k)
    assert_same_up_to_ties(a, b, got, want, metric)
    assert stats["candidates"] >= k * 37 and stats["fallback"] == 0
    direct = get_metric(metric).pair_value(a[:, None], b[got])
    torch.testing.assert_close(value, direct)


@pytest.mark.parametrize("metric", MATRIX)
def test_float32_kernel_is_exact(metric):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(33, 21, generator=g), torch.randn(47, 21, generator=g)
    _, got, _ = run(a, b, metric=metric, k=2)
    assert_topk_exact(a, b, got, metric, 2)


def test_fast_kernel_ranks_by_half_scores():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(40, 24, generator=g), torch.randn(64, 24, generator=g)
    _, got, _ = run(a, b, metric="cosine", k=2, half=torch.float16, certify=False)
    scores = (get_metric("cosine").prepare(a, "query", torch.float32).half().float()) @ (
        get_metric("cosine").prepare(b, "ref", torch.float32).half().float().T
    )
    want = scores.topk(2, dim=1).values
    torch.testing.assert_close(scores.gather(1, got).sort(dim=1, descending=True).values, want, rtol=0, atol=1e-6)


def test_kernel_on_photo_features_with_masks(camera_small):
    f = patch_features(camera_small[::3, ::3], 5).reshape(-1, 25)
    g = torch.roll(patch_features(camera_small[::3, ::3], 5), (1, 2), dims=(0, 1)).reshape(-1, 25)
    gen = torch.Generator().manual_seed(0)
    rows_a = (torch.rand(f.shape[0], generator=gen) < 0.3).nonzero().squeeze(1)
    allowed = torch.rand(g.shape[0], generator=gen) < 0.5
    rows_b = allowed.nonzero().squeeze(1)
    kw = dict(metric="cosine", k=2, rows_a=rows_a, rows_b=rows_b)
    _, want = engine.topk(f, g, budget=2**28, precision=TORCH, **kw)
    _, got, stats = run(f, g, half=torch.bfloat16, **kw)
    assert_topk_exact(f[rows_a], g, got, "cosine", 2, allowed_b=allowed)
    assert_same_up_to_ties(f[rows_a], g, got, want, "cosine")
    assert stats["rows"] == rows_a.numel()


@pytest.mark.parametrize("metric", ["dot", "l2"])
def test_exact_ties_go_to_the_lowest_index(metric):
    # +-1 features and 64 reference rows keep every product, norm and mean exact (as in
    # tests/engine/test_engine.py); C=4 is one chunk, and l2 adds its extra column as a bias
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 2, (30, 4), generator=g).float() * 2 - 1
    b = torch.randint(0, 2, (64, 4), generator=g).float() * 2 - 1
    ref = reference_scores(a, b, metric)
    key = -ref * 1000 + torch.arange(64, dtype=torch.float64)
    for half in (None, torch.bfloat16):
        _, got, _ = run(a, b, metric=metric, k=4, half=half, tiles=(None, 16))
        torch.testing.assert_close(got, key.argsort(dim=1)[:, :4])


def test_match_runs_the_kernel_when_asked(camera_small):
    f = patch_features(camera_small[20:32, 30:44], 5)  # small: the interpreter is slow
    g = torch.roll(f, (1, -1), dims=(0, 1))
    want = densematch.match(f, g, metric="l2", k=2, mutual=True, precision="float32")
    with densematch.config_context(kernel="triton", half="bfloat16"):
        got = densematch.match(f, g, metric="l2", k=2, mutual=True)
    assert_same_up_to_ties(
        f.reshape(-1, 25), g.reshape(-1, 25), got.index.reshape(-1, 2), want.index.reshape(-1, 2), "l2"
    )


def test_kernel_choice_and_its_errors(monkeypatch):
    cpu = torch.device("cpu")
    cosine, l1 = get_metric("cosine"), get_metric("l1")
    assert not kernels.wanted("auto", cpu, cosine, 1)  # auto: CUDA only
    assert not kernels.wanted("torch", cpu, cosine, 1)
    with pytest.raises(ValueError, match="needs a matrix metric"):
        kernels.wanted("triton", cpu, l1, 1)
    with pytest.raises(ValueError, match=r"k <= 8"):
        kernels.wanted("triton", cpu, cosine, 9)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.wanted("triton", cpu, cosine, 1)
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="pip install triton"):
        kernels.wanted("triton", cpu, cosine, 1)
