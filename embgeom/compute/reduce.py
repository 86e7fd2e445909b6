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

__all__ = ["PRECISIONS", "ComomentSink", "reduce_batch"]

PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}
F64 = torch.float64
# Layers are reduced in groups so that the (N, layers, d) work tensors stay near this
# many elements (bounded memory on long batches of wide models).
_GROUP_ELEMENTS = 1 << 26
# float32 squares of values outside this range under- or overflow: such dimensions are
# scaled by a power of two (exact) before the GEMM.
_SAFE = (1e-15, 1e15)


class ComomentSink(Protocol):
    """Where a batch's co-moment goes: ``shift`` (L, d) float64 (None before the first
    batch: the reduction sets it to that batch's mean) and ``A`` (L, d, d) float64,
    ``sum (x - shift)(x - shift)^T``; ``cross`` (L d, L d) float64 or None, the same
    over the concatenated layers."""

    shift: Optional[torch.Tensor]
    A: torch.Tensor
    cross: Optional[torch.Tensor]


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
                 comoment: Optional[ComomentSink] = None) -> tuple[TokenMoments, LayerMoments]:
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

    Returns
    -------
    TokenMoments over the distinct keys (sorted; float64 torch tensors on the device,
    token-major (k, L, d)), and LayerMoments of the batch (float64 tensors on the device).

    Notes
    -----
    A zero hidden state has no direction; its unit vector is taken as 0 (it never occurs
    in practice for trained models, and is documented rather than hidden).
    """
    work = PRECISIONS[precision]
    device = hidden_states[0].device
    counted = counted.to(device)
    flat_keys = keys.to(device)[counted]
    ids, inverse, n = torch.unique(flat_keys, sorted=True, return_inverse=True, return_counts=True)
    k, N, L, d = ids.numel(), flat_keys.numel(), len(layers), hidden_states[0].shape[-1]

    tok_mean = torch.zeros((k, L, d), dtype=F64, device=device)
    tok_m2 = torch.zeros((k, L), dtype=F64, device=device)
    tok_unit = torch.zeros((k, L, d), dtype=F64, device=device) if self_similarity else None
    lay_mean = torch.zeros((L, d), dtype=F64, device=device)
    lay_com = None if comoment is not None else torch.zeros((L, d, d), dtype=F64, device=device)
    lay_unit = torch.zeros((L, d), dtype=F64, device=device)
    lay_unit_sq = torch.zeros((L, d), dtype=F64, device=device)
    if N == 0:
        return (TokenMoments(ids, n.to(F64), tok_mean, tok_m2, tok_unit),
                LayerMoments(0, lay_mean, lay_com, lay_unit, lay_unit_sq))

    first_batch = comoment is not None and comoment.shift is None
    if first_batch:  # the window's first batch: its mean becomes the window's fixed shift
        comoment.shift = torch.zeros((L, d), dtype=F64, device=device)
    group = max(1, _GROUP_ELEMENTS // max(1, N * d))
    ones = torch.ones((1, N), dtype=work, device=device)
    n64 = n.to(F64)
    # the first occurrence of each token: its representative r_t
    first = torch.full((k,), N, dtype=torch.long, device=device).scatter_reduce_(
        0, inverse, torch.arange(N, device=device), reduce="amin")  # each token's first row
    cross = getattr(comoment, "cross", None)
    centred = [] if cross is not None else None  # each group's x - s, for the cross GEMM
    for g0 in range(0, L, group):
        sel = slice(g0, min(L, g0 + group))
        x = torch.stack([hidden_states[layer][counted] for layer in layers[sel]], dim=1).to(work)
        G = x.shape[1]
        flat = x.view(N, G * d)
        # Unit vectors of the raw states first (then x is centred in place). Column sums
        # over the N rows go through a BLAS product with a row of ones: blocked sums, far
        # faster than a strided reduction along dim 0.
        inv = torch.linalg.vector_norm(x, dim=2, keepdim=True).reciprocal_()
        inv.masked_fill_(~torch.isfinite(inv), 0.0)              # a zero vector has no direction
        unit = x * inv
        lay_unit[sel] = (ones @ unit.view(N, G * d)).view(G, d).to(F64)
        lay_unit_sq[sel] = (ones @ (unit * unit).view(N, G * d)).view(G, d).to(F64)
        if tok_unit is not None:
            tok_unit[:, sel] = torch.zeros((k, G, d), dtype=work, device=device) \
                .index_add_(0, inverse, unit).to(F64)
        del unit, inv
        if comoment is None or first_batch:
            # The centre actually subtracted is the work-dtype value of the mean: keep
            # exactly that value (in float64), so that c + offset is the mean.
            centre = ((ones @ flat).view(G, d) / N).to(F64)
            if first_batch:
                comoment.shift[sel] = centre
        else:
            centre = comoment.shift[sel]
        xc = x - centre.to(work)                                 # centred on c: the GEMM's input
        # Per token, sums about its own first occurrence r_t (the shifted-data algorithm,
        # with the shift inside the token's data): y = x - r_t subtracts nearly equal
        # numbers (exact), so a token tight around its mean keeps its variance to full
        # precision however far it lies from c; identical occurrences (a lone one, a
        # decoder's input embeddings) give m2 = 0 and mean = r_t exactly; and
        # m2 = sum ||y||^2 - n ||mean - r_t||^2 loses a factor 1 + ||mean - r_t||^2 / V_t,
        # a few units when r_t is a few standard deviations out.
        rep = x.index_select(0, first)                           # r_t, (k, G, d)
        x -= rep.index_select(0, inverse)                        # x is now y = x - r_t
        sums = torch.zeros((k, G, d), dtype=work, device=device).index_add_(0, inverse, x)
        sq = torch.zeros((k, G), dtype=work, device=device) \
            .index_add_(0, inverse, torch.linalg.vector_norm(x, dim=2).square_()).to(F64)
        offset = sums.to(F64) / n64[:, None, None]               # mean_t - r_t, float64
        tok_m2[:, sel] = (sq - n64[:, None] * (offset * offset).sum(dim=2)).clamp_(min=0.0)
        tok_mean[:, sel] = rep.to(F64) + offset
        # mean - c over all N, from the k token means (float64, no pass over N)
        xbar = (n64[:, None, None] * (tok_mean[:, sel] - centre)).sum(dim=0) / N
        lay_mean[sel] = centre + xbar
        if comoment is not None:
            _gemm_into(xc, comoment.A[sel])                      # sum (x - s)(x - s)^T
            if centred is not None:
                centred.append(xc.reshape(N, G * d))
        else:
            # About c, then moved to the batch mean: C = sum (x-c)(x-c)^T - N xbar xbar^T.
            block = torch.zeros((G, d, d), dtype=F64, device=device)
            _gemm_into(xc, block)
            lay_com[sel] = block - N * xbar[:, :, None] * xbar[:, None, :]
        del x, xc, flat, sums, offset, rep
    if centred:
        # every layer pair's cross-moment about the window's shift, one (L d)-wide GEMM
        _gemm_into(torch.cat(centred, dim=1)[:, None, :], cross[None])
        del centred
    tokens = TokenMoments(ids=ids, n=n.to(F64), mean=tok_mean, m2=tok_m2, unit_sum=tok_unit)
    return tokens, LayerMoments(N, lay_mean, lay_com, lay_unit, lay_unit_sq)
