"""The worker's window: every job since the last checkpoint, merged on the device.

A worker folds each batch's moments (:func:`embgeom.compute.reduce.reduce_batch`) into
one float64 accumulator on the model's device, over as many jobs as its checkpoint budget
allows, and hands the result to the store in one checkpoint. Memory grows with the
distinct keys the window has seen (Heaps' law), never with the vocabulary: rows are
appended on first sight, and a sorted index maps keys to rows (``searchsorted``, no
per-key Python loop).

The merges are :func:`embgeom.stats.chan_merge` (per token, gathered rows) and
:meth:`embgeom.stats.LayerMoments.merged` (per layer), on float64 tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from embgeom.stats import LayerMoments, TokenMoments, chan_merge

__all__ = ["WindowAccumulator"]

F64 = torch.float64


class WindowAccumulator:
    """Per-token and per-layer float64 moments of a window, on ``device``.

    Parameters
    ----------
    num_layers : the number of kept layers L.
    dim : the hidden size d.
    self_similarity : keep per-token unit-vector sums.
    """

    def __init__(self, num_layers: int, dim: int, self_similarity: bool, device="cpu",
                 capacity: int = 1024):
        self.num_layers, self.dim, self.device = num_layers, dim, torch.device(device)
        self.self_similarity = self_similarity
        self.size = 0
        self.tokens = 0  # embeddings per layer
        self._alloc(capacity)
        self._sorted_keys = torch.zeros(0, dtype=torch.long, device=self.device)
        self._sorted_rows = torch.zeros(0, dtype=torch.long, device=self.device)
        z = lambda *shape: torch.zeros(shape, dtype=F64, device=self.device)  # noqa: E731
        self.layers = LayerMoments(0, z(num_layers, dim), z(num_layers, dim, dim),
                                   z(num_layers, dim), z(num_layers, dim))

    def _alloc(self, capacity: int) -> None:
        L, d, dev = self.num_layers, self.dim, self.device
        old = getattr(self, "_keys", None)
        keys = torch.zeros(capacity, dtype=torch.long, device=dev)
        n = torch.zeros(capacity, dtype=F64, device=dev)
        mean = torch.zeros((capacity, L, d), dtype=F64, device=dev)
        m2 = torch.zeros((capacity, L), dtype=F64, device=dev)
        unit = torch.zeros((capacity, L, d), dtype=F64, device=dev) if self.self_similarity else None
        if old is not None:
            s = self.size
            keys[:s], n[:s], mean[:s], m2[:s] = self._keys[:s], self._n[:s], self._mean[:s], self._m2[:s]
            if unit is not None:
                unit[:s] = self._unit[:s]
        self._keys, self._n, self._mean, self._m2, self._unit = keys, n, mean, m2, unit

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes of per-token state in use (what a checkpoint will carry)."""
        per_row = 8 * (2 + self.num_layers * (1 + self.dim * (2 if self.self_similarity else 1)))
        return self.size * per_row

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (sorted, unique), appending the ones never seen."""
        pos = torch.searchsorted(self._sorted_keys, ids)
        found = torch.zeros_like(ids, dtype=torch.bool)
        if self.size:
            clipped = pos.clamp(max=self.size - 1)
            found = self._sorted_keys[clipped] == ids
        rows = torch.empty_like(ids)
        rows[found] = self._sorted_rows[pos[found]]
        fresh = ~found
        num_new = int(fresh.sum())
        if num_new:
            if self.size + num_new > self._keys.shape[0]:
                self._alloc(max(2 * self._keys.shape[0], self.size + num_new))
            new_rows = torch.arange(self.size, self.size + num_new, device=self.device)
            rows[fresh] = new_rows
            self._keys[new_rows] = ids[fresh]
            self.size += num_new
            keys = self._keys[:self.size]
            self._sorted_keys, order = torch.sort(keys)
            self._sorted_rows = order
        return rows

    @torch.inference_mode()
    def add(self, tokens: TokenMoments, layers: LayerMoments) -> None:
        """Merge one batch (its tensors on this device, ids sorted and unique)."""
        if len(tokens) == 0:
            return
        rows = self._rows(tokens.ids.to(self.device))
        # Gathered rows are merged in place, then scattered back. Counts are per token, the
        # same at every layer: (k, 1) broadcasts over layers.
        mean, m2 = self._mean.index_select(0, rows), self._m2.index_select(0, rows)
        n, _, _, _ = chan_merge(self._n.index_select(0, rows)[:, None], mean, m2,
                                tokens.n[:, None], tokens.mean, tokens.m2, inplace=True)
        self._n.index_copy_(0, rows, n[:, 0])
        self._mean.index_copy_(0, rows, mean)
        self._m2.index_copy_(0, rows, m2)
        if self._unit is not None:
            self._unit.index_add_(0, rows, tokens.unit_sum)
        self.layers = self.layers.merged(layers)
        self.tokens += int(layers.n)

    def export(self) -> tuple[TokenMoments, LayerMoments]:
        """The window as float64 numpy arrays on the host, tokens sorted by key."""
        s = self.size
        order = torch.argsort(self._keys[:s])

        def host(t):
            return None if t is None else t[:s][order].cpu().numpy()

        tokens = TokenMoments(ids=host(self._keys), n=host(self._n).astype(np.int64),
                              mean=host(self._mean), m2=host(self._m2), unit_sum=host(self._unit))
        lay = self.layers
        layers = LayerMoments(int(lay.n), lay.mean.cpu().numpy(), lay.comoment.cpu().numpy(),
                              lay.unit_sum.cpu().numpy(), lay.unit_sq_sum.cpu().numpy())
        return tokens, layers
