"""Collection settings for the whole tree (doctests of src/ included)."""

import importlib.util
import os

# The tests check the Triton kernel on CPU tensors under Triton's interpreter, on every machine
# (a GPU's timings are benchmarks/gpu.py's). The variable must be set before a kernel module is
# imported, since @triton.jit reads it when it decorates.
os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore = [] if importlib.util.find_spec("triton") else ["src/densematch/kernels/topk.py"]
