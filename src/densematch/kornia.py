"""Kornia's descriptor matchers, computed by the bounded engine: never a B1 x B2 matrix.

Drop-in twins of ``kornia.feature.match_nn``, ``match_mnn``, ``match_snn``, ``match_smnn``,
``match_fginn``, ``match_smnn_batched`` and ``DescriptorMatcher``: the same names, argument order,
defaults and return conventions (see Kornia's Convention block on ``match_nn``), so that one
import line changes::

    from densematch.kornia import match_snn      # was: from kornia.feature import match_snn

Each takes a ``memory=`` keyword more (the working-memory budget, as in :func:`densematch.match`).
Without ``dm``, the nearest neighbours come from :func:`densematch.engine.topk` with the l2 metric
(exact, ties to the lower index), and their distances are recomputed directly from the two
descriptors, with autograd when the descriptors require it. A caller-supplied ``dm`` is read as
Kornia reads it (the caller already holds the full matrix). Kornia is not needed.

What differs from Kornia (0.9), by design:
- Distances are computed directly (``||d1 - d2||``) instead of through ``torch.cdist``'s
  matrix-product form, so they can differ from Kornia's in the last digits, and near-ties can
  be broken the other way. Exact ties go to the lower index (Kornia: ``torch.topk``'s order).
- Half-precision descriptors are searched in float32 and the distances or ratios rounded back
  to the input dtype, as ``match_smnn_batched`` already does in Kornia; Kornia's other functions
  take their ratios of distances already rounded to half precision.
"""

# no `from __future__ import annotations` here: TorchScript reads DescriptorMatcher's annotations
from typing import Any

import torch
from torch import nn

from . import engine
from .checks import check_bool
from .config import resolve_memory
from .metrics import METRICS
from .precision import resolve_precision

__all__ = [
    "DescriptorMatcher",
    "match_fginn",
    "match_mnn",
    "match_nn",
    "match_smnn",
    "match_smnn_batched",
    "match_snn",
]

_L2 = METRICS["l2"]


def _check_descriptors(*pairs: tuple[torch.Tensor, str]) -> None:
    for desc, name in pairs:
        if not isinstance(desc, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, D), got {type(desc).__name__}")
        if desc.ndim != 2:
            raise ValueError(f"{name} must have shape (B, D), got {tuple(desc.shape)}")
        if not desc.is_floating_point():
            raise TypeError(f"{name} must hold floats, got {desc.dtype}; convert with .float()")


def _check_dm(desc1: torch.Tensor, desc2: torch.Tensor, dm: torch.Tensor) -> None:
    if dm.ndim != 2 or dm.shape != (desc1.shape[0], desc2.shape[0]):
        raise ValueError(
            f"dm must have shape (B1, B2) = ({desc1.shape[0]}, {desc2.shape[0]}), the descriptors' counts, "
            f"got {tuple(dm.shape)}"
        )


def _no_match(like: torch.Tensor, columns: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Kornia's empty result: (0, 1) distances in ``like``'s dtype, (0, columns) int64 indices."""
    return like.new_empty((0, 1)), torch.empty((0, columns), dtype=torch.long, device=like.device)


def _nearest(
    query: torch.Tensor,
    ref: torch.Tensor,
    k: int,
    memory: int | str | None,
    rows_a: torch.Tensor | None = None,
    rows_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest rows of ``ref`` (l2) of each row of ``query``: distances (n, k) in the
    descriptors' dtype, recomputed directly (differentiable where the inputs require grad), and
    indices (n, k) int64, -1 (distance inf) beyond the rows available."""
    wide = torch.float64 in (query.dtype, ref.dtype)
    precision = resolve_precision("exact", query.device, _L2, float64=wide)
    budget = resolve_memory(memory, query.device)
    value, index = engine.search(
        query, ref, metric=_L2, k=k, budget=budget, precision=precision, rows_a=rows_a, rows_b=rows_b
    )
    if torch.is_grad_enabled() and (query.requires_grad or ref.requires_grad):
        q = query if rows_a is None else query[rows_a]
        diff = q.to(precision.dtype)[:, None, :] - ref.to(precision.dtype)[index.clamp_min(0)]
        value = torch.linalg.vector_norm(diff, dim=-1)
    value = torch.where(index >= 0, value, torch.inf)
    return value.to(query.dtype), index


def _neighbours(
    desc1: torch.Tensor, desc2: torch.Tensor, k: int, dm: torch.Tensor | None, memory: int | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest of desc2 for each row of desc1, best first: from ``dm`` when given (its
    entries, in its dtype), else from the engine."""
    if dm is not None:
        return torch.topk(dm, k, dim=1, largest=False)
    return _nearest(desc1, desc2, k, memory)


def _reverse(
    desc1: torch.Tensor, desc2: torch.Tensor, dm: torch.Tensor | None, memory: int | str | None
) -> torch.Tensor:
    """(B2,) the nearest row of desc1 of each row of desc2."""
    if dm is not None:
        return torch.min(dm, dim=0).indices
    return _nearest(desc2, desc1, 1, memory)[1][:, 0]


def _pairs(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.stack([first, second], dim=1).view(-1, 2)


def match_nn(
    desc1: torch.Tensor, desc2: torch.Tensor, dm: torch.Tensor | None = None, *, memory: int | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest neighbour in desc2 of every descriptor of desc1 (``kornia.feature.match_nn``).

    Parameters
    ----------
    desc1 : Tensor of shape (B1, D)
    desc2 : Tensor of shape (B2, D)
    dm : Tensor of shape (B1, B2), optional
        Distances to use instead (any matrix where smaller is better; its entries are returned).
    memory : int or str, optional
        The working-memory budget, as in :func:`densematch.match`.

    Returns
    -------
    dists : Tensor of shape (B1, 1)
        The distances, in dm's dtype when given, else the descriptors'.
    idxs : Tensor of shape (B1, 2), int64
        Rows (index in desc1, index in desc2).

    Examples
    --------
    >>> d1 = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    >>> d2 = torch.tensor([[1.0, 1.0], [0.0, 0.1]])
    >>> match_nn(d1, d2)[1]
    tensor([[0, 1],
            [1, 0]])
    """
    _check_descriptors((desc1, "desc1"), (desc2, "desc2"))
    if desc1.shape[0] == 0 or desc2.shape[0] == 0:
        return _no_match(desc1)
    if dm is not None:
        _check_dm(desc1, desc2, dm)
    value, index = _neighbours(desc1, desc2, 1, dm, memory)
    return value.view(-1, 1), _pairs(torch.arange(desc1.shape[0], device=desc1.device), index[:, 0])


def match_mnn(
    desc1: torch.Tensor, desc2: torch.Tensor, dm: torch.Tensor | None = None, *, memory: int | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mutual nearest neighbours (``kornia.feature.match_mnn``): pairs that are each other's
    nearest. Ordered by desc1's index when B1 <= B2, else by desc2's, as Kornia orders them.

    Returns
    -------
    dists : Tensor of shape (B3, 1)
    idxs : Tensor of shape (B3, 2), int64
        With 0 <= B3 <= min(B1, B2).
    """
    _check_descriptors((desc1, "desc1"), (desc2, "desc2"))
    if desc1.shape[0] == 0 or desc2.shape[0] == 0:
        return _no_match(desc1)
    if dm is not None:
        _check_dm(desc1, desc2, dm)
    value, index = _neighbours(desc1, desc2, 1, dm, memory)
    forward, dists = index[:, 0], value[:, 0]
    back = _reverse(desc1, desc2, dm, memory)
    rows = torch.arange(desc1.shape[0], device=desc1.device)
    mutual = back[forward] == rows
    pairs, dists = _pairs(rows, forward)[mutual], dists[mutual].view(-1, 1)
    # Kornia orders by desc2's index when B1 > B2; decided by tensors, so that a trace keeps
    # the rule for inputs of other sizes (each side appears once: the keys are distinct)
    by_desc2 = torch.ones_like(desc1[:, 0]).sum() > torch.ones_like(desc2[:, 0]).sum()
    order = torch.where(by_desc2, pairs[:, 1], pairs[:, 0]).argsort()
    return dists[order], pairs[order]


def _ratio_test(value: torch.Tensor, index: torch.Tensor, th: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lowe's test on the two nearest (n, 2): (ratio, kept, nearest) with kept = ratio <= th
    (a 0/0 ratio, a second neighbour at distance 0, fails as in Kornia)."""
    ratio = value[:, 0] / value[:, 1]
    return ratio, ratio <= th, index[:, 0]


def match_snn(
    desc1: torch.Tensor,
    desc2: torch.Tensor,
    th: float = 0.8,
    dm: torch.Tensor | None = None,
    *,
    memory: int | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest neighbours that pass Lowe's ratio test, nearest / second nearest <= th
    (``kornia.feature.match_snn``).

    Returns
    -------
    dists : Tensor of shape (B3, 1)
        The ratio of each match (not a distance).
    idxs : Tensor of shape (B3, 2), int64
        With 0 <= B3 <= B1; no match unless desc2 has two rows.
    """
    _check_descriptors((desc1, "desc1"), (desc2, "desc2"))
    if desc1.shape[0] == 0 or desc2.shape[0] < 2:
        return _no_match(desc1)
    if dm is not None:
        _check_dm(desc1, desc2, dm)
    ratio, kept, nearest = _ratio_test(*_neighbours(desc1, desc2, 2, dm, memory), th)
    rows = torch.arange(desc1.shape[0], device=desc1.device)
    return ratio[kept].view(-1, 1), _pairs(rows[kept], nearest[kept])


def match_smnn(
    desc1: torch.Tensor,
    desc2: torch.Tensor,
    th: float = 0.95,
    dm: torch.Tensor | None = None,
    *,
    memory: int | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mutual nearest neighbours that pass the ratio test both ways (``kornia.feature.match_smnn``);
    the returned value is the larger of the two ratios.

    Returns
    -------
    dists : Tensor of shape (B3, 1)
    idxs : Tensor of shape (B3, 2), int64
        Ordered by desc1's index; no match unless both sides have two rows.
    """
    _check_descriptors((desc1, "desc1"), (desc2, "desc2"))
    if desc1.shape[0] < 2 or desc2.shape[0] < 2:
        return _no_match(desc1)
    if dm is not None:
        _check_dm(desc1, desc2, dm)
    dists1, idx1 = match_snn(desc1, desc2, th, dm, memory=memory)
    dists2, idx2 = match_snn(desc2, desc1, th, None if dm is None else dm.t(), memory=memory)
    # each row of desc2 appears at most once in idx2: join on it
    lookup = torch.full((desc2.shape[0],), -1, dtype=torch.long, device=idx2.device)
    lookup[idx2[:, 0]] = torch.arange(idx2.shape[0], device=idx2.device)
    where = lookup[idx1[:, 1]]
    mutual = (where >= 0) & (idx2[where.clamp_min(0), 1] == idx1[:, 0])
    return torch.maximum(dists1[mutual], dists2[where[mutual]]), idx1[mutual]


def match_fginn(
    desc1: torch.Tensor,
    desc2: torch.Tensor,
    lafs1: torch.Tensor,
    lafs2: torch.Tensor,
    th: float = 0.8,
    spatial_th: float = 10.0,
    mutual: bool = False,
    dm: torch.Tensor | None = None,
    *,
    memory: int | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio test against the nearest *geometrically distinct* competitor
    (``kornia.feature.match_fginn``): the second neighbour is the nearest of the min(10, B2)
    nearest whose ``lafs2`` centre lies at least ``spatial_th`` from the first one's; with none
    the ratio is 0 and the match is kept.

    Parameters
    ----------
    desc1, desc2 : Tensor of shape (B1, D), (B2, D)
    lafs1 : Tensor of shape (1, B1, 2, 3)
        Not read (as in Kornia).
    lafs2 : Tensor of shape (1, B2, 2, 3)
        Only the centres (``lafs2[..., 2]``) are read.
    th, spatial_th, mutual, dm, memory
        As in Kornia; ``memory`` as in :func:`densematch.match`.
    """
    _check_descriptors((desc1, "desc1"), (desc2, "desc2"))
    check_bool(mutual, "mutual")
    if dm is not None:
        _check_dm(desc1, desc2, dm)
    like = desc1 if dm is None else dm
    if desc2.shape[0] < 2:
        return _no_match(like)
    candidates = max(2, min(10, desc2.shape[0]))
    value, index = _neighbours(desc1, desc2, candidates, dm, memory)
    xy = lafs2[..., :, 2].reshape(-1, 2)[index]  # (B1, candidates, 2)
    apart = torch.linalg.vector_norm(xy - xy[:, :1], dim=2)[:, 1:]
    second = torch.where(apart < spatial_th, torch.inf, value[:, 1:]).min(dim=1).values
    ratio = value[:, 0] / second
    kept = ratio <= th
    if not bool(kept.any()):
        return _no_match(like)
    rows = torch.arange(desc1.shape[0], device=desc1.device)
    dists, idxs = ratio[kept].view(-1, 1), _pairs(rows[kept], index[:, 0][kept])
    if not mutual:
        return dists, idxs
    good = idxs[:, 0] == _reverse(desc1, desc2, dm, memory)[idxs[:, 1]]
    return dists[good], idxs[good]


def _batched_side(
    query: torch.Tensor,
    ref: torch.Tensor,
    valid_q: torch.Tensor,
    valid_r: torch.Tensor,
    dm: torch.Tensor | None,
    memory: int | str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two nearest valid rows of ``ref`` of every row of ``query`` (invalid query rows and
    missing neighbours: inf, index 0), as (n, 2) distances and indices."""
    n = query.shape[0]
    if dm is not None:
        masked = dm.masked_fill(~(valid_q[:, None] & valid_r[None, :]), torch.inf)
        return masked.topk(2, dim=1, largest=False)
    value = torch.full((n, 2), torch.inf, dtype=query.dtype, device=query.device)
    index = torch.zeros((n, 2), dtype=torch.long, device=query.device)
    rows_q, rows_r = valid_q.nonzero().squeeze(1), valid_r.nonzero().squeeze(1)
    if rows_q.numel() and rows_r.numel():
        v, i = _nearest(query, ref, 2, memory, rows_a=rows_q, rows_b=rows_r)
        value[rows_q], index[rows_q] = v, i.clamp_min(0)
    return value, index


def match_smnn_batched(
    desc1: torch.Tensor,
    desc2: torch.Tensor,
    th: float = 0.95,
    dm: torch.Tensor | None = None,
    mask1: torch.Tensor | None = None,
    mask2: torch.Tensor | None = None,
    *,
    memory: int | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`match_smnn` for B independent pairs of descriptor sets, padded to one size, with
    validity masks (``kornia.feature.match_smnn_batched``, Kornia 0.9).

    Parameters
    ----------
    desc1, desc2 : Tensor of shape (B, N, D), (B, M, D)
        The same floating dtype and device.
    th : float, default=0.95
        Inclusive ratio threshold.
    dm : Tensor of shape (B, N, M), optional
        Distances to use instead, in the descriptors' dtype.
    mask1, mask2 : bool Tensor of shape (B, N), (B, M), optional
        Valid descriptors; padding is never read and never a neighbour.
    memory : int or str, optional
        As in :func:`densematch.match`.

    Returns
    -------
    ratios : Tensor of shape (K, 1)
        The larger of the two ratios of each match, in the descriptors' dtype.
    indices : Tensor of shape (K, 3), int64
        (batch index, index in desc1, index in desc2), sorted by batch and desc1's index. A pair
        with fewer than two valid descriptors on either side gives no match.
    """
    for desc, name, dims in ((desc1, "desc1", "(B, N, D)"), (desc2, "desc2", "(B, M, D)")):
        if not isinstance(desc, torch.Tensor) or desc.ndim != 3:
            raise ValueError(f"{name} must be a tensor of shape {dims}, got {getattr(desc, 'shape', type(desc))}")
    batch, n, dim = desc1.shape
    if desc2.shape[0] != batch or desc2.shape[2] != dim:
        raise ValueError("Descriptor batch sizes and dimensions must match")
    if desc1.device != desc2.device or desc1.dtype != desc2.dtype or not desc1.is_floating_point():
        raise ValueError("Descriptors must have the same floating dtype and device")
    m = desc2.shape[1]
    if dm is not None and (dm.shape != (batch, n, m) or dm.device != desc1.device or dm.dtype != desc1.dtype):
        raise ValueError("Distance matrix must have shape (B, N, M) and the descriptor dtype/device")
    for mask, shape in ((mask1, (batch, n)), (mask2, (batch, m))):
        if mask is not None and (mask.shape != shape or mask.dtype != torch.bool or mask.device != desc1.device):
            raise ValueError("Validity masks must be boolean tensors with shape (B, N)/(B, M) on the input device")
    if batch == 0 or n < 2 or m < 2:
        return _no_match(desc1, columns=3)
    valid1 = torch.ones((batch, n), dtype=torch.bool, device=desc1.device) if mask1 is None else mask1
    valid2 = torch.ones((batch, m), dtype=torch.bool, device=desc1.device) if mask2 is None else mask2
    work1 = desc1.float() if desc1.dtype in (torch.float16, torch.bfloat16) else desc1
    work2 = desc2.float() if desc2.dtype in (torch.float16, torch.bfloat16) else desc2
    ratios, indices = [], []
    for b in range(batch):
        if int(valid1[b].sum()) < 2 or int(valid2[b].sum()) < 2:
            continue
        d = None if dm is None else dm[b]
        v1, n1 = _batched_side(work1[b], work2[b], valid1[b], valid2[b], d, memory)
        v2, n2 = _batched_side(work2[b], work1[b], valid2[b], valid1[b], None if d is None else d.t(), memory)
        defined1 = torch.isfinite(v1).all(-1) & (v1[:, 1] > 0)
        defined2 = torch.isfinite(v2).all(-1) & (v2[:, 1] > 0)
        # finite operands before dividing: a 0/0 rejected after the division would still
        # put NaN in the gradient
        ratio1 = torch.where(defined1, v1[:, 0], 0.0) / torch.where(defined1, v1[:, 1], 1.0)
        ratio2 = torch.where(defined2, v2[:, 0], 0.0) / torch.where(defined2, v2[:, 1], 1.0)
        nearest = n1[:, 0]
        back = ratio2[nearest]
        mutual = n2[nearest, 0] == torch.arange(n, device=desc1.device)
        keep = valid1[b] & defined1 & defined2[nearest] & mutual & (ratio1 <= th) & (back <= th)
        rows = keep.nonzero().squeeze(1)
        ratios.append(torch.maximum(ratio1, back)[rows])
        indices.append(torch.stack([torch.full_like(rows, b), rows, nearest[rows]], dim=1))
    if not ratios:
        return _no_match(desc1, columns=3)
    return torch.cat(ratios).unsqueeze(1).to(desc1.dtype), torch.cat(indices)


class DescriptorMatcher(nn.Module):
    """``kornia.feature.DescriptorMatcher``: one of nn, mnn, snn, smnn as a module, bounded.

    Parameters
    ----------
    match_mode : {"nn", "mnn", "snn", "smnn"}, default="snn"
        Case-insensitive; another raises NotImplementedError, as in Kornia.
    th : float, default=0.8
        The ratio threshold of snn and smnn (both default to 0.8 here, as in Kornia).
    memory : int or str, optional
        As in :func:`densematch.match`.

    ``forward(desc1, desc2)`` returns what the function of ``match_mode`` returns. The module
    scripts (``torch.jit.script``); the scripted forward calls the Python search.

    Examples
    --------
    >>> matcher = DescriptorMatcher("smnn", 0.9)
    >>> dists, idxs = matcher(torch.randn(50, 8), torch.randn(60, 8))
    >>> idxs.shape[1]
    2
    """

    def __init__(self, match_mode: str = "snn", th: float = 0.8, *, memory: int | str | None = None) -> None:
        super().__init__()
        mode = match_mode.lower()
        self.known_modes = ["nn", "mnn", "snn", "smnn"]
        if mode not in self.known_modes:
            raise NotImplementedError(f"{match_mode} is not supported. Try one of {self.known_modes}")
        self.match_mode = mode
        self.th = th
        self.memory = memory

    def forward(self, desc1: torch.Tensor, desc2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._match(desc1, desc2)

    @torch.jit.ignore  # type: ignore[untyped-decorator]
    def _match(self, desc1: torch.Tensor, desc2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory: Any = self.memory
        if self.match_mode == "nn":
            return match_nn(desc1, desc2, memory=memory)
        if self.match_mode == "mnn":
            return match_mnn(desc1, desc2, memory=memory)
        if self.match_mode == "snn":
            return match_snn(desc1, desc2, self.th, memory=memory)
        return match_smnn(desc1, desc2, self.th, memory=memory)

    def extra_repr(self) -> str:
        return f"match_mode={self.match_mode!r}, th={self.th}" + (
            f", memory={self.memory!r}" if self.memory is not None else ""
        )
