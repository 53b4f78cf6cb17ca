import numpy as np
import pytest
import torch


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
