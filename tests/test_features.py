import numpy as np
import pytest
import torch

import densematch
from densematch.features import dense_features


def shifted_pair(camera_small):
    img = camera_small.astype(np.float32) / 255
    return img[6:58, 8:60], img[0:64, 0:64]


def test_patch_descriptor_is_zero_mean_unit_norm(camera_small):
    f = dense_features(camera_small.astype(np.float32) / 255, "patch")
    assert f.shape == (64, 64, 49)
    textured = f.norm(dim=-1) > 0.5
    torch.testing.assert_close(f.mean(-1)[textured], torch.zeros(int(textured.sum())), atol=1e-5, rtol=0)
    torch.testing.assert_close(f.norm(dim=-1)[textured], torch.ones(int(textured.sum())), atol=1e-4, rtol=0)


def test_color_keeps_the_channels():
    rgb = np.random.default_rng(0).random((5, 6, 3)).astype(np.float32)
    assert torch.equal(dense_features(rgb, "color"), torch.from_numpy(rgb))
    assert dense_features(rgb[..., 0], "color").shape == (5, 6, 1)


@pytest.mark.parametrize(("name", "tolerance"), [("patch", 0), ("dsift", 2)])
def test_features_find_a_known_shift(camera_small, name, tolerance):
    a, b = shifted_pair(camera_small)
    m = densematch.match(dense_features(a, name), dense_features(b, name), mutual=True)
    rows, cols = m.coords[..., 0].numpy(), m.coords[..., 1].numpy()
    err = np.hypot(rows - (np.arange(52)[:, None] + 6), cols - (np.arange(52) + 8))
    valid = m.valid.numpy()
    assert valid.mean() > 0.3 and (err[valid] <= tolerance).mean() > 0.9


def test_bad_feature_name():
    with pytest.raises(ValueError, match="features must be one of 'patch', 'color', 'dsift'"):
        dense_features(np.zeros((4, 4)), "sift")
