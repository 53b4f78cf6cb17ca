"""Collection settings for the whole tree (doctests of src/ included)."""

import importlib.util
import os

import torch

# Triton kernels are checked on the CPU by Triton's interpreter; the variable must be set before
# a kernel module is imported, since @triton.jit reads it when it decorates.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore = [] if importlib.util.find_spec("triton") else ["src/densematch/kernels/topk.py"]
