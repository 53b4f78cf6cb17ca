import os

import numpy as np
import pytest
import torch

# under pytest-xdist (make test) each worker takes its share of the cores, not all of them each
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def camera_small() -> np.ndarray:
    from skimage import data
    from skimage.transform import resize

    img = data.camera()
    return (resize(img, (64, 64), anti_aliasing=True, preserve_range=True)).astype(np.uint8)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The run's device (``pytest --device cuda`` on a GPU runner; cpu by default): the tests that
    take this fixture run densematch's operations there and judge them on the CPU."""
    from ._paths import DEVICE

    return DEVICE


@pytest.fixture(scope="session", params=["torch", "c"])
def ops(request: pytest.FixtureRequest) -> object:
    """Each implementation of :class:`densematch.ops.Ops` in turn: torch's, and C's where the
    library is built (every machine with a C compiler; CI has one)."""
    from densematch.kernels import native
    from densematch.kernels.c_ops import C_OPS
    from densematch.ops import TORCH_OPS

    if request.param == "c" and native.library() is None:
        pytest.skip("no C compiler on this machine")
    return C_OPS if request.param == "c" else TORCH_OPS


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
