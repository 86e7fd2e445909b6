"""Per-batch reduction of hidden states on the model's device.

One forward pass gives ``hidden_states``: L+1 tensors of shape (B, T, d). For every kept
layer and every distinct key in the batch this computes, with segment sums
(``index_add_``) rather than a Python loop over occurrences::

    n_t,  mean_t,  m2_t = sum ||x - mean_t||^2 (two-pass),  sum x / ||x||

and for every kept layer the moments of all counted embeddings: mean, the co-moment
matrix (one batched GEMM), and the unit-vector sums.

Precision: the arithmetic runs in ``precision`` (float32 by default, float64 on request)
on *batch-centred* data: the layer's batch mean ``c`` (summed in float64) is subtracted
first, so the float32 sums and squares see deviations of the size of the variance, not
of the mean (M >> V in massive-activation dimensions and at position 0). Means are
rebuilt in float64 as ``c + offset``. Every result leaves as float64; batches are then
merged across the window with float64 Chan merges (:mod:`embgeom.compute.window`).
``tests/test_reduce.py`` bounds the float32 error against a float64 two-pass reference.
"""

from __future__ import annotations

from typing import Sequence

import torch

from embgeom.stats import LayerMoments, TokenMoments

__all__ = ["PRECISIONS", "reduce_batch"]

PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}
F64 = torch.float64
# Layers are reduced in groups so that the (N, layers, d) work tensors stay near this
# many elements (bounded memory on long batches of wide models).
_GROUP_ELEMENTS = 1 << 26


@torch.inference_mode()
def reduce_batch(hidden_states: Sequence[torch.Tensor], layers: Sequence[int], keys: torch.Tensor,
                 counted: torch.Tensor, self_similarity: bool = True, precision: str = "fp32",
                 ) -> tuple[TokenMoments, LayerMoments]:
    """Reduce one batch to per-token and per-layer moments, on the hidden states' device.

    Parameters
    ----------
    hidden_states : sequence of L+1 tensors of shape (B, T, d), any float dtype.
    layers : the indices of ``hidden_states`` to keep, in order.
    keys : LongTensor of shape (B, T), the key of each position.
    counted : BoolTensor of shape (B, T), the positions that count (no padding).
    self_similarity : also sum unit vectors per token.
    precision : "fp32" or "fp64", the arithmetic of the sums (results are float64).

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
    n64 = n.to(F64)

    tok_mean = torch.zeros((k, L, d), dtype=F64, device=device)
    tok_m2 = torch.zeros((k, L), dtype=F64, device=device)
    tok_unit = torch.zeros((k, L, d), dtype=F64, device=device) if self_similarity else None
    lay_mean = torch.zeros((L, d), dtype=F64, device=device)
    lay_com = torch.zeros((L, d, d), dtype=F64, device=device)
    lay_unit = torch.zeros((L, d), dtype=F64, device=device)
    lay_unit_sq = torch.zeros((L, d), dtype=F64, device=device)
    if N == 0:
        return (TokenMoments(ids.cpu(), n.cpu(), tok_mean, tok_m2, tok_unit),
                LayerMoments(0, lay_mean, lay_com, lay_unit, lay_unit_sq))

    group = max(1, _GROUP_ELEMENTS // max(1, N * d))
    for g0 in range(0, L, group):
        sel = slice(g0, min(L, g0 + group))
        x = torch.stack([hidden_states[layer][counted] for layer in layers[sel]], dim=1).to(work)
        centre = x.sum(dim=0, dtype=F64) / N                     # (G, d) float64
        x -= centre.to(work)                                     # centred in place
        # The unit vector needs the uncentred x: x + c, rebuilt only where asked.
        unit = x + centre.to(work)
        norms = torch.linalg.vector_norm(unit, dim=2, keepdim=True)
        unit = torch.where(norms > 0, unit / norms.clamp_min(torch.finfo(work).tiny), 0.0)
        lay_unit[sel] = unit.sum(dim=0, dtype=F64)
        lay_unit_sq[sel] = (unit * unit).sum(dim=0, dtype=F64)
        if tok_unit is not None:
            tok_unit[:, sel] = torch.zeros((k,) + unit.shape[1:], dtype=work, device=device) \
                .index_add_(0, inverse, unit).to(F64)
        del unit, norms
        sums = torch.zeros((k,) + x.shape[1:], dtype=work, device=device).index_add_(0, inverse, x)
        offset = sums / n.to(work)[:, None, None]                # token mean - c, (k, G, d)
        dev = x - offset[inverse]
        tok_m2[:, sel] = torch.zeros((k, x.shape[1]), dtype=work, device=device) \
            .index_add_(0, inverse, (dev * dev).sum(dim=2)).to(F64)
        del dev
        tok_mean[:, sel] = centre + offset.to(F64)
        # Co-moment about c, one batched GEMM, then moved to the batch mean c + xbar:
        # C = sum (x-c)(x-c)^T - N xbar xbar^T, xbar = mean(x - c), tiny by construction.
        # Each dimension is first scaled by a power of two (exact) to bring its largest
        # deviation near 1: a dimension whose values are ~1e-32 (a LayerNorm weight of
        # ~0) would otherwise see its squares underflow float32 to 0.
        xbar = x.sum(dim=0, dtype=F64) / N
        amax = x.abs().amax(dim=0)                               # (G, d)
        scale = torch.where(amax > 0, torch.exp2(-torch.floor(torch.log2(amax))),
                            torch.ones_like(amax))
        xt = (x * scale).transpose(0, 1)                         # (G, N, d), exact
        scale64 = scale.to(F64)
        lay_com[sel] = torch.bmm(xt.transpose(1, 2), xt).to(F64) \
            / (scale64[:, :, None] * scale64[:, None, :]) - N * xbar[:, :, None] * xbar[:, None, :]
        lay_mean[sel] = centre + xbar
        del x, xt, sums, offset, scale
    tokens = TokenMoments(ids=ids, n=n64, mean=tok_mean, m2=tok_m2, unit_sum=tok_unit)
    return tokens, LayerMoments(N, lay_mean, lay_com, lay_unit, lay_unit_sq)
