"""Model shapes the benchmarks and the memory figures refer to."""

from __future__ import annotations

# (vocab, hidden_states entries = blocks + 1, d) of the models the design names; the
# dense per-vocabulary float64 array the service must never allocate is their product x 8.
DENSE_MODELS: dict[str, tuple[int, int, int]] = {
    "all-MiniLM-L6-v2": (30522, 7, 384),
    "all-mpnet-base-v2": (30527, 13, 768),
    "SmolLM2-135M": (49152, 31, 576),
    "gemma-3-270m": (262144, 19, 640),
}

# Synthetic shapes of the host-ceiling benchmark: (hidden_states, d, kept layers, self-sim).
REPLAY_SHAPES: dict[str, dict] = {
    "minilm": {"layers": 7, "d": 384, "keep": None, "self_similarity": True},
    "minilm_nosim": {"layers": 7, "d": 384, "keep": None, "self_similarity": False},
    "mpnet_shape": {"layers": 13, "d": 768, "keep": None, "self_similarity": True},
    "1b_shape": {"layers": 17, "d": 2048, "keep": [0, 4, 8, 12, 16], "self_similarity": False},
    "1b_shape_all_layers": {"layers": 17, "d": 2048, "keep": None, "self_similarity": False},
    # a 7B-class model (32 blocks of 4096) keeping 5 of its 33 hidden states
    "7b_shape_5_layers": {"layers": 33, "d": 4096, "keep": [0, 8, 16, 24, 32],
                          "self_similarity": False},
}


def dense_bytes(vocab: int, layers: int, d: int) -> int:
    return vocab * layers * d * 8
