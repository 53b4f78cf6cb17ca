"""The C kernels (densematch.kernels.native) and the fused Triton kernel."""
