import numpy as np
import pytest
import torch

import densematch
from densematch.app.features import dense_features


def shifted_pair(camera_small):
    img = camera_small.astype(np.float32) / 255
    return img[6:58, 8:60], img[0:64, 0:64]


def test_patch_descriptor_is_zero_mean_unit_norm(camera_small):
    f = dense_features(camera_small.astype(np.float32) / 255, "patch")
    assert f.shape == (64, 64, 49)
    textured = f.norm(dim=-1) > 0.5
    torch.testing.assert_close(f.mean(-1)[textured], torch.zeros(int(textured.sum())), atol=1e-5, rtol=0)
    torch.testing.assert_close(f.norm(dim=-1)[textured], torch.ones(int(textured.sum())), atol=1e-4, rtol=0)


def test_color_patches_are_local_and_keep_colour():
    from skimage import data

    rgb = data.astronaut()[100:140, 150:200].astype(np.float32) / 255
    f = dense_features(rgb, "color")
    assert f.shape == (40, 50, 75)
    textured = f.norm(dim=-1) > 0.5
    torch.testing.assert_close(f.mean(-1)[textured], torch.zeros(int(textured.sum())), atol=1e-5, rtol=0)
    # a patch and the same patch with its red and blue swapped differ: colour is described
    swapped = dense_features(rgb[..., ::-1].copy(), "color")
    cos = (f * swapped).sum(-1)[textured]
    assert cos.median() < 0.99
    # never a constant field: neighbouring pixels of a photo differ
    assert (f[1:] - f[:-1]).norm(dim=-1).median() > 0.05


def test_color_on_a_grey_image_warns_and_gives_grey_patches(camera_small):
    grey = camera_small.astype(np.float32) / 255
    with pytest.warns(UserWarning, match="grey image"):
        f = dense_features(grey, "color")
    assert f.shape == (64, 64, 25)


@pytest.mark.parametrize(("name", "tolerance"), [("patch", 0), ("dsift", 2)])
def test_features_find_a_known_shift(camera_small, name, tolerance):
    a, b = shifted_pair(camera_small)
    m = densematch.match(dense_features(a, name), dense_features(b, name), mutual=True)
    rows, cols = m.coords[..., 0].numpy(), m.coords[..., 1].numpy()
    err = np.hypot(rows - (np.arange(52)[:, None] + 6), cols - (np.arange(52) + 8))
    valid = m.valid.numpy()
    assert valid.mean() > 0.3 and (err[valid] <= tolerance).mean() > 0.9


def pck(coords: np.ndarray, truth: np.ndarray, keep: np.ndarray, pixels: float) -> float:
    return float((np.linalg.norm(coords - truth, axis=-1)[keep] <= pixels).mean())


def test_dsift_lands_on_an_integer_shift_as_well_as_patches():
    from skimage import data

    img = data.chelsea().astype(np.float32) / 255
    a, b = img[40:120, 60:160], img[52:132, 51:151]  # a's (r, c) is b's (r - 12, c + 9)
    rows, cols = np.meshgrid(np.arange(80), np.arange(100), indexing="ij")
    truth = np.stack([rows - 12, cols + 9], -1)
    # pixels whose descriptor windows lie inside both crops (the borders see reflected content)
    keep = (rows >= 20) & (rows < 72) & (cols >= 8) & (cols < 83)
    got = {}
    for name in ("patch", "dsift", "color"):
        m = densematch.match(dense_features(a, name), dense_features(b, name))
        got[name] = pck(m.coords.numpy(), truth, keep, 1)
    assert got["dsift"] >= got["patch"] - 1e-9 and got["dsift"] > 0.99
    assert got["color"] > 0.99


def test_bad_feature_name():
    with pytest.raises(ValueError, match="features must be one of 'patch', 'color', 'dsift'"):
        dense_features(np.zeros((4, 4)), "sift")


def test_match_pairs_truth_and_pck():
    from densematch.app.synthetic import match_pairs, pck

    pairs = {p.name: p for p in match_pairs(48)}
    assert list(pairs) == ["shift", "affine", "homography"]
    for p in pairs.values():
        # b sampled at the true positions reproduces a (up to b's own bilinear resampling)
        grid = torch.from_numpy(p.truth[..., ::-1].copy()).float()
        grid = (grid + 0.5) / p.b.shape[0] * 2 - 1
        b = torch.from_numpy(p.b).permute(2, 0, 1)[None]
        seen = torch.nn.functional.grid_sample(b, grid[None], align_corners=False)[0].permute(1, 2, 0).numpy()
        assert np.abs(seen - p.a)[p.inside].mean() < 0.03, p.name
        assert p.inside.mean() > 0.5
    shift = pairs["shift"]
    rows, cols = np.meshgrid(np.arange(48), np.arange(48), indexing="ij")
    np.testing.assert_allclose(shift.truth, np.stack([rows - 12, cols + 9], -1), atol=1e-9)
    assert pck(shift.truth + np.array([0.0, 2.0]), shift.truth, shift.inside) == [0.0, 1.0, 1.0]
