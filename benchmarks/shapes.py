"""Synthetic model shapes the host-side benchmarks replay (the packaged models' shapes:
:data:`embgeom.testing.models.DENSE_MODELS`)."""

from __future__ import annotations

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

