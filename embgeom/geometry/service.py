"""The geometry service: token embedding spaces held in the store, matched across models
(:mod:`embgeom.geometry.matching`), the measures of :mod:`embgeom.geometry` on them, read,
cached and bounded here (the only part of the package that does I/O).

A *space* is ``{collection, model, layer}``:

- ``layer`` an integer (a ``hidden_states`` index the collection keeps): the matrix whose
  row t is ``mu_t``, the mean embedding of token type t over everything the collection
  ingested for that model, for every type with ``n_t >= min_count``;
- ``layer = "input"``: the model's input embedding matrix ``E``
  (``model.get_input_embeddings().weight``) restricted to those same token types, row t
  being ``E[t]``. The collection only chooses which tokens (the ones its text contains);
  a word-unit collection's multi-piece words (hashed keys) have no row of ``E`` and are
  left out of its input space.

Under a collection keyed by ``"string"`` a token key is the smallest vocabulary id of its
canonical string (see :mod:`embgeom.compute.positions`), and an input row is that id's.

Two spaces are compared on their *shared tokens*:

- by key, when both pairs count tokens under the same key mode and the two tokenizers have
  the same vocabulary (every string with the same id): a space against another layer or
  another collection of the same model, for example;
- otherwise by canonical string, the paper preset's normalisation
  (:func:`~embgeom.compute.positions.canonical_token`: the tokenizer's ``##``, ``Ġ`` or
  ``▁`` stripped, case kept; a word by its name). When several tokens of one space share
  a canonical string (``s`` and ``##s`` under id keys), the one with the largest count
  ``n_t`` represents it, ties to the smallest key: deterministic, and the most frequent
  form is usually the word-initial one whatever the tokenizer's marker convention.

Every answer says how they were matched (``matched_by``), how many tokens matched
(``shared_tokens``) and how many were used (``tokens_used``, after a seeded sample and
after dropping rows with a zero vector).

Bounded work: a comparison reads the per-token scalars (one small record per token, cached
by the reader per version), matches and samples on them, and only then reads the means of
the tokens it uses (:meth:`~embgeom.store.reader.Reader.means_of`). Caps
(:class:`Limits`, from the settings) bound the tokens and neighbours of every request;
beyond them a comparison samples with its seed, and a read that cannot sample (the
neighbours and intrinsic dimension of a layer's token set) answers ``too_many_tokens``
with the ``min_count`` that would fit. Results are cached until either space changes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import numpy as np

from embgeom import reports
from embgeom.figures import geometry as gf
from embgeom.compute.positions import canonical_token, encode, is_word_key, token_markers
from embgeom.errors import InvalidInput, NotFound, Overloaded
from embgeom.geometry import intrinsic, local, similarity, steering
from embgeom.geometry.matching import Match, match_tokens, sample_pairs, select_rows
from embgeom.store import keys as K
from embgeom.store.keys import PairKeys
from embgeom.store.reader import PairState, Reader

__all__ = ["INPUT", "Space", "Limits", "SpaceTokens", "GeometryCache", "Geometry",
           "RenderedFigure"]

INPUT = "input"
# Draws of the random-map baseline of a steering transfer.
RANDOM_MAP_DRAWS = 32
ID_METHODS = ("local_pca", "twonn", "mle")
# Token pairs a global-similarity figure plots by default (a seeded sample).
FIGURE_PAIRS = 20_000
# What /v1/compare/global answers, each beside its baseline.
GLOBAL_SCORES = ("pearson_cosine", "cka_linear", "procrustes_residual", "unbiased_cka",
                 "mutual_knn", "cknna")


@dataclass(frozen=True)
class Space:
    """``{collection, model, layer}``; ``layer`` an int or ``"input"``."""

    collection: str
    model: str
    layer: Union[int, str]

    def to_dict(self) -> dict:
        return {"collection": self.collection, "model": self.model, "layer": self.layer}


@dataclass(frozen=True)
class Limits:
    """Caps on one geometry request (see the ``geometry_*`` settings)."""

    max_tokens: int = 5000
    max_lle_tokens: int = 3000
    max_k: int = 100
    min_shared_tokens: int = 20
    token_budget: int = 16384

    @classmethod
    def from_settings(cls, s) -> "Limits":
        return cls(s.geometry_max_tokens, s.geometry_max_lle_tokens, s.geometry_max_k,
                   s.geometry_min_shared_tokens, s.token_budget)


@dataclass
class SpaceTokens:
    """The token types a space's rows can be: the pair's types with ``n_t >= min_count``.

    ``keys`` (k,) int64 ascending, ``n`` (k,) their counts, ``all_n`` the counts of every
    type of the pair (for the ``min_count`` that would fit a cap), ``position`` the layer's
    place in the records (None for an input space)."""

    space: Space
    state: PairState
    position: Optional[int]
    keys: np.ndarray
    n: np.ndarray
    all_n: np.ndarray
    min_count: int

    @property
    def key_mode(self) -> str:
        return self.state.conf.key if self.state.conf is not None else "id"

    @property
    def ident(self) -> tuple:
        """What the space's contents depend on: it changes with every checkpoint."""
        return (self.space.collection, self.space.model, self.space.layer, self.state.gen,
                self.state.version, self.min_count)

    @property
    def settled(self) -> bool:
        return self.state.applying == 0

    def min_count_to_fit(self, cap: int) -> int:
        """The smallest ``min_count >= self.min_count`` keeping at most ``cap`` types."""
        above = np.sort(self.all_n[self.all_n >= self.min_count])[::-1]
        if above.shape[0] <= cap:
            return self.min_count
        return int(above[cap]) + 1


# ------------------------------------------------------------------------------ cache


class GeometryCache:
    """A thread-safe LRU of results and token matrices, bounded by entries and bytes.

    Keys carry each space's (collection, model, generation, version): a checkpoint or a
    deletion makes new keys, and the old entries age out. Nothing is stored while a
    checkpoint is being applied (``applying > 0``: a read may be partial)."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 256 << 20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key][0]
            self.misses += 1
            return None

    def put(self, key, value, nbytes: int = 0) -> None:
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._bytes -= self._items.pop(key)[1]
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._bytes -= size

    def __len__(self) -> int:
        return len(self._items)


# ------------------------------------------------------------------------------ helpers


def _f(x) -> Optional[float]:
    """A float for JSON: nan and infinities are null."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else None


def _cosine(u: np.ndarray, v: np.ndarray) -> Optional[float]:
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    if nu == 0 or nv == 0:
        return None
    return float(np.clip(u @ v / (nu * nv), -1.0, 1.0))


def _unit_rows(X: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(X, axis=1)
    return X / np.where(norms > 0, norms, 1.0)[:, None]


def _digest(payload) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- service


class Geometry:
    """The geometry reads of one service process: resolve spaces, read and match their
    tokens, compute with :mod:`embgeom.geometry`, cache the results.

    Parameters
    ----------
    reader : the store's :class:`~embgeom.store.reader.Reader`.
    run : runs a read plan synchronously (``Runtime.read_sync``): every method here is
        CPU-bound and meant for a worker thread, never the event loop.
    registry : the :class:`~embgeom.compute.models.ModelRegistry` (aliases, tokenizers).
    models : alias -> :class:`~embgeom.compute.models.LoadedModel`, for input spaces and
        steering texts (``ModelPool.get``; called only when needed).
    limits, cache, max_concurrent : caps, the result cache, and how many computations may
        run at once (beyond: ``overloaded``, 429).
    """

    def __init__(self, reader: Reader, run: Callable, registry, models: Callable,
                 limits: Limits = Limits(), cache: Optional[GeometryCache] = None,
                 max_concurrent: int = 2):
        self.reader = reader
        self.run = run
        self.registry = registry
        self.models = models
        self.limits = limits
        self.cache = cache if cache is not None else GeometryCache()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._vocab_same: dict[tuple[str, str], bool] = {}

    # ------------------------------------------------------------------ spaces
    def check_space(self, space: Space) -> None:
        """Name, alias and layer range of a space (before any read)."""
        if not K.valid_name(space.collection):
            raise InvalidInput(f"collection name {space.collection!r} does not match "
                               f"{K.NAME_PATTERN}", type="invalid_collection_name")
        self.registry.source(space.model)  # unknown_model (404)
        info = self.registry.info(space.model)
        if isinstance(space.layer, str):
            if space.layer != INPUT:
                raise InvalidInput(f"layer must be an integer or {INPUT!r}, got {space.layer!r}",
                                   type="invalid_space")
        elif isinstance(space.layer, bool) or not 0 <= space.layer <= info.num_layers:
            raise NotFound("layer_not_found", f"layer {space.layer} is out of range for "
                           f"{space.model}: 0..{info.num_layers}", layer=space.layer,
                           num_layers=info.num_layers)

    def tokens(self, space: Space, min_count: int) -> SpaceTokens:
        """The pair's state and its token types with ``n_t >= min_count``:
        ``collection_not_found``, ``model_not_in_collection``, ``layer_not_kept``."""
        if min_count < 1:
            raise InvalidInput("min_count must be >= 1", type="invalid_filter")
        self.check_space(space)
        state = self.run(self.reader.pair_state(PairKeys(space.collection, space.model)))
        empty = np.zeros(0, dtype=np.int64)
        if state.empty:
            return SpaceTokens(space, state, None, empty, np.zeros(0), np.zeros(0), min_count)
        position = None
        if space.layer != INPUT:
            position = state.conf.layer_position(space.layer)
            if position is None:
                raise NotFound("layer_not_kept",
                               f"layer {space.layer} is not among the layers collection "
                               f"{space.collection!r} keeps: {list(state.conf.layers)}",
                               layer=space.layer, kept=list(state.conf.layers))
        scal = self.run(self.reader.scalars(state))
        keep = scal.n >= min_count
        if space.layer == INPUT:
            keep &= ~is_word_key(scal.ids)
        return SpaceTokens(space, state, position, scal.ids[keep], scal.n[keep], scal.n, min_count)

    def strings(self, t: SpaceTokens, keys: np.ndarray) -> list[str]:
        """Canonical strings of keys (the matching key across tokenizers): as shown under
        string keys, with the tokenizer's marker stripped under id keys."""
        shown = self.display(t, keys)
        if t.key_mode == "string":
            return shown
        markers = token_markers(self.registry.tokenizer(t.space.model))
        return [canonical_token(s, markers) for s in shown]

    def display(self, t: SpaceTokens, keys: np.ndarray) -> list[str]:
        """Token strings as the collection counts them, as ``/tokens`` shows them: the
        tokenizer's own string under id keys, the canonical one under string keys, a
        word's name (:func:`~embgeom.reports.token_strings`)."""
        return self.run(reports.token_strings(self.reader, t.state,
                                              self.registry.tokenizer(t.space.model), keys))

    def same_vocabulary(self, a: str, b: str) -> bool:
        if a == b:
            return True
        key = tuple(sorted((a, b)))
        if key not in self._vocab_same:
            va = self.registry.tokenizer(a).get_vocab()
            vb = self.registry.tokenizer(b).get_vocab()
            self._vocab_same[key] = va == vb
        return self._vocab_same[key]

    def match(self, a: SpaceTokens, b: SpaceTokens) -> Match:
        """Shared tokens of two spaces (see the module docstring for the rule)."""
        by_id = a.key_mode == b.key_mode and self.same_vocabulary(a.space.model, b.space.model)
        if by_id:
            return match_tokens(a.keys, a.n, None, b.keys, b.n, None, "id")
        return match_tokens(a.keys, a.n, self.strings(a, a.keys),
                            b.keys, b.n, self.strings(b, b.keys), "string")

    def rows(self, t: SpaceTokens, idx: np.ndarray) -> np.ndarray:
        """The space's vectors of ``t.keys[idx]``: (len(idx), d) float64."""
        keys = t.keys[idx]
        if t.space.layer == INPUT:
            weight = self.models(t.space.model).model.get_input_embeddings().weight
            return weight.detach()[keys].double().cpu().numpy()
        _, _, mean = self.run(self.reader.means_of(t.state, keys, [t.position]))
        return mean[:, 0]

    def matrix(self, t: SpaceTokens) -> np.ndarray:
        """Every row of a space (its tokens with ``n_t >= min_count``), cached."""
        key = ("matrix",) + t.ident
        X = self.cache.get(key) if t.settled else None
        if X is None:
            X = self.rows(t, np.arange(t.keys.shape[0]))
            if t.settled:
                self.cache.put(key, X, X.nbytes)
        return X

    # ----------------------------------------------------------------- helpers
    @contextmanager
    def _slot(self):
        if not self._slots.acquire(timeout=0.5):
            raise Overloaded("too many geometry computations in progress; retry shortly")
        try:
            yield
        finally:
            self._slots.release()

    def _cached(self, key, spaces: Sequence[SpaceTokens], compute: Callable[[], dict]) -> dict:
        settled = all(t.settled for t in spaces)
        if settled:
            hit = self.cache.get(key)
            if hit is not None:
                return hit
        with self._slot():
            out = compute()
        if settled:
            self.cache.put(key, out)
        return out

    def _check_k(self, k: int, available: int, low: int = 1) -> None:
        if k < low:
            raise InvalidInput(f"k must be >= {low}, got {k}", type="invalid_k", k=k)
        if k > self.limits.max_k:
            raise InvalidInput(f"k={k} exceeds the limit of {self.limits.max_k} neighbours",
                               type="k_too_large", k=k, limit=self.limits.max_k)
        if k >= available:
            raise InvalidInput(f"k={k} needs more than {k} tokens; {available} are available",
                               type="k_too_large", k=k, tokens=available)

    def _shared(self, ta: SpaceTokens, tb: SpaceTokens, cap: int, sample: Optional[int],
                seed: int, need: int) -> dict:
        m = self.match(ta, tb)
        need = max(need, self.limits.min_shared_tokens)
        if len(m) < need:
            raise InvalidInput(
                f"{len(m)} tokens with n >= {ta.min_count} are shared by the two spaces; at "
                f"least {need} are needed (ingest more text or lower min_count)",
                type="too_few_shared_tokens", shared_tokens=len(m), needed=need)
        if sample is not None and sample < need:
            raise InvalidInput(f"sample must be at least {need}", type="invalid_sample",
                               sample=sample, needed=need)
        idx, sampled = select_rows(len(m), cap, sample, seed)
        ra, rb = m.rows_a[idx], m.rows_b[idx]
        Xa, Xb = self.rows(ta, ra), self.rows(tb, rb)
        # A zero vector has no direction (cosines undefined): never a real mean, possibly
        # an input row (padding); left out and counted.
        ok = (np.linalg.norm(Xa, axis=1) > 0) & (np.linalg.norm(Xb, axis=1) > 0)
        if not ok.all():
            Xa, Xb, ra, rb = Xa[ok], Xb[ok], ra[ok], rb[ok]
        if Xa.shape[0] < need:
            raise InvalidInput(f"{Xa.shape[0]} usable shared tokens; at least {need} are needed",
                               type="too_few_shared_tokens", shared_tokens=int(Xa.shape[0]),
                               needed=need)
        return {"match": m, "Xa": Xa, "Xb": Xb, "rows_a": ra, "rows_b": rb, "sampled": sampled,
                "header": {"a": ta.space.to_dict(), "b": tb.space.to_dict(),
                           "matched_by": m.by, "shared_tokens": len(m),
                           "tokens_used": int(Xa.shape[0]), "sampled": sampled,
                           "min_count": ta.min_count, "seed": seed}}

    @staticmethod
    def _as_of(ta: SpaceTokens, tb: SpaceTokens) -> dict:
        return {"a": ta.state.as_of(), "b": tb.state.as_of()}

    # ---------------------------------------------------------- global similarity
    def compare_global(self, a: Space, b: Space, min_count: int = 5,
                       sample: Optional[int] = None, seed: int = 0, k: int = 10) -> dict:
        """Every global measure of two spaces over their shared tokens (or a seeded sample
        of them), each beside a shuffled baseline (:func:`embgeom.geometry.similarity.
        global_similarity`).

        ``pearson_cosine``: Pearson r between ``cos(a_i, a_j)`` and ``cos(b_i, b_j)`` over
        all pairs i < j of used tokens (1: the same relative orientations; about 0 for
        unrelated spaces). ``cka_linear``: linear CKA of the column-centred matrices (1 for
        a rotation and scaling; about ``sqrt(d_a d_b) / m`` for unrelated ones, near 1 when
        m is not much larger than d). ``unbiased_cka``: the same with the debiased HSIC
        (about 0 for unrelated spaces whatever m and d). ``procrustes_residual``:
        ``min_R ||A_n R - B_n||_F^2`` over orthogonal R after centring, scaling to unit
        Frobenius norm and zero-padding the narrower space (0: the same shape; up to 2).
        ``mutual_knn``: mean share of a token's ``k`` nearest tokens by cosine common to
        both spaces (chance ``k / (m - 1)``). ``cknna``: debiased CKA of the cosine kernels
        restricted to mutual neighbours. ``baseline``: each with b's rows shuffled
        (seeded): what these marginal geometries give without a correspondence.
        """
        if seed < 0:
            raise InvalidInput("seed must be >= 0", type="invalid_seed")
        return self._global(self.tokens(a, min_count), self.tokens(b, min_count), sample, seed, k)

    def _global(self, ta: SpaceTokens, tb: SpaceTokens, sample: Optional[int], seed: int,
                k: int = 10) -> dict:
        key = ("global", ta.ident, tb.ident, sample, seed, k)

        def compute():
            self._check_k(k, self.limits.max_tokens)
            s = self._shared(ta, tb, self.limits.max_tokens, sample, seed, 4)
            self._check_k(k, s["Xa"].shape[0])
            g = similarity.global_similarity(s["Xa"], s["Xb"], None, seed, k)
            scores = {name: _f(g[name]) for name in GLOBAL_SCORES}
            return {**s["header"], "pairs": g["pairs"], "k": g["k"], **scores,
                    "chance_mutual_knn": k / (s["Xa"].shape[0] - 1),
                    "baseline": {name: _f(g["baseline"][name]) for name in GLOBAL_SCORES},
                    "as_of": self._as_of(ta, tb)}

        return self._cached(key, (ta, tb), compute)

    # ---------------------------------------------------------------------- LLE
    def compare_lle(self, a: Space, b: Space, k: int = 10, min_count: int = 5,
                    sample: Optional[int] = None, seed: int = 0, reg: float = 1e-3) -> dict:
        """LLE weights of each token from its k nearest neighbours in a, reused in b.

        Errors are fractions of b's total variance left unexplained by the reconstructions
        (:func:`embgeom.geometry.local.lle_transfer`): ``transfer_error`` (a's neighbours and
        weights), ``own_error`` (a's neighbours, b's optimal weights: the floor),
        ``own_neighbors_error`` (plain LLE in b), ``random_error`` (a's neighbours, random
        weights on the simplex: the baseline), their ratios, ``neighbor_overlap`` (mean
        share of a token's k neighbours that are the same in both spaces) beside
        ``chance_overlap = k / (m - 1)``.
        """
        if seed < 0:
            raise InvalidInput("seed must be >= 0", type="invalid_seed")
        if not (reg >= 0 and np.isfinite(reg)):
            raise InvalidInput("reg must be a finite number >= 0", type="invalid_reg")
        return self._lle(self.tokens(a, min_count), self.tokens(b, min_count), k, sample, seed, reg)

    def _lle(self, ta: SpaceTokens, tb: SpaceTokens, k: int, sample: Optional[int], seed: int,
             reg: float) -> dict:
        key = ("lle", ta.ident, tb.ident, k, sample, seed, reg)

        def compute():
            self._check_k(k, self.limits.max_lle_tokens)
            s = self._shared(ta, tb, self.limits.max_lle_tokens, sample, seed, 3)
            self._check_k(k, s["Xa"].shape[0])
            r = local.lle_transfer(s["Xa"], s["Xb"], k, reg, seed)
            m = s["Xa"].shape[0]
            out = {**s["header"], **{name: _f(v) for name, v in r.items() if name not in ("k", "reg")}}
            out.update({"k": k, "reg": reg, "chance_overlap": k / (m - 1),
                        "as_of": self._as_of(ta, tb)})
            return out

        return self._cached(key, (ta, tb), compute)

    # ------------------------------------------------------- intrinsic dimension
    def _candidates(self, t: SpaceTokens) -> None:
        cap = self.limits.max_tokens
        if t.keys.shape[0] > cap:
            fit = t.min_count_to_fit(cap)
            raise InvalidInput(
                f"{t.keys.shape[0]} token types have n >= {t.min_count}, more than the "
                f"{cap} one request may scan; min_count={fit} keeps few enough",
                type="too_many_tokens", tokens=int(t.keys.shape[0]), limit=cap,
                min_count_to_fit=fit)

    def _neighbour_lists(self, t: SpaceTokens, X: np.ndarray, rows: Sequence[int],
                         count: int) -> list[list[dict]]:
        """The ``count`` nearest tokens by cosine of each of ``rows`` (itself excluded)."""
        if count == 0 or not len(rows):
            return [[] for _ in rows]
        U = _unit_rows(X)
        out = []
        for i in rows:
            cos = U @ U[i]
            cos[i] = -np.inf
            top = np.lexsort((t.keys, -cos))[:count]
            strings = self.display(t, t.keys[top])
            out.append([{"token_id": int(t.keys[j]), "token": s, "cosine": float(cos[j])}
                        for j, s in zip(top, strings)])
        return out

    def intrinsic_dimension(self, space: Space, k: int = 20, method: str = "local_pca",
                            threshold: float = 0.9, min_count: int = 5, limit: int = 10,
                            neighbors: int = 0) -> dict:
        """Per-token intrinsic dimension of a layer's token means, on the k nearest
        neighbours (Euclidean) of each token among the types with ``n_t >= min_count``.

        ``method``: ``local_pca`` (how many principal components of the token's
        k-neighbourhood reach ``threshold`` of its variance: an integer; the global value
        is their mean), ``twonn`` (TwoNN on the ratios r2/r1 pooled over the token and its
        k neighbours; global: TwoNN over all tokens) or ``mle`` (Levina-Bickel on the k
        neighbour distances; global: the MacKay-Ghahramani average). ``lowest`` and
        ``highest``: the ``limit`` tokens with the smallest and largest estimates (ties:
        the more frequent first, then the smaller id), each with its ``neighbors``
        nearest tokens by cosine when asked.
        """
        self._check_id_method(method, threshold)
        return self._intrinsic(self.tokens(space, min_count), k, method, threshold, limit, neighbors)

    @staticmethod
    def _check_id_method(method: str, threshold: float) -> None:
        if method not in ID_METHODS:
            raise InvalidInput(f"method must be one of {', '.join(ID_METHODS)}", type="invalid_method")
        if not 0 < threshold < 1:
            raise InvalidInput("threshold must be in (0, 1)", type="invalid_threshold")

    def _id_estimates(self, t: SpaceTokens, k: int, method: str, threshold: float):
        """Every token's estimate (t.keys order) and the global one, cached (the caller
        holds a computation slot)."""
        key = ("id_estimates", t.ident, k, method, threshold if method == "local_pca" else None)
        hit = self.cache.get(key) if t.settled else None
        if hit is not None:
            return hit
        self._candidates(t)
        self._check_k(k, t.keys.shape[0], low=3 if method == "twonn" else 2)
        X = self.matrix(t)
        try:
            est = intrinsic.intrinsic_dimension(X, method, k, threshold)
        except ValueError as exc:
            raise InvalidInput(str(exc), type="invalid_geometry_input") from None
        out = (np.asarray(est.per_point, dtype=np.float64), float(est.dimension))
        if t.settled:
            self.cache.put(key, out, out[0].nbytes)
        return out

    def _intrinsic(self, t: SpaceTokens, k: int, method: str, threshold: float, limit: int,
                   neighbors: int) -> dict:
        space, min_count = t.space, t.min_count
        key = ("id", t.ident, k, method, threshold if method == "local_pca" else None, limit, neighbors)

        def compute():
            per, dimension = self._id_estimates(t, k, method, threshold)
            X = self.matrix(t) if neighbors else None
            finite = np.flatnonzero(np.isfinite(per))
            low = finite[np.lexsort((t.keys[finite], -t.n[finite], per[finite]))][:limit]
            high = finite[np.lexsort((t.keys[finite], -t.n[finite], -per[finite]))][:limit]

            def listing(rows):
                strings = self.display(t, t.keys[rows])
                near = self._neighbour_lists(t, X, rows, neighbors)
                out = []
                for j, i in enumerate(rows):
                    row = {"token_id": int(t.keys[i]), "token": strings[j], "n": int(t.n[i]),
                           "estimate": float(per[i])}
                    if neighbors:
                        row["neighbors"] = near[j]
                    out.append(row)
                return out

            return {
                "collection": space.collection, "model": space.model, "layer": space.layer,
                "method": method, "k": k, "threshold": threshold if method == "local_pca" else None,
                "min_count": min_count, "tokens": int(t.keys.shape[0]),
                "dimension": _f(dimension),
                "mean": _f(per[finite].mean()) if finite.size else None,
                "median": _f(np.median(per[finite])) if finite.size else None,
                "undefined": int(per.shape[0] - finite.size),
                "lowest": listing(low), "highest": listing(high), "as_of": t.state.as_of(),
            }

        return self._cached(key, (t,), compute)

    # -------------------------------------------------------------- neighbours
    def neighbors(self, space: Space, token_id: int, k: int = 10, min_count: int = 5) -> dict:
        """The k tokens whose mean is nearest by cosine to token ``token_id``'s mean, among
        the layer's types with ``n_t >= min_count`` (the token itself excluded; it need
        not pass the filter itself). Ordered by cosine, descending, ties by id."""
        t = self.tokens(space, min_count)
        key = ("neighbors", t.ident, int(token_id), k)

        def compute():
            self._check_k(k, self.limits.max_k + 1)
            self._candidates(t)
            where = np.searchsorted(t.keys, token_id)
            inside = where < t.keys.shape[0] and t.keys[where] == token_id
            if t.state.empty:
                n_q = 0.0
            elif inside:
                n_q = float(t.n[where])
            else:
                n, _, mean = self.run(self.reader.means_of(t.state, [token_id], [t.position]))
                n_q, q = float(n[0]), mean[0, 0]
            if n_q == 0:
                raise NotFound("token_not_found", f"token {token_id} was never seen at layer "
                               f"{space.layer} of this collection", token_id=int(token_id))
            X = self.matrix(t)
            if inside:
                q = X[where]
            norms = np.linalg.norm(X, axis=1)
            qn = np.linalg.norm(q)
            with np.errstate(invalid="ignore", divide="ignore"):
                cos = (X @ q) / (norms * qn)
            cos = np.where(np.isfinite(cos), np.clip(cos, -1.0, 1.0), -np.inf)
            if inside:
                cos[where] = -np.inf
            top = np.lexsort((t.keys, -cos))[:k]
            top = top[np.isfinite(cos[top])]
            strings = self.display(t, t.keys[top])
            (q_string,) = self.display(t, np.array([token_id]))
            return {
                "collection": space.collection, "model": space.model, "layer": space.layer,
                "token_id": int(token_id), "token": q_string, "n": int(n_q), "k": k,
                "min_count": min_count, "candidates": int(t.keys.shape[0] - (1 if inside else 0)),
                "neighbors": [{"token_id": int(t.keys[j]), "token": s, "n": int(t.n[j]),
                               "cosine": float(cos[j])} for j, s in zip(top, strings)],
                "as_of": t.state.as_of(),
            }

        return self._cached(key, (t,), compute)

    # ----------------------------------------------------------------- Emb2Emb
    def text_vectors(self, t: SpaceTokens, texts: Sequence[str]) -> np.ndarray:
        """One vector per text in a space: the mean of the text's counted positions (the
        collection's rule) at the layer, or of their input embedding rows: (len, d)."""
        loaded = self.models(t.space.model)
        include_special = bool(t.state.conf.include_special)
        if t.space.layer == INPUT:
            enc = encode(loaded.tokenizer, texts, loaded.info.max_length, include_special)
            text_of = np.repeat(enc.text_index, enc.lengths)[enc.counted]
            ids = enc.input_ids[enc.counted]
            weight = loaded.model.get_input_embeddings().weight.detach()
            rows = weight[ids].double().cpu().numpy()
            sums = np.zeros((len(texts), rows.shape[1]))
            np.add.at(sums, text_of, rows)
            counts = np.bincount(text_of, minlength=len(texts)).astype(np.float64)
            return sums / np.maximum(counts, 1.0)[:, None]
        from embgeom.compute.engine import text_embeddings  # torch only when texts are sent

        return text_embeddings(loaded, list(texts), [t.space.layer], "mean", include_special,
                               self.limits.token_budget)[t.space.layer]

    def steering_vector(self, t: SpaceTokens, positive: Sequence[str],
                        negative: Sequence[str]) -> np.ndarray:
        """Difference of means: ``mean_p v(p) - mean_q v(q)`` over the texts' vectors
        (cached: it depends on the model, the layer, the counting rule and the texts only)."""
        key = ("steering_vector", t.space.model, t.space.layer, bool(t.state.conf.include_special),
               _digest([list(positive), list(negative)]))
        v = self.cache.get(key)
        if v is None:
            vectors = self.text_vectors(t, list(positive) + list(negative))
            v = vectors[:len(positive)].mean(axis=0) - vectors[len(positive):].mean(axis=0)
            self.cache.put(key, v, v.nbytes)
        return v

    def steering_transfer(self, a: Space, b: Space, vector: Optional[Sequence[float]] = None,
                          positive_texts: Optional[Sequence[str]] = None,
                          negative_texts: Optional[Sequence[str]] = None, ridge: float = 1.0,
                          held_out: float = 0.2, seed: int = 0, min_count: int = 5,
                          sample: Optional[int] = None, return_vector: bool = True) -> dict:
        """Emb2Emb: fit ``b ~ a W + c`` (ridge) on the shared tokens' vectors, map a
        steering vector of a into b, and compare it with b's own.

        ``ridge`` is relative: the penalty on ``||W||_F^2`` is
        ``ridge * ||A_c||_F^2 / d_a``, the mean eigenvalue of a's centred Gram matrix over
        the tokens used (``map.ridge_absolute``), so one value means the same for any
        model, layer and number of tokens.

        ``map``: the fit on ``round(held_out * m)`` held-out tokens: ``r2`` (share of b's
        held-out variance explained; 0 is predicting b's mean), ``mean_cosine`` (mean
        cosine of prediction and truth) beside ``mean_baseline_cosine`` (the same for the
        training mean of b: what anisotropy alone gives). The steering vector is
        ``vector`` (length d_a) or the difference of the mean vectors of
        ``positive_texts`` and ``negative_texts`` in a (each text pooled over its counted
        positions, as the collection counts them). ``vector`` in the answer is
        ``v_a W`` (length d_b); with texts, ``cosine`` is its cosine with b's own
        difference of means for the same texts, and ``baseline`` gives the same cosine
        for random Gaussian maps of W's norm (``random_map``: the first draw, and the mean,
        std and largest absolute value over 32 draws) and for a map fit on shuffled
        token pairs (``shuffled_map``).
        """
        if seed < 0:
            raise InvalidInput("seed must be >= 0", type="invalid_seed")
        texts = positive_texts is not None or negative_texts is not None
        if (vector is None) == (not texts):
            raise InvalidInput("give either vector or positive_texts and negative_texts",
                               type="invalid_steering")
        if texts:
            if not positive_texts or not negative_texts:
                raise InvalidInput("positive_texts and negative_texts must both be non-empty",
                                   type="invalid_steering")
        if not (ridge >= 0 and np.isfinite(ridge)):
            raise InvalidInput("ridge must be a finite number >= 0", type="invalid_ridge")
        if not 0 < held_out < 1:
            raise InvalidInput("held_out must be in (0, 1)", type="invalid_held_out")
        ta, tb = self.tokens(a, min_count), self.tokens(b, min_count)
        d_a = self.registry.info(a.model).hidden_size
        if vector is not None:
            v = np.asarray(vector, dtype=np.float64)
            if v.ndim != 1 or v.shape[0] != d_a or not np.all(np.isfinite(v)):
                raise InvalidInput(f"vector must be {d_a} finite numbers (the width of "
                                   f"{a.model})", type="invalid_vector", expected=d_a,
                                   got=int(v.size))
            payload = v.tobytes().hex()
        else:
            payload = [list(positive_texts), list(negative_texts)]
        key = ("steer", ta.ident, tb.ident, _digest(payload), ridge, held_out, seed, sample,
               return_vector)

        def compute():
            s = self._shared(ta, tb, self.limits.max_tokens, sample, seed, 10)
            Xa, Xb = s["Xa"], s["Xb"]
            centred = Xa - Xa.mean(axis=0)
            # The penalty in units of the mean eigenvalue of a's Gram matrix: one value
            # means the same whatever the model's scale and the number of tokens.
            ridge_absolute = ridge * float(np.einsum("ij,ij->", centred, centred)) / Xa.shape[1]
            try:
                fit = steering.fit_linear_map(Xa, Xb, ridge_absolute, held_out, seed)
            except ValueError as exc:
                raise InvalidInput(str(exc), type="invalid_map") from None
            test = fit.held_out_rows
            train = np.setdiff1d(np.arange(Xa.shape[0]), test)
            centre = Xb[train].mean(axis=0)
            base_cos = np.array([_cosine(centre, row) or np.nan for row in Xb[test]])
            v_a = v if vector is not None else self.steering_vector(ta, positive_texts, negative_texts)
            moved = steering.transfer_vector(fit.weight, v_a)
            out = {**s["header"],
                   "map": {"r2": _f(fit.r2), "mean_cosine": _f(fit.mean_cosine),
                           "mean_baseline_cosine": _f(np.nanmean(base_cos)) if test.size else None,
                           "train_tokens": int(fit.n_train), "held_out_tokens": int(test.size),
                           "ridge": ridge, "ridge_absolute": ridge_absolute, "held_out": held_out},
                   "source": "vector" if vector is not None else "texts",
                   "source_norm": float(np.linalg.norm(v_a)),
                   "vector_norm": float(np.linalg.norm(moved)),
                   "vector": moved.tolist() if return_vector else None,
                   "cosine": None, "own_norm": None, "baseline": None,
                   "as_of": self._as_of(ta, tb)}
            if vector is None:
                own = self.steering_vector(tb, positive_texts, negative_texts)
                draws = [_cosine(v_a @ steering.random_map_like(fit.weight, seed + i), own)
                         for i in range(RANDOM_MAP_DRAWS)]
                draws = np.array([np.nan if c is None else c for c in draws])
                perm = np.random.default_rng([seed, 4]).permutation(Xa.shape[0])
                shuffled = steering.fit_linear_map(Xa, Xb[perm], ridge_absolute, held_out, seed)
                out.update({
                    "cosine": _cosine(moved, own), "own_norm": float(np.linalg.norm(own)),
                    "baseline": {
                        "random_map": {"cosine": _f(draws[0]), "mean": _f(np.nanmean(draws)),
                                       "std": _f(np.nanstd(draws)),
                                       "max_abs": _f(np.nanmax(np.abs(draws))),
                                       "draws": RANDOM_MAP_DRAWS},
                        "shuffled_map": {"cosine": _cosine(v_a @ shuffled.weight, own),
                                         "r2": _f(shuffled.r2)},
                    },
                })
            return out

        return self._cached(key, (ta, tb), compute)

    # ------------------------------------------------------------------ figures
    def _figure(self, key, spaces: Sequence[SpaceTokens], draw: Callable[[], "RenderedFigure"]):
        settled = all(t.settled for t in spaces)
        if settled:
            hit = self.cache.get(key)
            if hit is not None:
                return replace(hit, hit=True)
        with self._slot():
            out = draw()
        if settled:
            self.cache.put(key, out, len(out.content))
        return out

    def intrinsic_dimension_figure(self, space: Space, k: int = 20, method: str = "local_pca",
                                   threshold: float = 0.9, min_count: int = 5, limit: int = 8,
                                   fmt: str = "png") -> "RenderedFigure":
        """:func:`embgeom.figures.geometry.intrinsic_dimension` of a layer: the
        :meth:`intrinsic_dimension` answer (``limit`` tokens named at each end) and every
        token's estimate, from one read of the space; cached until it changes."""
        self._check_id_method(method, threshold)
        limit = min(limit, gf.MAX_NAMED)
        t = self.tokens(space, min_count)
        thr = threshold if method == "local_pca" else None
        result = self._intrinsic(t, k, method, threshold, limit, 0)
        key = ("figure", "intrinsic_dimension", fmt, t.ident, k, method, thr, limit)

        def draw():
            per, _ = self._id_estimates(t, k, method, threshold)
            content = gf.render(gf.intrinsic_dimension(result, per, t.n), fmt)
            return RenderedFigure(content, result["as_of"], {"dimension": result["dimension"]})

        return self._figure(key, (t,), draw)

    def global_figure(self, a: Space, b: Space, min_count: int = 5, sample: Optional[int] = None,
                      seed: int = 0, pairs: int = FIGURE_PAIRS, fmt: str = "png") -> "RenderedFigure":
        """:func:`embgeom.figures.geometry.global_similarity`: the :meth:`compare_global`
        answer and the cosines of a seeded sample of ``pairs`` of its token pairs (all of
        them when there are fewer), matched and under the answer's shuffled baseline."""
        if seed < 0:
            raise InvalidInput("seed must be >= 0", type="invalid_seed")
        if pairs < 1:
            raise InvalidInput("pairs must be >= 1", type="invalid_pairs")
        ta, tb = self.tokens(a, min_count), self.tokens(b, min_count)
        result = self._global(ta, tb, sample, seed)
        key = ("figure", "global", fmt, ta.ident, tb.ident, sample, seed, pairs)

        def draw():
            s = self._shared(ta, tb, self.limits.max_tokens, sample, seed, 3)
            Ua, Ub = _unit_rows(s["Xa"]), _unit_rows(s["Xb"])
            i, j = sample_pairs(Ua.shape[0], pairs, seed)
            # The baseline's permutation (similarity.global_similarity): b's rows shuffled.
            perm = np.random.default_rng([seed, 1]).permutation(Ua.shape[0])
            cos_a = np.einsum("ij,ij->i", Ua[i], Ua[j])
            cos_b = np.einsum("ij,ij->i", Ub[i], Ub[j])
            cos_s = np.einsum("ij,ij->i", Ub[perm[i]], Ub[perm[j]])
            content = gf.render(gf.global_similarity(result, cos_a, cos_b, cos_s), fmt)
            return RenderedFigure(content, result["as_of"], {
                "pearson": result["pearson_cosine"],
                "baseline_pearson": result["baseline"]["pearson_cosine"],
                "pairs_plotted": int(i.shape[0])})

        return self._figure(key, (ta, tb), draw)

    def lle_figure(self, a: Space, b: Space, k: int = 10, min_count: int = 5,
                   sample: Optional[int] = None, seed: int = 0, reg: float = 1e-3,
                   fmt: str = "png") -> "RenderedFigure":
        """:func:`embgeom.figures.geometry.lle`: the :meth:`compare_lle` answer and the same
        errors token by token (:func:`embgeom.geometry.local.lle_transfer_rows` on the same
        tokens, neighbours and seed)."""
        if seed < 0:
            raise InvalidInput("seed must be >= 0", type="invalid_seed")
        if not (reg >= 0 and np.isfinite(reg)):
            raise InvalidInput("reg must be a finite number >= 0", type="invalid_reg")
        ta, tb = self.tokens(a, min_count), self.tokens(b, min_count)
        result = self._lle(ta, tb, k, sample, seed, reg)
        key = ("figure", "lle", fmt, ta.ident, tb.ident, k, sample, seed, reg)

        def draw():
            s = self._shared(ta, tb, self.limits.max_lle_tokens, sample, seed, 3)
            rows = local.lle_transfer_rows(s["Xa"], s["Xb"], k, reg, seed)
            tokens = self.display(ta, ta.keys[s["rows_a"]])
            content = gf.render(gf.lle(result, rows, tokens), fmt)
            return RenderedFigure(content, result["as_of"], {
                "transfer_error": result["transfer_error"], "own_error": result["own_error"],
                "random_error": result["random_error"]})

        return self._figure(key, (ta, tb), draw)


@dataclass(frozen=True)
class RenderedFigure:
    """A geometry figure's bytes, the ``as_of`` of what it shows (one space's, or
    ``{"a", "b"}``), the headline numbers it shows (for response headers) and whether it
    came from the cache."""

    content: bytes
    as_of: dict
    numbers: dict
    hit: bool = False
