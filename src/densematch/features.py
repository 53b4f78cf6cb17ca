"""Dense features for plain images, so images can be matched without a network."""

from __future__ import annotations

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


def patch_descriptor(image: torch.Tensor, size: int = 7) -> torch.Tensor:
    """(H, W, size*size) zero-mean, unit-norm grey patches around each pixel (reflected at the
    border): their cosine similarity is the normalised cross-correlation of the patches."""
    g = _grey(image)[None, None]
    pad = size // 2
    g = F.pad(g, (pad, pad, pad, pad), mode="reflect")
    p = F.unfold(g, size)[0]  # (size*size, H*W)
    p = p - p.mean(0, keepdim=True)
    p = p / p.norm(dim=0, keepdim=True).clamp_min(1e-6)
    return p.T.reshape(image.shape[0], image.shape[1], size * size)


def dense_features(image: np.ndarray | torch.Tensor, name: str = "patch") -> torch.Tensor:
    """Dense (H, W, C) float32 features of an (H, W) or (H, W, 3) image in [0, 1].

    Parameters
    ----------
    image : ndarray or Tensor of shape (H, W) or (H, W, 3)
    name : {"patch", "color", "dsift"}, default="patch"
        "patch": 7x7 zero-mean unit-norm grey patches (C=49), no extra dependency.
        "color": the raw colour (C=3, or 1 for grey images).
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
        return img if img.ndim == 3 else img[..., None]
    if name == "patch":
        return patch_descriptor(img)
    try:
        import kornia
    except ImportError as err:
        raise ImportError("features='dsift' needs kornia: pip install kornia") from err
    g = _grey(img)[None, None]
    desc = kornia.feature.DenseSIFTDescriptor()(g)  # (1, 128, H', W')
    if desc.shape[-2:] != img.shape[:2]:  # keep one descriptor per pixel of the image
        desc = F.interpolate(desc, size=img.shape[:2], mode="bilinear", align_corners=False)
    return desc[0].permute(1, 2, 0).contiguous()
