"""The soak's plan: its timings, faults, collections and models, and the wide model
built for it (:func:`build_wide_model`)."""

from __future__ import annotations

from pathlib import Path

from embgeom.testing.models import build_gpt2_random

REPO = Path(__file__).resolve().parents[2]
LEASE_S = 10.0            # workers' EMBGEOM_LEASE_SECONDS: take-overs within seconds
HEARTBEAT_S = 1.0
SMALL_WINDOW = 64         # EMBGEOM_MAX_WINDOW_TOKENS of the third worker
SAMPLE_S = 3.0            # RSS, Redis memory and in-flight checkpoints
MEMORY_EVERY_S = 60.0     # MEMORY USAGE over every key
REDIS_GRACE_S = 15.0      # after Redis answers again, 503s are still the outage's (store timeout 10 s)
RSS_SLACK = (0.05, 50.0)  # growth allowed over the last two thirds: 5% + 50 MB
REST_EVERY_S = 120.0      # the load pauses this often until every process is at rest ...
REST_MAX_S = 90.0         # ... for at most this long: memory is compared at rest
HEAP_TRIM_S = 10.0        # EMBGEOM_HEAP_TRIM_SECONDS of every process: at rest, trimmed within a pause
OUTSTANDING_JOBS = 6      # unfinished jobs the load keeps at most (a slow machine is not buried)
# The API's bounded caches, small: they fill before the RSS window, so what grows in it
# is what nothing bounds (defaults: 64 MB of figures, 256 MB of token matrices).
API_CACHES = {"EMBGEOM_RENDER_CACHE_MB": "16", "EMBGEOM_GEOMETRY_CACHE_MB": "32"}
# (share of the load, what is SIGKILLed): all in the first third, the RSS window is the rest.
FAULTS = [(0.05, "worker0"), (0.12, "redis"), (0.19, "serve"), (0.26, "worker2")]
WIDE_SHAPE = {"n_layer": 16, "n_embd": 2048, "n_head": 16, "n_inner": 256, "n_positions": 256}
WIDE_VOCAB = 512

# Model speed classes on a CPU: largest job (texts) per model; the weight of its choice.
JOB_TEXTS = {"minilm": 30, "mpnet": 10, "smollm2": 4, "gemma3": 4, "wide": 3}
WEIGHT = {"minilm": 4, "mpnet": 2, "smollm2": 1, "gemma3": 1, "wide": 2}

# collection -> (settings PUT, models, texts: "short" sentences or "long" paragraphs)
PLANS = {
    "full": {
        "soak_paper": ({"preset": "paper"}, ["minilm", "mpnet"], "long"),
        "soak_word": ({"unit": "word"}, ["minilm", "smollm2"], "long"),
        "soak_layers": ({"layers": [0, 3, 6]}, ["minilm", "gemma3", "wide"], "short"),
        "soak_nosim": ({"self_similarity": False}, ["minilm", "smollm2"], "short"),
    },
    "quick": {
        "soak_paper": ({"preset": "paper"}, ["minilm"], "long"),
        "soak_word": ({"unit": "word"}, ["minilm"], "long"),
        "soak_layers": ({"layers": [0, 3, 6]}, ["minilm", "wide"], "short"),
        "soak_nosim": ({"self_similarity": False}, ["minilm"], "short"),
    },
}
# The wide model only in the layer-subset collection: a checkpoint writes each kept
# layer's co-moment (2048^2 x 8 B = 33.5 MB) as a segment, through an AOF fsynced on
# every write; all 17 layers (570 MB a checkpoint, up to 8 segments before a fold) would
# make the soak a disk benchmark of a shared machine.


def figure_names() -> dict[str, list[str]]:
    """The figures every read sweep asks, by path template: the names each route knows."""
    from embgeom import figures
    from embgeom.figures import geometry as geometry_figures

    return {"/v1/collections/{collection}/models/{model}/figures/{name}": list(figures.FIGURES),
            "/v1/collections/{collection}/models/{model}/layers/{layer}/figures/{name}":
                list(geometry_figures.LAYER_FIGURES),
            "/v1/compare/figures/{name}": list(geometry_figures.COMPARE_FIGURES)}


def collection_rules(settings: dict) -> dict:
    """The counting rules of a collection's PUT body (the paper preset resolved as the
    README states it: string keys, special tokens counted, token unit, all layers)."""
    if settings.get("preset") == "paper":
        return {"key": "string", "unit": "token", "include_special": True, "layers": None}
    return {"key": settings.get("key", "id"), "unit": settings.get("unit", "token"),
            "include_special": bool(settings.get("include_special", False)),
            "layers": settings.get("layers")}


def build_wide_model(folder: Path, texts: list[str]) -> Path:
    """A random GPT-2 of :data:`WIDE_SHAPE` (17 hidden states x 2048) with a byte-level
    BPE tokenizer of :data:`WIDE_VOCAB` entries trained on ``texts``, in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast


    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=WIDE_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok_dir = folder / "tokenizer"
    fast.save_pretrained(tok_dir)
    return build_gpt2_random(folder / "wide", tok_dir, seed=0, **WIDE_SHAPE)
