"""Dense features for plain images, so images can be matched without a network."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["FEATURES", "dense_features"]

FEATURES = ("patch", "color", "dsift")


def _grey(image: torch.Tensor) -> torch.Tensor:
    if image.ndim == 3:
        weights = torch.tensor([0.299, 0.587, 0.114], dtype=image.dtype)[: image.shape[-1]]
        return (image[..., : weights.numel()] * weights).sum(-1) / weights.sum()
    return image


def patch_descriptor(image: torch.Tensor, size: int = 7, colour: bool = False) -> torch.Tensor:
    """(H, W, ch*size*size) zero-mean, unit-norm patches around each pixel (reflected at the
    border): their cosine similarity is the normalised cross-correlation of the patches.

    Grey patches (ch=1), or with ``colour`` the patch of each channel of an (H, W, 3) image,
    made zero-mean over the whole patch rather than per channel, so that the patch's colour
    differences stay in the descriptor while its brightness and contrast go."""
    g = (image.permute(2, 0, 1) if colour and image.ndim == 3 else _grey(image)[None])[None]
    pad = size // 2
    g = F.pad(g, (pad, pad, pad, pad), mode="reflect" if min(g.shape[-2:]) > pad else "replicate")
    p = F.unfold(g, size)[0]  # (ch*size*size, H*W)
    p = p - p.mean(0, keepdim=True)
    p = p / p.norm(dim=0, keepdim=True).clamp_min(1e-6)
    return p.T.reshape(image.shape[0], image.shape[1], p.shape[0])


def _dense_sift(grey: torch.Tensor) -> torch.Tensor:
    """Kornia's dense SIFT, one descriptor per pixel on the image's own grid."""
    try:
        import kornia
    except ImportError as err:
        raise ImportError("features='dsift' needs kornia: pip install kornia") from err
    sift = kornia.feature.DenseSIFTDescriptor()
    g = grey[None, None]
    # its map is smaller than the image by the window's span less one (9 rows and columns at
    # the defaults): pad by that, split around the window's centre, so that descriptor (i, j)
    # is centred at pixel (i, j) of every image alike (stretching the smaller map back instead
    # moved each image's descriptors by its own fraction of a pixel)
    lost = 32 - sift(g.new_zeros(1, 1, 32, 32)).shape[-1]
    before, after = lost // 2, lost - lost // 2
    mode = "reflect" if min(g.shape[-2:]) > after else "replicate"
    desc = sift(F.pad(g, (before, after, before, after), mode=mode))  # (1, 128, H, W)
    return desc[0].permute(1, 2, 0).contiguous()


def dense_features(image: np.ndarray | torch.Tensor, name: str = "patch") -> torch.Tensor:
    """Dense (H, W, C) float32 features of an (H, W) or (H, W, 3) image in [0, 1].

    Parameters
    ----------
    image : ndarray or Tensor of shape (H, W) or (H, W, 3)
    name : {"patch", "color", "dsift"}, default="patch"
        "patch": 7x7 zero-mean unit-norm grey patches (C=49), no extra dependency.
        "color": 5x5 colour patches, zero-mean over the whole patch and unit-norm (C=75; a
        grey image gives grey patches, C=25, with a warning).
        "dsift": Kornia's dense SIFT descriptor (C=128), where kornia is installed.

    Examples
    --------
    >>> dense_features(np.random.rand(20, 30), "patch").shape
    torch.Size([20, 30, 49])
    """
    if name not in FEATURES:
        raise ValueError(f"features must be one of {', '.join(repr(f) for f in FEATURES)}, got {name!r}")
    img = torch.as_tensor(np.asarray(image), dtype=torch.float32)
    if img.ndim not in (2, 3):
        raise ValueError(f"image must have shape (H, W) or (H, W, 3), got {tuple(img.shape)}")
    if name == "color":
        if img.ndim == 2:
            warnings.warn(
                "features='color' on a grey image: its colour patches are grey patches (use 'patch')",
                stacklevel=2,
            )
        return patch_descriptor(img, size=5, colour=True)
    if name == "patch":
        return patch_descriptor(img)
    return _dense_sift(_grey(img))
