"""A collection's settings, and what they fix for each of its (collection, model) pairs.

Settings are chosen when a collection is created (``PUT /v1/collections/{c}``, or the
defaults on its first job) and never change: every number of a collection is counted by
one rule. A pair's :class:`PairConf` resolves them against the model (which layers exist,
the hidden size) and fixes the storage geometry (shards, co-moment chunks) for the pair's
generation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from embgeom.errors import InvalidInput

__all__ = ["KEYS", "UNITS", "PRESETS", "CollectionSettings", "PairConf", "shard_of", "chunk_rows",
           "layer_groups_for", "layer_bytes"]

KEYS = ("id", "string")
UNITS = ("token", "word")

# The paper's released code (Yamagiwa & Shimodaira): tokens keyed by their string with
# subword markers stripped, special tokens counted.
PRESETS = {
    "paper": {"key": "string", "unit": "token", "include_special": True, "layers": None,
              "self_similarity": True},
}


@dataclass(frozen=True)
class CollectionSettings:
    """How a collection counts: key, unit, special tokens, layers, self-similarity."""

    key: str = "id"
    unit: str = "token"
    include_special: bool = False
    layers: Optional[tuple[int, ...]] = None
    self_similarity: bool = True
    preset: Optional[str] = None
    cross_layer: bool = False

    def __post_init__(self):
        if self.key not in KEYS:
            raise InvalidInput(f"key must be one of {', '.join(KEYS)}", type="invalid_settings")
        if self.unit not in UNITS:
            raise InvalidInput(f"unit must be one of {', '.join(UNITS)}", type="invalid_settings")
        if self.layers is not None:
            layers = tuple(sorted(set(int(l) for l in self.layers)))
            if not layers or layers[0] < 0:
                raise InvalidInput("layers must be a non-empty list of indices >= 0 (or null)",
                                   type="invalid_settings")
            object.__setattr__(self, "layers", layers)

    @classmethod
    def from_preset(cls, name: str) -> "CollectionSettings":
        if name not in PRESETS:
            raise InvalidInput(f"unknown preset {name!r}; known: {', '.join(PRESETS)}",
                               type="invalid_settings")
        return cls(**PRESETS[name], preset=name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers) if self.layers is not None else None
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "CollectionSettings":
        d = dict(d)
        if d.get("layers") is not None:
            d["layers"] = tuple(d["layers"])
        return cls(**{k: d[k] for k in ("key", "unit", "include_special", "layers",
                                        "self_similarity", "preset", "cross_layer") if k in d})

    def same_rule(self, other: "CollectionSettings") -> bool:
        """The same counting rule (a preset's name is only a label)."""
        a, b = self.to_dict(), other.to_dict()
        a.pop("preset"), b.pop("preset")
        return a == b


def chunk_rows(d: int, chunk_bytes: int) -> tuple[int, ...]:
    """Row boundaries of the upper-triangular co-moment's chunks.

    Row i of the upper triangle holds ``d - i`` entries; rows are grouped greedily so a
    chunk (plus its ``n, mean`` prefix of ``1 + d`` floats) stays within ``chunk_bytes``.
    Returns ``(0, r1, ..., d)``.
    """
    budget = max(chunk_bytes // 8 - (1 + d), d)
    bounds, size = [0], 0
    for i in range(d):
        if size and size + (d - i) > budget:
            bounds.append(i)
            size = 0
        size += d - i
    bounds.append(d)
    return tuple(bounds)


def layer_bytes(d: int, self_similarity: bool, unit_norms: bool = True) -> int:
    """Bytes one kept layer adds to a token's records: m2 and the mean (d) in ``rec``,
    M, m2 (and ``||U||^2``) in ``scal``, the unit sum (d) in ``unit`` with self-similarity."""
    return 8 * ((1 + d) + (d if self_similarity else 0)
                + (3 if self_similarity and unit_norms else 2))


def layer_groups_for(L: int, d: int, self_similarity: bool,
                     record_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Kept-layer positions ``0..L-1`` cut into the fewest contiguous groups whose per-token
    records (:func:`layer_bytes` per layer, plus n) stay within ``record_bytes``, sizes
    balanced (they differ by at most one); a group holds at least one layer."""
    per = max(1, (record_bytes - 16) // layer_bytes(d, self_similarity))
    count = -(-L // per)
    return tuple(tuple(int(p) for p in g) for g in np.array_split(np.arange(L), count))


@dataclass(frozen=True)
class PairConf:
    """A pair's counting rule and storage geometry, fixed for one generation.

    ``layers`` are ``hidden_states`` indices (0 = embedding output) in increasing order;
    record layouts (see :mod:`embgeom.store.codec`) follow them. ``scal_unit_norms``: the
    scal records end with ``||U||^2`` per layer (true for every configuration resolved
    since they do; absent, hence false, in those stored before, whose records are
    ``1 + 2L`` floats and are read as they are).

    ``window_tokens`` is the window length texts are cut into (special tokens included),
    the model's maximum capped by the resolving worker's ``max_window_tokens``: it decides
    counts, so every worker and adopter of the generation uses it, whatever its own
    settings. 0 in a configuration fixed before it was pinned: each worker's own length.

    ``cross_layer``: the pair also keeps the co-moment of the concatenation of its kept
    layers, an (L d) x (L d) matrix whose (i, j) block of d x d is the centred cross-moment
    of layers i and j (the exact layer-by-layer CKA), stored as the per-layer co-moment is,
    in upper-triangular row chunks bounded by ``chunk_bytes`` (``cross_chunks``).

    ``layer_groups``: the kept-layer positions cut into contiguous groups
    (:func:`layer_groups_for`), each with its own token-record parts
    (:meth:`embgeom.store.keys.PartKeys.shard`), so a read of one layer touches one group's
    records and a checkpoint piece carries one group's bytes. Empty in a configuration
    stored before it was pinned: one group of every layer, the layout those were written in.
    """

    gen: int
    layers: tuple[int, ...]
    hidden_size: int
    num_hidden_states: int
    vocab_size: int
    shards: int
    self_similarity: bool
    key: str
    unit: str
    include_special: bool
    chunks: tuple[int, ...]
    architecture: str = ""
    created_at: float = 0.0
    extra: dict = field(default_factory=dict)
    window_tokens: int = 0
    scal_unit_norms: bool = False
    cross_layer: bool = False
    cross_chunks: tuple[int, ...] = ()
    layer_groups: tuple[tuple[int, ...], ...] = ()

    @property
    def L(self) -> int:
        return len(self.layers)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Kept-layer positions of each layer group (one group of all when not pinned)."""
        return self.layer_groups or (tuple(range(self.L)),)

    def group_of(self, position: int) -> tuple[int, int]:
        """``(group, position within the group)`` of a kept-layer position."""
        for g, members in enumerate(self.groups):
            if position in members:
                return g, members.index(position)
        raise ValueError(f"position {position} is not a kept layer")

    def group_span(self, g: int) -> slice:
        """Group g's positions as a slice of the layer axis (groups are contiguous)."""
        members = self.groups[g]
        return slice(members[0], members[-1] + 1)

    def group_view(self, g: int) -> "PairConf":
        """This configuration as seen by group g's records: its layers only, one group.
        The token records of a group are laid out as those of a pair keeping only its
        layers (:mod:`embgeom.store.codec`)."""
        return replace(self, layers=tuple(self.layers[p] for p in self.groups[g]),
                       layer_groups=())

    @property
    def stores_unit_norms(self) -> bool:
        """Scal records carry ``||U_{t,l}||^2`` (only pairs that keep unit sums have them)."""
        return self.scal_unit_norms and self.self_similarity

    @property
    def scal_width(self) -> int:
        """Floats of a scal record: ``1 + 2L``, or ``1 + 3L`` with the unit norms."""
        return 1 + (3 if self.stores_unit_norms else 2) * self.L

    @property
    def d(self) -> int:
        return self.hidden_size

    @property
    def cross_dim(self) -> int:
        """Width of the concatenated layers whose co-moment ``cross_layer`` keeps: L d."""
        return self.L * self.d

    def layer_position(self, layer: int) -> Optional[int]:
        """Index of hidden_states layer ``layer`` in the records, or None if not kept."""
        try:
            return self.layers.index(layer)
        except ValueError:
            return None

    def to_json(self) -> str:
        d = asdict(self)
        d["layers"], d["chunks"] = list(self.layers), list(self.chunks)
        d["cross_chunks"] = list(self.cross_chunks)
        d["layer_groups"] = [list(g) for g in self.layer_groups]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, raw) -> "PairConf":
        d = json.loads(raw)
        d["layers"], d["chunks"] = tuple(d["layers"]), tuple(d["chunks"])
        d["cross_chunks"] = tuple(d.get("cross_chunks", ()))
        # Absent in a configuration stored before groups: one group (today's layout).
        d["layer_groups"] = tuple(tuple(g) for g in d.get("layer_groups", ()))
        return cls(**d)

    @classmethod
    def resolve(cls, settings: CollectionSettings, gen: int, num_hidden_states: int,
                hidden_size: int, vocab_size: int, shards: int, chunk_bytes: int,
                architecture: str = "", created_at: float = 0.0,
                window_tokens: int = 0, record_bytes: int = 256 << 10) -> "PairConf":
        """The settings applied to one model; a layer the model lacks is refused. Layer
        groups are cut so a token's records of one group stay within ``record_bytes``."""
        layers = tuple(range(num_hidden_states)) if settings.layers is None else settings.layers
        missing = [l for l in layers if l >= num_hidden_states]
        if missing:
            raise InvalidInput(
                f"the collection keeps layers {list(layers)} but the model has hidden states "
                f"0..{num_hidden_states - 1}", type="layer_out_of_range", layers=list(layers),
                num_layers=num_hidden_states - 1)
        return cls(gen=gen, layers=tuple(layers), hidden_size=hidden_size,
                   num_hidden_states=num_hidden_states, vocab_size=vocab_size, shards=shards,
                   self_similarity=settings.self_similarity, key=settings.key,
                   unit=settings.unit, include_special=settings.include_special,
                   chunks=chunk_rows(hidden_size, chunk_bytes), architecture=architecture,
                   created_at=created_at, window_tokens=window_tokens,
                   scal_unit_norms=settings.self_similarity, cross_layer=settings.cross_layer,
                   cross_chunks=chunk_rows(len(layers) * hidden_size, chunk_bytes)
                   if settings.cross_layer else (),
                   layer_groups=layer_groups_for(len(layers), hidden_size,
                                                 settings.self_similarity, record_bytes))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def shard_of(keys: Sequence[int] | np.ndarray, shards: int) -> np.ndarray:
    """The shard of each token key: a Fibonacci hash, so consecutive ids (frequent tokens
    of one tokenizer family sit together) spread evenly. ndarray (k,) int64."""
    k = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = (k * _GOLDEN) >> np.uint64(32)
    return (h % np.uint64(shards)).astype(np.int64)
