import os

import numpy as np
import pytest
import torch

# under pytest-xdist (make test) each worker takes its share of the cores, not all of them each
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def patch_features(image: np.ndarray, size: int = 5) -> torch.Tensor:
    """(H, W, size*size) local patch features of a grey image, zero-mean per patch."""
    x = torch.as_tensor(image, dtype=torch.float32)[None, None] / 255.0
    p = torch.nn.functional.unfold(x, size, padding=size // 2)[0]
    p = p - p.mean(0, keepdim=True)
    return p.T.reshape(image.shape[0], image.shape[1], size * size)


@pytest.fixture(scope="session")
def camera_small() -> np.ndarray:
    from skimage import data
    from skimage.transform import resize

    img = data.camera()
    return (resize(img, (64, 64), anti_aliasing=True, preserve_range=True)).astype(np.uint8)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
