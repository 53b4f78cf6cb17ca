"""Each public operation on the run's device (the ``device`` fixture: ``pytest --device cuda`` on
a GPU runner, the CPU by default), judged on the CPU against float64 references, near-ties counted
as ties: dense match, k-NN, prototype distances and nearest prototypes, local windows, align.
Every search path of the engine is forced on the device by tests/engine/test_exactness.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import densematch

from ._reference import (
    assert_same_up_to_ties,
    assert_topk_exact,
    patch_features,
    reference_scores,
    reported,
    tolerance,
)
from .local.test_local import check_topk

METRICS = ["cosine", "l2", "dot"]


@pytest.fixture(scope="module")
def photo_pair(camera_small: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch features of a camera crop and of the same crop moved by (2, -1), with a little noise."""
    a = patch_features(camera_small[:24, :28], 5)
    g = torch.Generator().manual_seed(3)
    b = torch.roll(a, (2, -1), (0, 1)) + 0.01 * torch.randn(a.shape, generator=g)
    return a, b


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("k", [1, 4])
def test_match_on_the_device(device, photo_pair, metric, k):
    a, b = photo_pair
    r = densematch.match(a.to(device), b.to(device), metric=metric, k=k)
    assert r.index.device.type == device.type
    fa, fb = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    index = r.index.reshape(-1, k).cpu()
    assert_topk_exact(fa, fb, index, metric, k)
    want = reported(reference_scores(fa, fb, metric), metric).gather(1, index)
    torch.testing.assert_close(r.score.reshape(-1, k).cpu().double(), want, rtol=0, atol=tolerance(fa, fb, metric))


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_knn_on_the_device(device, metric):
    g = torch.Generator().manual_seed(5)
    bank, queries = torch.randn(600, 32, generator=g), torch.randn(70, 32, generator=g)
    _, i = densematch.knn(queries.to(device), bank.to(device), k=3, metric=metric)
    want = reference_scores(queries, bank, metric).topk(3, dim=1).indices
    assert_same_up_to_ties(queries, bank, i.cpu(), want, metric)


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "cosine", "l1", "linf"])
def test_prototype_distances_and_the_nearest_on_the_device(device, metric):
    g = torch.Generator().manual_seed(7)
    x, protos = torch.randn(2, 16, 9, 11, generator=g), torch.randn(6, 16, generator=g)
    d = densematch.pairwise_distance(x.to(device), protos.to(device), metric=metric)
    assert d.shape == (2, 6, 9, 11) and d.device.type == device.type
    flat = x.permute(0, 2, 3, 1).reshape(-1, 16).double()
    pair = densematch.metrics.get_metric(metric).pair_value(flat[:, None], protos.double()[None])
    pair = 1 - pair if metric == "cosine" else pair  # the distance, where the pair value is the similarity
    want = pair.reshape(2, 9, 11, 6).permute(0, 3, 1, 2)
    torch.testing.assert_close(d.cpu().double(), want, atol=1e-4, rtol=1e-4)
    near = densematch.nearest_prototype(x.to(device), protos.to(device), metric=metric)
    got = near.indices.cpu().reshape(-1, 1)
    want_index = want.argmin(1).reshape(-1, 1)
    assert_same_up_to_ties(flat.float(), protos, got, want_index, metric)


def test_local_match_on_the_device(device, photo_pair):
    a, b = photo_pair
    check_topk(a, b, 3, "cosine", k=2, device=device)


def test_align_on_the_device(device, camera_small):
    img = torch.from_numpy(camera_small.astype(np.float32) / 255)
    tpl = densematch.warp(img, 1.08, 0.93, 5.25, 3.5, (40, 44))
    a = densematch.align(tpl.to(device), img.to(device))
    assert abs(a.scale_h - 1.08) < 0.005 and abs(a.scale_w - 0.93) < 0.005
    assert abs(a.shift_y - 5.25) < 0.5 and abs(a.shift_x - 3.5) < 0.5
