"""The worker's window: every job since the last checkpoint, merged on the device.

A worker folds each batch's moments (:func:`embgeom.compute.reduce.reduce_batch`) into
one float64 accumulator on the model's device, over as many jobs as its checkpoint budget
allows, and hands the result to the store in one checkpoint. Memory grows with the
distinct keys the window has seen (Heaps' law), never with the vocabulary: rows are
appended on first sight, and a sorted index maps keys to rows (``searchsorted``, no
per-key Python loop).

Per token type ``t`` and layer, the window keeps float64 sums about a per-type shift
``r_t`` (the type's first occurrence in the window, in the reduction's work dtype)::

    n_t,  S1_t = sum (x - r_t),  S2_t = sum ||x - r_t||^2,  unit sums

so a batch is folded in by one ``index_add_`` per array of its per-type sums (the
reduction computes them about the same shifts: :func:`embgeom.compute.reduce.reduce_batch`
with ``tokens=`` this window), and the moments are rebuilt once per type at export::

    mean_t = r_t + S1_t / n_t,   m2_t = S2_t - ||S1_t||^2 / n_t

The shifted-data algorithm again: ``r_t`` is one draw of the type's own distribution, so
``||mean_t - r_t||^2`` is of the order of its variance ``V_t`` and the subtraction costs a
factor ``1 + ||mean_t - r_t||^2 / V_t`` of relative precision, however large the type's
mean (M >> V at a first position or in a massive-activation dimension). Identical
occurrences give ``S1 = S2 = 0``: mean ``r_t`` and ``m2 = 0`` exactly.

Per layer, the window keeps float64 sums about a fixed shift ``s`` (its first
batch's mean)::

    n,  S1 = sum (x - s),  A = sum (x - s)(x - s)^T,  unit sums

into which the reduction adds each batch's GEMM directly (:class:`LayerSums` is its
``ComomentSink``); the moments leave as ``mean = s + S1 / n`` and
``C = A - S1 S1^T / n``. That is the shifted-data algorithm: with s within a few standard
deviations of the mean, ``S1 S1^T / n`` is of the order of C, so the subtraction loses
nothing that matters in float64, and no d x d matrix per batch is allocated or merged.
Checkpoints are merged with Chan's formula in the store.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from embgeom.compute.reduce import Workspace
from embgeom.stats import LayerMoments, TokenMoments

__all__ = ["LayerSums", "WindowAccumulator"]

F64 = torch.float64


class LayerSums:
    """Per-layer sums of a window about a fixed shift (see the module docstring); with
    ``cross_layer``, also ``X = sum (x - s)(x - s)^T`` over the concatenated layers,
    (L d, L d), the same sums across layers."""

    def __init__(self, num_layers: int, dim: int, device, cross_layer: bool = False):
        z = lambda *shape: torch.zeros(shape, dtype=F64, device=device)  # noqa: E731
        self.n = 0
        self.shift: Optional[torch.Tensor] = None
        self.S1, self.A = z(num_layers, dim), z(num_layers, dim, dim)
        self.cross = z(num_layers * dim, num_layers * dim) if cross_layer else None
        self.unit_sum, self.unit_sq_sum = z(num_layers, dim), z(num_layers, dim)

    def add(self, layers: LayerMoments) -> None:
        """A batch's layer moments; its co-moment already added into ``A`` by the
        reduction, or given (then folded in: ``A += C + N d d^T``, d = mean - s)."""
        if layers.n == 0:
            return
        if self.shift is None:  # exactly representable in float32: any batch may centre on it
            self.shift = layers.mean.to(torch.float32).to(F64)
        delta = layers.mean - self.shift
        self.S1 += layers.n * delta
        if layers.comoment is not None:
            self.A += layers.comoment
            self.A.baddbmm_(delta[:, :, None], delta[:, None, :], alpha=layers.n)
            if self.cross is not None:
                if layers.cross is None:
                    raise ValueError("a cross_layer window needs each batch's cross co-moment")
                flat = delta.reshape(-1)
                self.cross += layers.cross
                self.cross.addr_(flat, flat, alpha=layers.n)
        self.unit_sum += layers.unit_sum
        self.unit_sq_sum += layers.unit_sq_sum
        self.n += int(layers.n)

    def moments(self) -> LayerMoments:
        """The window's layer moments (Chan form), float64 numpy on the host."""
        L, d = self.S1.shape
        if self.n == 0:
            zero = LayerMoments.empty(L, d)
            if self.cross is not None:
                zero.cross = np.zeros((L * d, L * d))
            return zero
        mean = self.shift + self.S1 / self.n
        C = self.A - self.S1[:, :, None] * self.S1[:, None, :] / self.n
        cross = None
        if self.cross is not None:
            flat = self.S1.reshape(-1)
            cross = (self.cross - flat[:, None] * flat[None, :] / self.n).cpu().numpy()
        return LayerMoments(self.n, mean.cpu().numpy(), C.cpu().numpy(),
                            self.unit_sum.cpu().numpy(), self.unit_sq_sum.cpu().numpy(), cross)


class WindowAccumulator:
    """Per-token and per-layer float64 moments of a window, on ``device``.

    Parameters
    ----------
    num_layers : the number of kept layers L.
    dim : the hidden size d.
    self_similarity : keep per-token unit-vector sums.
    capacity : rows allocated at the start.
    max_capacity : rows beyond which growth stops doubling and takes only what a batch
        needs (the window is checkpointed once past its byte budget, so doubling past it
        would allocate memory it never uses).
    cross_layer : also keep the cross-layer co-moment (see :class:`LayerSums`).
    shift_dtype : dtype of the per-type shifts ``r_t``: the reduction's work dtype
        (float32 by default), so the values it subtracts are the ones kept.
    """

    def __init__(self, num_layers: int, dim: int, self_similarity: bool, device="cpu",
                 capacity: int = 1024, max_capacity: Optional[int] = None,
                 cross_layer: bool = False, shift_dtype: torch.dtype = torch.float32):
        self.num_layers, self.dim, self.device = num_layers, dim, torch.device(device)
        self.self_similarity = self_similarity
        self.shift_dtype = shift_dtype
        self.max_capacity = max_capacity
        self.size = 0
        self.tokens = 0  # embeddings per layer
        self._alloc(capacity)
        self._sorted_keys = torch.zeros(0, dtype=torch.long, device=self.device)
        self._sorted_rows = torch.zeros(0, dtype=torch.long, device=self.device)
        self.layers = LayerSums(num_layers, dim, self.device, cross_layer)
        self.workspace = Workspace()  # the reduction's buffers, reused batch to batch

    def _alloc(self, capacity: int) -> None:
        L, d, dev = self.num_layers, self.dim, self.device
        old = getattr(self, "_keys", None)
        keys = torch.zeros(capacity, dtype=torch.long, device=dev)
        n = torch.zeros(capacity, dtype=F64, device=dev)
        shift = torch.zeros((capacity, L, d), dtype=self.shift_dtype, device=dev)
        s1 = torch.zeros((capacity, L, d), dtype=F64, device=dev)
        s2 = torch.zeros((capacity, L), dtype=F64, device=dev)
        unit = torch.zeros((capacity, L, d), dtype=F64, device=dev) if self.self_similarity else None
        if old is not None:
            s = self.size
            keys[:s], n[:s], shift[:s] = self._keys[:s], self._n[:s], self.shift[:s]
            s1[:s], s2[:s] = self._s1[:s], self._s2[:s]
            if unit is not None:
                unit[:s] = self._unit[:s]
        self._keys, self._n, self.shift, self._s1, self._s2, self._unit = keys, n, shift, s1, s2, unit

    def __len__(self) -> int:
        return self.size

    @staticmethod
    def row_bytes(num_layers: int, dim: int, self_similarity: bool, shift_bytes: int = 4) -> int:
        """Bytes of one token's state: key and count (8 bytes each), then per layer S2 (8),
        S1 (8 d), the shift (``shift_bytes`` d) and, with self-similarity, the unit-vector
        sum (8 d)."""
        per_layer = 8 + dim * (shift_bytes + (16 if self_similarity else 8))
        return 16 + num_layers * per_layer

    @classmethod
    def rows_within(cls, num_layers: int, dim: int, self_similarity: bool, nbytes: int) -> int:
        """Rows of that shape that fit in ``nbytes`` (at least 1)."""
        return max(1, nbytes // cls.row_bytes(num_layers, dim, self_similarity))

    @property
    def capacity(self) -> int:
        """Rows allocated."""
        return self._keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of per-token state in use."""
        return self.size * self.row_bytes(self.num_layers, self.dim, self.self_similarity,
                                          self.shift.element_size())

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` (sorted, unique, on this device), appending the ones never seen,
        and the mask of those new rows (their shifts are still to be set)."""
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
            if self.size + num_new > self.capacity:
                self._alloc(max(self._grown(), self.size + num_new))
            new_rows = torch.arange(self.size, self.size + num_new, device=self.device)
            rows[fresh] = new_rows
            self._keys[new_rows] = ids[fresh]
            self.size += num_new
            keys = self._keys[:self.size]
            self._sorted_keys, order = torch.sort(keys)
            self._sorted_rows = order
        return rows, fresh

    def _grown(self) -> int:
        """The next capacity: doubled, but not past ``max_capacity``; once there (a job
        larger than the budget), a quarter more at a time."""
        cap, top = self.capacity, self.max_capacity
        if top is None or 2 * cap <= top:
            return 2 * cap
        return top if cap < top else cap + cap // 4

    @torch.inference_mode()
    def add_sums(self, rows: torch.Tensor, n: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor,
                 unit_sum: Optional[torch.Tensor]) -> None:
        """Fold a batch's per-type sums about the rows' shifts into the window: one
        ``index_add_`` per array. ``rows`` (k,) from :meth:`rows`; ``n`` (k,), ``s1``
        (k, L, d), ``s2`` (k, L), ``unit_sum`` (k, L, d) or None, on this device; sums in
        another dtype (a batch's float32 sums) are widened to float64 in the workspace's
        buffers first."""
        self._n.index_add_(0, rows, self._wide("n", n))
        self._s1.index_add_(0, rows, self._wide("s1", s1))
        self._s2.index_add_(0, rows, self._wide("s2", s2))
        if self._unit is not None:
            self._unit.index_add_(0, rows, self._wide("unit64", unit_sum))

    def _wide(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` as float64: itself, or copied into the workspace buffer ``name``."""
        if t.dtype == F64:
            return t
        return self.workspace.take(name, tuple(t.shape), F64, self.device).copy_(t)

    @torch.inference_mode()
    def add(self, tokens: Optional[TokenMoments], layers: LayerMoments) -> None:
        """Fold in one batch: its layer moments, and its token moments (their tensors on
        this device, ids sorted and unique), or None when the reduction already added them
        (:func:`~embgeom.compute.reduce.reduce_batch` with ``tokens=`` this window).

        A batch's ``(n_b, mean_b, m2_b)`` of a type becomes sums about the type's shift
        (the batch's own mean, in the shift dtype, when the type is new)::

            S1 += n_b (mean_b - r_t),   S2 += m2_b + n_b ||mean_b - r_t||^2
        """
        if tokens is not None and len(tokens):
            rows, fresh = self.rows(tokens.ids.to(self.device))
            if bool(fresh.any()):
                self.shift.index_copy_(0, rows[fresh], tokens.mean[fresh].to(self.shift_dtype))
            delta = tokens.mean - self.shift.index_select(0, rows).to(F64)      # (k, L, d)
            n = tokens.n.to(F64)
            s2 = tokens.m2 + n[:, None] * (delta * delta).sum(dim=2)
            self.add_sums(rows, n, delta.mul_(n[:, None, None]), s2, tokens.unit_sum)
        self.layers.add(layers)
        self.tokens += int(layers.n)

    def export(self) -> tuple[TokenMoments, LayerMoments]:
        """The window as float64 numpy arrays on the host, tokens sorted by key: each type's
        moments rebuilt from its sums (module docstring), once per type."""
        s = self.size
        order = torch.argsort(self._keys[:s])
        n = self._n[:s][order]
        s1, s2 = self._s1[:s][order], self._s2[:s][order]
        mean = self.shift[:s][order].to(F64).add_(s1 / n[:, None, None])
        m2 = (s2 - (s1 * s1).sum(dim=2) / n[:, None]).clamp_(min=0.0)

        def host(t):
            return None if t is None else t.cpu().numpy()

        unit = None if self._unit is None else self._unit[:s][order]
        tokens = TokenMoments(ids=host(self._keys[:s][order]), n=host(n).astype(np.int64),
                              mean=host(mean), m2=host(m2), unit_sum=host(unit))
        return tokens, self.layers.moments()
