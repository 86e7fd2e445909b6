"""Models for tests and benchmarks: random-weight GPT-2s built on the spot, and the
shapes of the packaged models.

A random GPT-2 is saved as a model folder (``save_pretrained``) the service loads like any
other through ``EMBGEOM_MODELS``; a seed fixes its weights, so two folders built with one
seed hold the same model (two aliases of one model, or one model in several processes).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["GPT2_SHAPE", "build_gpt2_random", "DENSE_MODELS", "dense_bytes"]

# GPT-2 small's shape (12 blocks, 768 wide, 12 heads, 1,024 positions): the default.
GPT2_SHAPE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024}

# (vocab, hidden_states entries = blocks + 1, d) of the models the design names; the
# dense per-vocabulary float64 array the service must never allocate is their product x 8.
DENSE_MODELS: dict[str, tuple[int, int, int]] = {
    "all-MiniLM-L6-v2": (30522, 7, 384),
    "all-mpnet-base-v2": (30527, 13, 768),
    "SmolLM2-135M": (49152, 31, 576),
    "gemma-3-270m": (262144, 19, 640),
}


def dense_bytes(vocab: int, layers: int, d: int) -> int:
    return vocab * layers * d * 8


def build_gpt2_random(folder: Path, tokenizer_source, seed: int = 0, **shape) -> Path:
    """A GPT-2-shaped ``GPT2Model`` at random (``torch.manual_seed(seed)``; ``shape``
    overrides :data:`GPT2_SHAPE`) with the tokenizer of ``tokenizer_source``, saved with
    ``save_pretrained`` into ``folder``; the global torch random state is left as it was."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2Model

    shape = {**GPT2_SHAPE, **shape}
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.model_max_length = shape["n_positions"]
    config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **shape)
    config.architectures = ["GPT2Model"]
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPT2Model(config).eval()
    finally:
        torch.random.set_rng_state(state)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
