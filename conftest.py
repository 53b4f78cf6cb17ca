"""Collection settings for the whole tree (doctests of src/ included)."""

import importlib.util
import os
import sys


def _device_asked() -> str:
    """The ``--device`` of this run, read before pytest parses it (see below)."""
    for i, arg in enumerate(sys.argv):
        if arg == "--device" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return os.environ.get("DENSEMATCH_TEST_DEVICE", "cpu")


# On a CPU the tests check the Triton kernel under Triton's interpreter, on every machine (a GPU's
# timings are benchmarks/suites/gpu.py's); with --device cuda it compiles for the GPU. The variable must
# be set before a kernel module is imported, since @triton.jit reads it when it decorates.
if not _device_asked().startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser) -> None:  # type: ignore[no-untyped-def]
    parser.addoption(
        "--device",
        default="cpu",
        help="the device the search-path tests (tests/_paths.py: on_device) run on, e.g. cuda on a GPU runner",
    )


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    import pytest
    import torch

    device = config.getoption("--device")
    try:
        chosen = torch.device(device)
    except RuntimeError as e:
        raise pytest.UsageError(f"--device must name a torch device (cpu, cuda, cuda:1), got {device!r}") from e
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: no CUDA device here")
    os.environ["DENSEMATCH_TEST_DEVICE"] = device  # for the helpers, and xdist's workers


collect_ignore = [] if importlib.util.find_spec("triton") else ["src/densematch/kernels/topk.py"]
