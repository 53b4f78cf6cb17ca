"""IEEE products for the length of a search, whatever the process set."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["strict_products"]

_STRICT_LOCK = threading.Lock()
_strict_users = 0
_strict_saved: tuple[str, bool, bool] | None = None
_STRICT = ("highest", False, False)


def _product_settings() -> tuple[str, bool, bool]:
    cuda = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision(),
        cuda.allow_fp16_reduced_precision_reduction,
        cuda.allow_bf16_reduced_precision_reduction,
    )


def _apply_product_settings(settings: tuple[str, bool, bool]) -> None:
    cuda = torch.backends.cuda.matmul
    if torch.get_float32_matmul_precision() != settings[0]:
        torch.set_float32_matmul_precision(settings[0])
    cuda.allow_fp16_reduced_precision_reduction, cuda.allow_bf16_reduced_precision_reduction = settings[1:]


def _is_strict(settings: tuple[str, bool, bool], device: torch.device) -> bool:
    # the reduced-precision sums are cuBLAS's: on a CPU only the float32 precision matters
    return settings == _STRICT if device.type == "cuda" else settings[0] == _STRICT[0]


@contextlib.contextmanager
def strict_products(device: torch.device) -> Iterator[None]:
    """IEEE float32 products, and float32 sums inside half-precision ones, for this search:
    the results (and the rounding bound) assume them, whatever the process set (TF32 or
    bfloat16 through ``torch.set_float32_matmul_precision``, cuBLAS's reduced-precision half
    reductions).

    Where the settings already are strict for ``device`` (torch's defaults on a CPU), nothing
    global is touched. Otherwise they are switched while any search runs and restored when the
    last one ends: overlapping searches in threads share one switch, so none restores settings
    under another, and the caller's own settings come back exactly."""
    global _strict_users, _strict_saved
    with _STRICT_LOCK:
        if _strict_users == 0 and not _is_strict(_product_settings(), device):
            _strict_saved = _product_settings()
            _apply_product_settings(_STRICT)
        _strict_users += 1
    try:
        yield
    finally:
        with _STRICT_LOCK:
            _strict_users -= 1
            if _strict_users == 0 and _strict_saved is not None:
                _apply_product_settings(_strict_saved)
                _strict_saved = None
