"""Per-batch reduction of hidden states on the model's device.

One forward pass gives ``hidden_states``: L+1 tensors of shape (B, T, d). For every kept
layer and every distinct key in the batch this computes, with segment sums
(``index_add_``) rather than a Python loop over occurrences::

    n_t,  mean_t,  m2_t = sum ||x - mean_t||^2 (two-pass),  sum x / ||x||

and for every kept layer the moments of all counted embeddings: mean, unit-vector sums,
and the co-moment matrix, one batched GEMM.

Precision: the arithmetic runs in ``precision`` (float32 by default, float64 on request)
on *centred* data: a per-layer centre ``c`` (the batch mean, summed in float64, or the
window's fixed shift) is subtracted first, so the float32 sums and squares see
deviations of the size of the variance, not of the mean (M >> V in massive-activation
dimensions and at position 0). Means are rebuilt in float64 as ``c + offset``. Every
result leaves as float64; batches are merged across the window in float64
(:mod:`embgeom.compute.window`). ``tests/test_reduce.py`` bounds the float32 error
against a float64 two-pass reference.

The co-moment: with a :class:`ComomentSink` (the window's), the GEMM of each batch is
added straight into the window's float64 sum ``A = sum (x - s)(x - s)^T`` about the
window's fixed shift ``s`` (its first batch's mean), so no d x d matrix per batch is
allocated or merged: on a wide model that merge costs more memory traffic than the GEMM.
Without a sink the batch's own co-moment about its mean is returned.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from embgeom.stats import LayerMoments, TokenMoments

__all__ = ["PRECISIONS", "ComomentSink", "TokenSink", "Workspace", "reduce_batch"]

PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}
F64 = torch.float64
# Layers are reduced in groups so that the (N, layers, d) work tensors stay near this
# many elements (bounded memory on long batches of wide models).
_GROUP_ELEMENTS = 1 << 26
# float32 squares of values outside this range under- or overflow: such dimensions are
# scaled by a power of two (exact) before the GEMM.
_SAFE = (1e-15, 1e15)


class Workspace:
    """Buffers a reduction reuses from batch to batch, one per name, grown when a batch
    needs more (never shrunk: its owner, the window, lets them go with itself).

    Why: the work tensors of a batch are tens of MB, above glibc's mmap threshold (32 MB
    at most), so each fresh one is mapped, page-faulted and zeroed by the kernel, then
    unmapped: writing into a fresh tensor costs several times writing into a warm one,
    every batch. The device's own
    caching allocator makes this moot on a GPU, where the buffers are reused all the same.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, name: str, shape: tuple, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` over the buffer ``name``
        (its contents are the last user's unless ``zero``)."""
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            self._buffers.pop(name, None)  # the old one goes before the new one is made
            buf = self._buffers[name] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        out = buf[:numel].view(shape)
        return out.zero_() if zero else out


def _fresh(name: str, shape: tuple, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
    """:meth:`Workspace.take` without a workspace: a new tensor."""
    return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)


class ComomentSink(Protocol):
    """Where a batch's co-moment goes: ``shift`` (L, d) float64 (None before the first
    batch: the reduction sets it to that batch's mean) and ``A`` (L, d, d) float64,
    ``sum (x - shift)(x - shift)^T``; ``cross`` (L d, L d) float64 or None, the same
    over the concatenated layers."""

    shift: Optional[torch.Tensor]
    A: torch.Tensor
    cross: Optional[torch.Tensor]


class TokenSink(Protocol):
    """Where a batch's per-type sums go (the window: :class:`~embgeom.compute.window.WindowAccumulator`).

    ``rows(ids)`` gives each sorted unique key's row and the mask of rows new to it;
    ``shift`` (rows, L, d) holds each row's shift ``r_t`` in its dtype, which the reduction
    sets for new rows (their first occurrence) and subtracts; ``add_sums`` folds in the
    float64 ``(n, S1, S2, unit sums)`` about those shifts (arrays of its ``workspace``,
    which it reads before the next batch)."""

    shift: torch.Tensor
    workspace: Workspace

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def add_sums(self, rows: torch.Tensor, n: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor,
                 unit_sum: Optional[torch.Tensor]) -> None: ...


def _gemm_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out += x^T x`` per layer, x (N, G, d) in the work dtype, out (G, d, d) float64.

    A dimension whose deviations are ~1e-32 (a LayerNorm weight of ~0) would have its
    squares underflow float32 to 0: a layer holding such a dimension is computed on data
    scaled per dimension by a power of two (exact), then unscaled in float64; the others
    go through one batched GEMM."""
    xt = x.transpose(0, 1)                                       # (G, N, d)
    if x.dtype == F64:
        out += torch.bmm(xt.transpose(1, 2), xt)
        return
    # The range check on a sample of rows (the scale only needs the right magnitude; a
    # power of two keeps it exact whatever the other rows hold).
    step = max(1, x.shape[0] // 256)
    amax = x[::step].abs().amax(dim=0)                           # (G, d)
    tiny = torch.where(amax > 0, amax, torch.full_like(amax, 1.0))
    odd = ((tiny < _SAFE[0]) | (amax > _SAFE[1])).any(dim=1)     # (G,) layers to scale
    if not bool(odd.any()):
        out += torch.bmm(xt.transpose(1, 2), xt)
        return
    for g in range(x.shape[1]):
        xg = xt[g]
        if not bool(odd[g]):
            out[g] += xg.T @ xg
            continue
        a = amax[g]
        for _ in range(2):
            scale = torch.where(a > 0, torch.exp2(-torch.floor(torch.log2(a))), torch.ones_like(a))
            xs = xg * scale
            c = xs.T @ xs
            if torch.isfinite(c).all():
                break
            a = xg.abs().amax(dim=0)  # the sample missed a larger value: scale on all rows
        s64 = scale.to(F64)
        out[g] += c.to(F64) / (s64[:, None] * s64[None, :])


@torch.inference_mode()
def reduce_batch(hidden_states: Sequence[torch.Tensor], layers: Sequence[int], keys: torch.Tensor,
                 counted: torch.Tensor, self_similarity: bool = True, precision: str = "fp32",
                 comoment: Optional[ComomentSink] = None,
                 tokens: Optional[TokenSink] = None) -> tuple[Optional[TokenMoments], LayerMoments]:
    """Reduce one batch to per-token and per-layer moments, on the hidden states' device.

    Parameters
    ----------
    hidden_states : sequence of L+1 tensors of shape (B, T, d), any float dtype.
    layers : the indices of ``hidden_states`` to keep, in order.
    keys : LongTensor of shape (B, T), the key of each position.
    counted : BoolTensor of shape (B, T), the positions that count (no padding).
    self_similarity : also sum unit vectors per token.
    precision : "fp32" or "fp64", the arithmetic of the sums (results are float64).
    comoment : a :class:`ComomentSink`: the co-moment is added into it (and the returned
        ``LayerMoments.comoment`` is None); without one, it is returned. A sink whose
        ``cross`` is a tensor also gets the co-moment of the concatenated layers (one GEMM
        of width L d after the layer groups, on the same centred data).
    tokens : a :class:`TokenSink` (the window): each type's sums about the sink's shift
        ``r_t`` are added into it, one ``index_add_`` per array, and None is returned in
        place of the token moments. Its shift dtype must be the work dtype.

    Returns
    -------
    TokenMoments over the distinct keys (sorted; float64 torch tensors on the device,
    token-major (k, L, d)), or None with ``tokens``; and LayerMoments of the batch
    (float64 tensors on the device).

    Notes
    -----
    Per type, the sums run on ``y = x - r_t``: ``r_t`` the type's first occurrence in the
    window (with ``tokens``) or in the batch, so they see deviations of the size of the
    type's variance, not of its mean. A zero hidden state has no direction; its unit vector
    is taken as 0 (it never occurs in practice for trained models, and is documented rather
    than hidden).
    """
    work = PRECISIONS[precision]
    device = hidden_states[0].device
    counted = counted.to(device)
    flat_keys = keys.to(device)[counted]
    ids, inverse, n = torch.unique(flat_keys, sorted=True, return_inverse=True, return_counts=True)
    k, N, L, d = ids.numel(), flat_keys.numel(), len(layers), hidden_states[0].shape[-1]
    n64 = n.to(F64)

    lay_mean = torch.zeros((L, d), dtype=F64, device=device)
    lay_com = None if comoment is not None else torch.zeros((L, d, d), dtype=F64, device=device)
    lay_unit = torch.zeros((L, d), dtype=F64, device=device)
    lay_unit_sq = torch.zeros((L, d), dtype=F64, device=device)
    layer_moments = LayerMoments(N, lay_mean, lay_com, lay_unit, lay_unit_sq)
    if tokens is not None:
        if tokens.shift.dtype != work:
            raise ValueError(f"the window's shifts are {tokens.shift.dtype}, the work dtype {work}")
        if N == 0:
            return None, layer_moments
        take = tokens.workspace.take
        rows, fresh = tokens.rows(ids)
        shift = torch.index_select(tokens.shift, 0, rows,                 # r_t, (k, L, d)
                                   out=take("shift", (k, L, d), work, device))
        tok_s1 = take("s1", (k, L, d), F64, device)                      # S1 about r_t
    else:
        take = _fresh
        tok_s1 = torch.zeros((k, L, d), dtype=F64, device=device)       # the means
    # Every layer group fills its columns; zeros only for the empty batch's answer.
    empty = N == 0
    tok_m2 = take("s2", (k, L), F64, device, zero=empty)                 # S2, or m2
    tok_unit = take("unit64", (k, L, d), F64, device, zero=empty) if self_similarity else None
    if N == 0:
        return TokenMoments(ids, n64, tok_s1, tok_m2, tok_unit), layer_moments

    first_batch = comoment is not None and comoment.shift is None
    if first_batch:  # the window's first batch: its mean becomes the window's fixed shift
        comoment.shift = torch.zeros((L, d), dtype=F64, device=device)
    group = max(1, _GROUP_ELEMENTS // max(1, N * d))
    ones = torch.ones((1, N), dtype=work, device=device)
    positions = counted.reshape(-1).nonzero().squeeze(1)                 # the N counted rows
    # the first occurrence of each token: its representative r_t when it has none yet
    first = torch.full((k,), N, dtype=torch.long, device=device).scatter_reduce_(
        0, inverse, torch.arange(N, device=device), reduce="amin")  # each token's first row
    new = None if tokens is None else fresh.nonzero().squeeze(1)
    cross = getattr(comoment, "cross", None)
    centred = [] if cross is not None else None  # each group's x - s, for the cross GEMM
    for g0 in range(0, L, group):
        sel = slice(g0, min(L, g0 + group))
        G = sel.stop - sel.start
        x = take("x", (N, G, d), work, device)
        for j, layer in enumerate(layers[sel]):
            x[:, j].copy_(hidden_states[layer].reshape(-1, d).index_select(0, positions))
        flat = x.view(N, G * d)
        # Unit vectors of the raw states first (then x is centred in place). Column sums
        # over the N rows go through a BLAS product with a row of ones: blocked sums, far
        # faster than a strided reduction along dim 0.
        inv = torch.linalg.vector_norm(x, dim=2, keepdim=True).reciprocal_()
        inv.masked_fill_(~torch.isfinite(inv), 0.0)              # a zero vector has no direction
        unit = torch.mul(x, inv, out=take("a", (N, G, d), work, device))
        lay_unit[sel] = (ones @ unit.view(N, G * d)).view(G, d).to(F64)
        squares = torch.mul(unit, unit, out=take("b", (N, G, d), work, device))
        lay_unit_sq[sel] = (ones @ squares.view(N, G * d)).view(G, d).to(F64)
        if tok_unit is not None:
            tok_unit[:, sel] = take("unit", (k, G, d), work, device, zero=True).index_add_(0, inverse, unit)
        del unit, inv, squares
        if comoment is None or first_batch:
            # The centre actually subtracted is the work-dtype value of the mean: keep
            # exactly that value (in float64), so that c + offset is the mean.
            centre = ((ones @ flat).view(G, d) / N).to(F64)
            if first_batch:
                comoment.shift[sel] = centre
        else:
            centre = comoment.shift[sel]
        # centred on c: the GEMM's input (kept apart for the cross GEMM after the groups)
        xc = torch.sub(x, centre.to(work), out=_fresh("xc", (N, G, d), work, device)
                       if centred is not None else take("b", (N, G, d), work, device))
        # Per type, sums about its representative r_t (the shifted-data algorithm, with
        # the shift inside the type's data): y = x - r_t subtracts nearly equal numbers,
        # so a type tight around its mean keeps its variance to full precision however far
        # it lies from c; identical occurrences (a lone one, a decoder's input embeddings)
        # give y = 0 exactly.
        if tokens is None:
            rep = x.index_select(0, first)                       # r_t, (k, G, d)
        else:
            rep = shift[:, sel]
            if new.numel():  # types new to the window: their first occurrence here
                rep[new] = x.index_select(0, first[new])
        x.sub_(torch.index_select(rep, 0, inverse, out=take("a", (N, G, d), work, device)))
        sums = take("sums", (k, G, d), work, device, zero=True).index_add_(0, inverse, x)  # sum of y
        sq = take("sq", (k, G), work, device, zero=True) \
            .index_add_(0, inverse, torch.linalg.vector_norm(x, dim=2).square_())
        # mean - c over all N, from the per-type sums in float64 (k rows, no pass over N):
        # sum_t n_t (r_t - c) + sum_t S1_t
        rep64 = take("rep64", (k, G, d), F64, device)
        rep64.copy_(rep)
        s1 = tok_s1[:, sel]
        s1.copy_(sums)                                           # sum (x - r_t), float64
        xbar = ((n64 @ rep64.view(k, G * d)).view(G, d) - N * centre + s1.sum(dim=0)) / N
        lay_mean[sel] = centre + xbar
        if tokens is None:
            offset = s1 / n64[:, None, None]                     # mean_t - r_t, float64
            tok_m2[:, sel] = (sq.to(F64) - n64[:, None] * (offset * offset).sum(dim=2)).clamp_(min=0.0)
            tok_s1[:, sel] = rep64 + offset                      # the mean
        else:
            tok_m2[:, sel] = sq
        if comoment is not None:
            _gemm_into(xc, comoment.A[sel])                      # sum (x - s)(x - s)^T
            if centred is not None:
                centred.append(xc.reshape(N, G * d))
        else:
            # About c, then moved to the batch mean: C = sum (x-c)(x-c)^T - N xbar xbar^T.
            block = torch.zeros((G, d, d), dtype=F64, device=device)
            _gemm_into(xc, block)
            lay_com[sel] = block - N * xbar[:, :, None] * xbar[:, None, :]
        del x, xc, flat, sums, rep, rep64, s1
    if centred:
        # every layer pair's cross-moment about the window's shift, one (L d)-wide GEMM
        _gemm_into(torch.cat(centred, dim=1)[:, None, :], cross[None])
        del centred
    if tokens is not None:
        if new.numel():
            tokens.shift.index_copy_(0, rows[new], shift[new])
        tokens.add_sums(rows, n64, tok_s1, tok_m2, tok_unit)
        return None, layer_moments
    return TokenMoments(ids=ids, n=n64, mean=tok_s1, m2=tok_m2, unit_sum=tok_unit), layer_moments
