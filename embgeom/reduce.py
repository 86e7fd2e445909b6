"""Per-batch reduction of hidden states on the model's device.

One forward pass gives ``hidden_states``: L+1 tensors of shape (B, T, d). For every
layer and every distinct token key in the batch this computes, with segment sums
(``index_add_``) rather than a Python loop over occurrences::

    n_t, mean_t = sum x / n_t, m2_t = sum ||x - mean_t||^2 (two-pass), sum x / ||x||

and for every layer the moments of all counted embeddings (mean, co-moment matrix,
unit-vector sums). The arithmetic is float64 on the device, so the batch's moments are
as exact as the hidden states themselves; the results go to the host as numpy arrays to
be merged with :mod:`embgeom.stats`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from embgeom.stats import LayerMoments, TokenMoments

__all__ = ["reduce_batch"]


@torch.inference_mode()
def reduce_batch(
    hidden_states: Sequence[torch.Tensor], keys: torch.Tensor, counted: torch.Tensor
) -> tuple[TokenMoments, LayerMoments]:
    """Reduce one batch to per-token and per-layer moments.

    Parameters
    ----------
    hidden_states : sequence of L tensors of shape (B, T, d), any float dtype.
    keys : LongTensor of shape (B, T), the key of each position.
    counted : BoolTensor of shape (B, T), the positions that count (no padding).

    Returns
    -------
    TokenMoments over the distinct keys (sorted), and LayerMoments of the batch.

    Notes
    -----
    A zero hidden state has no direction; its unit vector is taken as 0 (it never
    occurs in practice for trained models, and is documented rather than hidden).
    """
    device = hidden_states[0].device
    counted = counted.to(device)
    flat_keys = keys.to(device)[counted]
    ids, inverse = torch.unique(flat_keys, sorted=True, return_inverse=True)
    k = ids.numel()
    n = torch.bincount(inverse, minlength=k)
    n64 = n.to(torch.float64)
    num_layers = len(hidden_states)
    d = hidden_states[0].shape[-1]
    N = int(flat_keys.numel())
    if N == 0:
        return (
            TokenMoments(
                ids=np.zeros(0, dtype=np.int64), n=np.zeros(0, dtype=np.int64),
                mean=np.zeros((num_layers, 0, d)), m2=np.zeros((num_layers, 0)),
                unit_sum=np.zeros((num_layers, 0, d)),
            ),
            LayerMoments.empty(num_layers, d),
        )

    tok_mean = torch.empty((num_layers, k, d), dtype=torch.float64, device=device)
    tok_m2 = torch.empty((num_layers, k), dtype=torch.float64, device=device)
    tok_unit = torch.empty((num_layers, k, d), dtype=torch.float64, device=device)
    lay_mean = torch.empty((num_layers, d), dtype=torch.float64, device=device)
    lay_com = torch.empty((num_layers, d, d), dtype=torch.float64, device=device)
    lay_unit = torch.empty((num_layers, d), dtype=torch.float64, device=device)
    lay_unit_sq = torch.empty((num_layers, d), dtype=torch.float64, device=device)
    lay_within = torch.empty((num_layers,), dtype=torch.float64, device=device)

    for layer, h in enumerate(hidden_states):
        x = h[counted].to(torch.float64)  # (N, d)
        sums = torch.zeros((k, d), dtype=torch.float64, device=device).index_add_(0, inverse, x)
        mean = sums / n64[:, None]
        dev = x - mean[inverse]
        m2 = torch.zeros(k, dtype=torch.float64, device=device).index_add_(
            0, inverse, (dev * dev).sum(dim=1)
        )
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        unit = torch.where(norms > 0, x / norms.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
        tok_mean[layer] = mean
        tok_m2[layer] = m2
        tok_unit[layer] = torch.zeros((k, d), dtype=torch.float64, device=device).index_add_(
            0, inverse, unit
        )
        layer_mean = x.mean(dim=0)
        centred = x - layer_mean
        lay_mean[layer] = layer_mean
        lay_com[layer] = centred.T @ centred
        lay_unit[layer] = unit.sum(dim=0)
        lay_unit_sq[layer] = (unit * unit).sum(dim=0)
        lay_within[layer] = m2.sum()

    def host(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy()

    tokens = TokenMoments(
        ids=host(ids).astype(np.int64),
        n=host(n).astype(np.int64),
        mean=host(tok_mean),
        m2=host(tok_m2),
        unit_sum=host(tok_unit),
    )
    layers = LayerMoments(
        n=N,
        mean=host(lay_mean),
        comoment=host(lay_com),
        unit_sum=host(lay_unit),
        unit_sq_sum=host(lay_unit_sq),
        within=host(lay_within),
    )
    return tokens, layers
