"""The warp of :func:`densematch.align`: bilinear stretch and crop, as two small matrix products
(``Ry @ image @ Rx.T``), and the checks of :func:`densematch.warp`'s arguments."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..checks import as_tensor

__all__ = ["as_image", "bilinear_taps", "sampling_matrix", "taps_at", "warp", "warp_batch"]


def taps_at(y: torch.Tensor, n_in: int) -> tuple[torch.Tensor, ...]:
    """The two taps (i0, i1: int64) and weights (w0, w1) of bilinear samples at input
    coordinates ``y`` in [0, n_in - 1] (i1 == i0 on the last input pixel)."""
    i0 = y.floor().clamp(max=max(n_in - 2, 0))
    frac = y - i0
    i0 = i0.long()
    return i0, (i0 + 1).clamp(max=n_in - 1), 1 - frac, frac


def bilinear_taps(n_out: int, n_in: int, scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`taps_at` of output pixels i (M, n_out) at input coordinate
    (i + shift + 0.5) / scale - 0.5, clamped to the input like ``interpolate``."""
    i = torch.arange(n_out, dtype=scale.dtype, device=scale.device)
    return taps_at(((i + shift[:, None] + 0.5) / scale[:, None] - 0.5).clamp(0, n_in - 1), n_in)


def sampling_matrix(
    n_out: int, n_in: int, scale: torch.Tensor, shift: torch.Tensor, derivative: bool = False
) -> torch.Tensor:
    """(M, n_out, n_in) bilinear weights of output pixels i at input coordinate
    (i + shift + 0.5) / scale - 0.5, clamped to the input like ``interpolate`` (:func:`bilinear_taps`);
    with ``derivative=True``, their derivative with respect to that coordinate."""
    i0, i1, w0, w1 = bilinear_taps(n_out, n_in, scale, shift)
    out = torch.zeros(scale.shape[0], n_out, n_in, dtype=scale.dtype, device=scale.device)
    if derivative:
        w0, w1 = -torch.ones_like(w0), torch.ones_like(w1)
        w0 = torch.where(i1 == i0, 0.0, w0)
        w1 = torch.where(i1 == i0, 0.0, w1)
    out.scatter_add_(2, i0[..., None], w0[..., None])
    out.scatter_add_(2, i1[..., None], w1[..., None])
    return out


def warp(image: Any, scale_h: Any, scale_w: Any, shift_y: Any, shift_x: Any, size: tuple[int, int]) -> torch.Tensor:
    """The image stretched by (scale_h, scale_w) and cropped at (shift_y, shift_x).

    Parameters
    ----------
    image : Tensor or ndarray of shape (H, W), (B, H, W) or (B, C, H, W)
    scale_h, scale_w, shift_y, shift_x : float or Tensor of shape (B,)
    size : (int, int)
        The crop's (h, w).

    Returns
    -------
    Tensor of shape (h, w), (B, h, w) or (B, C, h, w), float32 (float64 for float64 images)

    Examples
    --------
    >>> img = torch.rand(20, 30)
    >>> ref = torch.nn.functional.interpolate(img[None, None], scale_factor=(1.5, 0.5), mode="bilinear")
    >>> out = warp(img, 1.5, 0.5, 3, 2, (10, 8))
    >>> bool(torch.allclose(out, ref[0, 0, 3:13, 2:10], atol=1e-6))
    True
    """
    x = as_image(image, "image")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"image must have shape (H, W), (B, H, W) or (B, C, H, W), got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"image must not be empty, got shape {tuple(x.shape)}")
    size = _check_size(size)
    ndim = x.ndim
    x4 = x.reshape(-1, 1, *x.shape[-2:]) if ndim < 4 else x
    b = x4.shape[0]
    names = ("scale_h", "scale_w", "shift_y", "shift_x")
    sh, sw, sy, sx = (
        _warp_param(v, name, b, x4) for v, name in zip((scale_h, scale_w, shift_y, shift_x), names, strict=True)
    )
    out = warp_batch(x4, sh, sw, sy, sx, size)
    return out.reshape(*x.shape[:-2], *size)


def _check_size(size: Any) -> tuple[int, int]:
    rule = f"size must be a pair (h, w) of positive ints, got {size!r}"
    try:
        h, w = size
    except (TypeError, ValueError):
        raise TypeError(rule) from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (h, w)):
        raise TypeError(rule)
    if h < 1 or w < 1:
        raise ValueError(rule)
    return int(h), int(w)


def _warp_param(value: Any, name: str, b: int, x4: torch.Tensor) -> torch.Tensor:
    """One warp parameter as a (b,) tensor: a number, or one value per image of the batch."""
    wrong_type = TypeError(f"{name} must be a real number or a tensor of shape ({b},), got {type(value).__name__}")
    if isinstance(value, (bool, np.bool_)):
        raise wrong_type
    try:  # a Python number straight in the image's dtype (not through float32, torch's default)
        plain = isinstance(value, (int, float))  # bools were refused above
        t = torch.as_tensor(value, device=x4.device, dtype=x4.dtype if plain else None)
    except (TypeError, ValueError, RuntimeError):
        raise wrong_type from None
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
    if t.numel() not in (1, b) or t.ndim > 1:
        raise ValueError(f"{name} must be one number or one per image (shape ({b},)), got shape {tuple(t.shape)}")
    t = t.to(x4.dtype).reshape(-1).expand(b)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if name.startswith("scale") and not bool((t > 0).all()):
        raise ValueError(f"{name} must be positive, got {value!r}")
    return t


def warp_batch(
    x: torch.Tensor, sh: torch.Tensor, sw: torch.Tensor, sy: torch.Tensor, sx: torch.Tensor, size: tuple[int, int]
) -> torch.Tensor:
    """(M, C, h, w) from images x (M, C, H, W) and per-image parameters (M,)."""
    ry = sampling_matrix(size[0], x.shape[-2], sh, sy)
    rx = sampling_matrix(size[1], x.shape[-1], sw, sx)
    return ry[:, None] @ x @ rx[:, None].transpose(-1, -2)


def as_image(x: Any, name: str) -> torch.Tensor:
    """Float images; integers scaled to [0, 1] by their type's maximum, booleans to 0 / 1."""
    t = as_tensor(x, name)
    if t.dtype == torch.bool:
        return t.float()
    if not t.is_floating_point():
        if t.is_complex():
            raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
        return t.float() / float(torch.iinfo(t.dtype).max)
    return t if t.dtype == torch.float64 else t.float()
