# mypy: disable-error-code="untyped-decorator, no-untyped-def"
# (a Triton kernel: its arguments are Triton's own types, bound when the kernel is launched)
"""A fused Triton kernel: tile products plus a running top-k per row, scores never written.

One program owns ``BLOCK_M`` query rows. It walks the references ``BLOCK_N`` rows at a time,
accumulates their scores in float32 from half-precision (or float32) operands with ``tl.dot``,
and merges the tile into the rows' running top-k, kept in registers as ``K`` (value, index)
slots. When no row of the tile beats its k-th best, which after the first tiles is most of them,
the merge is skipped. Equal scores go to the lower index: a tile's maxima are taken lowest column
first, and a new score must beat (not equal) the slot it replaces.

With ``CERTIFY``, each score ``h`` gets its rounding bound ``e = x_i y_j + z_i w_j + f`` from
per-row terms (:mod:`densematch.precision`); the running top-k keeps the lower bounds ``h - e``,
and every pair whose upper bound ``h + e`` reaches the row's k-th lower bound is listed: a counter
per row is bumped atomically and the column is written to that row's slot of ``cand`` while it
has room. The k-th lower bound only rises, so every reference the final one admits was listed
when it was seen; rows whose counter passes ``CAP`` are searched again by the engine.

The running state lives in ``val``/``idx`` between launches, so one query tile can be merged with
any number of reference tiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import interpreting

__all__ = ["BLOCKS", "topk_launch"]

# (BLOCK_M, BLOCK_N, BLOCK_C, num_warps) on a GPU: a common shape for Triton matrix products on
# tensor cores, not yet tuned on one (benchmarks/suites/gpu.py times the alternatives in
# DENSEMATCH_KERNEL_BLOCKS, e.g. "128,64,64,4").
BLOCKS = tuple(int(v) for v in os.environ.get("DENSEMATCH_KERNEL_BLOCKS", "128,128,64,8").split(","))


@triton.jit
def _topk_kernel(
    q_ptr,
    r_ptr,
    qt_ptr,
    rt_ptr,
    val_ptr,
    idx_ptr,
    count_ptr,
    cand_ptr,
    m,
    n,
    cd,
    offset,
    stride_q,
    stride_r,
    K: tl.constexpr,
    KP: tl.constexpr,
    CAP: tl.constexpr,
    CERTIFY: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    slots = tl.arange(0, KP)
    state = rows[:, None] * KP + slots[None, :]
    vals = tl.load(val_ptr + state, mask=row_ok[:, None], other=float("-inf"))
    idxs = tl.load(idx_ptr + state, mask=row_ok[:, None], other=-1)
    vals = tl.where(slots[None, :] < K, vals, float("inf"))  # padding slots are never the worst
    if CERTIFY:
        bx = tl.load(qt_ptr + rows * 3, mask=row_ok, other=0.0)
        bz = tl.load(qt_ptr + rows * 3 + 1, mask=row_ok, other=0.0)
    cs = tl.arange(0, BLOCK_C)
    if ONE_CHUNK:  # the queries' whole rows fit one chunk: load them once, not once per tile
        q_once = tl.load(
            q_ptr + rows[:, None] * stride_q + cs[None, :], mask=row_ok[:, None] & (cs < cd)[None, :], other=0.0
        )
    for n0 in range(0, n, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, cd, BLOCK_C):
            c_ok = (c0 + cs) < cd
            if ONE_CHUNK:
                qt = q_once
            else:
                qt = tl.load(
                    q_ptr + rows[:, None] * stride_q + (c0 + cs)[None, :],
                    mask=row_ok[:, None] & c_ok[None, :],
                    other=0.0,
                )
            rt = tl.load(
                r_ptr + cols[None, :] * stride_r + (c0 + cs)[:, None],
                mask=col_ok[None, :] & c_ok[:, None],
                other=0.0,
            )
            if UPCAST:
                # the interpreter's dot mishandles half operands; half products are exact in
                # float32, so upcasting computes the same sums
                qt = qt.to(tl.float32)
                rt = rt.to(tl.float32)
            if IEEE:
                acc = tl.dot(qt, rt, acc, input_precision="ieee")
            else:
                acc = tl.dot(qt, rt, acc)
        if BIAS:  # l2's extra column (queries hold 1 there): added, not multiplied in a chunk of its own
            acc += tl.load(r_ptr + cols * stride_r + cd, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        inside = col_ok[None, :] & row_ok[:, None]
        gcols = offset + cols
        if CERTIFY:
            by = tl.load(rt_ptr + cols * 3, mask=col_ok, other=0.0)
            bw = tl.load(rt_ptr + cols * 3 + 1, mask=col_ok, other=0.0)
            bf = tl.load(rt_ptr + cols * 3 + 2, mask=col_ok, other=0.0)
            e = bx[:, None] * by[None, :] + bz[:, None] * bw[None, :] + bf[None, :]
            s = tl.where(inside, acc - e, float("-inf"))  # lower bounds rank
        else:
            s = tl.where(inside, acc, float("-inf"))
        if tl.max((tl.max(s, 1) > tl.min(vals, 1)).to(tl.int32), 0) > 0:  # some row improves
            work = s
            for _ in tl.static_range(K):
                tmax = tl.max(work, 1)
                targ = tl.min(tl.where(work == tmax[:, None], gcols[None, :], 2147483647), 1)
                worst = tl.min(vals, 1)
                # the slot to give up: the worst value, the highest index among equal worst
                is_worst = vals == worst[:, None]
                widx = tl.max(tl.where(is_worst, idxs, -2), 1)
                wslot = tl.max(tl.where(is_worst & (idxs == widx[:, None]), slots[None, :], -1), 1)
                put = (tmax > worst)[:, None] & (slots[None, :] == wslot[:, None])
                vals = tl.where(put, tmax[:, None], vals)
                idxs = tl.where(put, targ[:, None], idxs)
                work = tl.where(gcols[None, :] == targ[:, None], float("-inf"), work)
        if CERTIFY:
            hit = (acc + e >= tl.min(vals, 1)[:, None]) & inside
            if tl.max(tl.max(hit.to(tl.int32), 1), 0) > 0:  # after the first tiles, rarely
                slot = tl.atomic_add(count_ptr + rows[:, None] + 0 * cols[None, :], 1, mask=hit)
                tl.store(
                    cand_ptr + rows[:, None] * CAP + slot, gcols[None, :] + 0 * rows[:, None], mask=hit & (slot < CAP)
                )
    tl.store(val_ptr + state, vals, mask=row_ok[:, None])
    tl.store(idx_ptr + state, idxs, mask=row_ok[:, None])


def topk_launch(
    q: torch.Tensor,
    r: torch.Tensor,
    val: torch.Tensor,
    idx: torch.Tensor,
    *,
    k: int,
    offset: int,
    bias: bool = False,
    query_terms: torch.Tensor | None = None,
    ref_terms: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    cand: torch.Tensor | None = None,
) -> None:
    """Merge the references ``r`` into the running top-k of the queries ``q``, in place.

    Parameters
    ----------
    q : Tensor of shape (m, C), contiguous rows
        Prepared queries, float16, bfloat16 or float32 (float32 is multiplied in IEEE float32).
        With ``bias``, their last column holds ones and is not read.
    r : Tensor of shape (n, C), contiguous rows, the dtype of ``q``
        Prepared references; their indices are ``offset + arange(n)``.
    val : Tensor of shape (m, KP), float32
        Running scores, KP = max(2, next power of two >= k); -inf where empty. Updated.
    idx : Tensor of shape (m, KP), int32
        Running indices; -1 where empty. Updated. Slots are in no particular order.
    k : int
        1 <= k <= 8.
    bias : bool, default=False
        The last column is a per-reference term added to the product (l2's ``-|b|^2 / 2``):
        the dot runs over the other columns only, so C=64 stays one chunk.
    query_terms, ref_terms : Tensors of shape (m, 3) and (n, 3), float32, contiguous, optional
        The certificate's per-row terms (:func:`densematch.precision.query_terms`): list every
        reference the bound cannot rule out; then ``count`` (m,) int32 is bumped for each and
        ``cand`` (m, CAP) int32 holds the first CAP columns. ``val`` then holds lower bounds.
    """
    m, cp = q.shape
    n = r.shape[0]
    kp = val.shape[1]
    certify = query_terms is not None
    if not certify:
        query_terms = ref_terms = count = cand = torch.zeros(1, dtype=torch.int32, device=q.device)
    assert ref_terms is not None and count is not None and cand is not None
    interp = interpreting()
    block_m, block_n, block_c, warps = (16, 16, 16, 1) if interp else BLOCKS
    cd = cp - 1 if bias else cp
    block_c = min(block_c, max(16, triton.next_power_of_2(cd)))
    _topk_kernel[(triton.cdiv(m, block_m),)](
        q,
        r,
        query_terms,
        ref_terms,
        val,
        idx,
        count,
        cand,
        m,
        n,
        cd,
        offset,
        q.stride(0),
        r.stride(0),
        K=k,
        KP=kp,
        CAP=cand.shape[1] if certify else 1,
        CERTIFY=certify,
        UPCAST=interp and q.dtype != torch.float32,
        IEEE=q.dtype == torch.float32,
        ONE_CHUNK=cd <= block_c,
        BIAS=bias,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_C=block_c,
        num_warps=warps,
    )
