"""The independent reference: run the model one text at a time, no padding, no batching,
and compute every statistic two-pass in float64 over the raw hidden states.

It shares nothing with the service's extraction path (no windows, no budget batching, no
device reduction, no Chan merges); it only uses the tokenizer's own special-token mask.
Texts must fit the model's maximum length (checked).

:data:`TOL` is how close the service's figures must come to it: Q, M, V, V_W, V_B and a
token's Q, M, V within 1e-4 of Q (``tests/test_e2e_minilm.py`` measures ~1e-7 on MiniLM;
the soak checks the same bound after its faults).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["TOL", "RawStates", "raw_hidden_states", "token_stats", "decomposition"]

TOL = 1e-4  # decomposition and per-token values, relative to Q


@dataclass
class RawStates:
    ids: np.ndarray          # (N,) token id of each counted position
    states: list[np.ndarray]  # per layer (N, d) float32 hidden states as the model gave them


def raw_hidden_states(model, tokenizer, texts, include_special: bool = False) -> RawStates:
    ids, per_layer = [], None
    with torch.inference_mode():
        for text in texts:
            enc = tokenizer(text, return_tensors="pt", return_special_tokens_mask=True)
            assert enc["input_ids"].shape[1] <= tokenizer.model_max_length, "reference texts must fit"
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                        output_hidden_states=True)
            keep = torch.ones_like(enc["special_tokens_mask"][0], dtype=torch.bool) if include_special \
                else enc["special_tokens_mask"][0] == 0
            if per_layer is None:
                per_layer = [[] for _ in out.hidden_states]
            for layer, h in enumerate(out.hidden_states):
                per_layer[layer].append(h[0][keep].float().numpy())
            ids.append(enc["input_ids"][0][keep].numpy())
    return RawStates(np.concatenate(ids), [np.concatenate(x) for x in per_layer])


def token_stats(ids: np.ndarray, X: np.ndarray) -> dict:
    """Per token type, two-pass float64: n, Q, M, V."""
    X = X.astype(np.float64)
    types, inverse = np.unique(ids, return_inverse=True)
    n = np.bincount(inverse).astype(np.float64)
    means = np.zeros((len(types), X.shape[1]))
    np.add.at(means, inverse, X)
    means /= n[:, None]
    dev = X - means[inverse]
    V = np.bincount(inverse, weights=(dev * dev).sum(1)) / n
    M = (means * means).sum(1)
    return {"ids": types, "n": n, "M": M, "V": V, "Q": M + V, "means": means}


def decomposition(ids: np.ndarray, X: np.ndarray, min_count: int = 1, max_count=None) -> dict:
    """Q, M, V, V_W, V_B over the positions of the token types passing the filter."""
    t = token_stats(ids, X)
    keep_types = t["n"] >= min_count
    if max_count is not None:
        keep_types &= t["n"] <= max_count
    kept = set(t["ids"][keep_types].tolist())
    mask = np.fromiter((i in kept for i in ids.tolist()), dtype=bool, count=len(ids))
    Xk = X[mask].astype(np.float64)
    idk = ids[mask]
    mu = Xk.mean(0)
    Q = float((Xk * Xk).sum(1).mean())
    M = float(mu @ mu)
    V = float(((Xk - mu) ** 2).sum(1).mean())
    tk = token_stats(idk, Xk)
    _, inv = np.unique(idk, return_inverse=True)
    V_W = float(((Xk - tk["means"][inv]) ** 2).sum(1).mean())
    V_B = float(((tk["means"][inv] - mu) ** 2).sum(1).mean())
    return {"n": int(mask.sum()), "num_types": int(keep_types.sum()),
            "Q": Q, "M": M, "V": V, "V_W": V_W, "V_B": V_B, "types": tk}
