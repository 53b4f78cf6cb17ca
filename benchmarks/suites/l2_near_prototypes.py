"""l2 distances of pixels 1e-3 from a prototype: densematch.pairwise_distance and torch.cdist
against a float64 reference (the claim in ``densematch bench``'s l2 row).

Run: python benchmarks/suites/l2_near_prototypes.py
"""

from __future__ import annotations

import torch

import densematch


def main() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(128, 64, generator=g) + 3  # prototypes away from the origin: large norms
    x = p[:4, :, None, None] + 1e-3 * torch.randn(4, 64, 8, 8, generator=g)  # pixels near them
    rows = x.flatten(2).transpose(1, 2)
    ref = torch.cdist(rows.double(), p.double())
    near = ref < 0.05
    for name, got in (
        ("torch.cdist", torch.cdist(rows, p)),
        ("densematch.pairwise_distance", densematch.pairwise_distance(x, p, metric="l2").flatten(2).transpose(1, 2)),
    ):
        err = ((got.double() - ref).abs() / ref)[near]
        print(f"{name:30} largest relative error over the {int(near.sum())} near pairs: {float(err.max()):.3g}")


if __name__ == "__main__":
    main()
