"""The soak harness (benchmarks/soak.py): its pure parts against independent computations.

The soak itself (``make soak``; ``SOAK_MINUTES=3 SOAK_ARGS='--plan quick' make soak`` for
the short run) is not part of the suite yet: on the code as it stands its short run still
fails two acceptance lines (an API RSS rise inside its window, and a 500 of the report page
after the faults), and a test that is known to fail does not belong in CI.

The soak starts its own redis-server, ``embgeom serve --redis-url`` and three workers
(MiniLM and a random 17 x 2048 model, one collection per setting), kills a worker, Redis,
the API and another worker, and then checks counts against the tokenizer and values
against the float64 reference (see the module docstring of benchmarks/soak.py).
"""

from __future__ import annotations

import pytest

from benchmarks import soak
from embgeom.compute.models import ModelRegistry
from embgeom.compute.positions import encode
from embgeom.corpora import bbc_texts
from embgeom.settings import Settings


@pytest.fixture(scope="module")
def registry():
    return ModelRegistry.from_settings(Settings())


@pytest.mark.parametrize("model", ["minilm", "smollm2"])
@pytest.mark.parametrize("settings", [{"preset": "paper"}, {"unit": "word"}, {},
                                      {"unit": "word", "include_special": True}])
@pytest.mark.parametrize("window", [16, 64, None])
def test_expected_count_is_the_services_count(registry, model, settings, window):
    """The soak's count from the tokenizer alone equals what the service's encoder counts,
    also where window boundaries add special tokens and split words (paragraphs of 50 to
    300 tokens in windows of 16 and 64). A window-blind count (one window per text) would
    differ at W=16 for the paper preset and the word unit: the test can fail."""
    tok = registry.tokenizer(model)
    texts = [p for p in bbc_texts("paragraphs") if 200 <= len(p) <= 1200][:30]
    W = window or registry.info(model).max_length
    rules = soak.collection_rules(settings)
    enc = encode(tok, texts, W, include_special=rules["include_special"], key=rules["key"],
                 unit=rules["unit"])
    assert soak.expected_count(tok, texts, rules, W) == enc.num_units
    if window == 16 and (rules["include_special"] or rules["unit"] == "word") and \
            tok.num_special_tokens_to_add() + (rules["unit"] == "word") > 0:
        assert soak.expected_count(tok, texts, rules, 10 ** 6) != enc.num_units


def test_rss_growth_plateau_and_leak():
    """A plateau with a model loaded and let go every five minutes passes; a steady 30 MB
    a minute over ten minutes fails (150 MB from the first half's top to the last
    quarter's, over a bound of 5% + 50 MB = 107.5 MB)."""
    flat = [(t, 1000.0 + (300.0 if 200 <= t % 300 < 260 else 0.0)) for t in range(0, 600, 3)]
    got = soak.rss_growth(flat, 0, 600)
    assert got["ok"] and got["limit_mb"] == pytest.approx(0.05 * 1300 + 50)
    leak = [(t, 1000.0 + t / 2) for t in range(0, 600, 3)]
    got = soak.rss_growth(leak, 0, 600)
    assert not got["ok"] and got["growth_mb"] > 100


def test_key_families():
    assert soak._family("eg:{c:m}:inflight") == ("c:m", "control:inflight")
    assert soak._family("eg:{c:m}:job:abc") == ("c:m", "control:job")
    assert soak._family("eg:{c:m:3:s12}:rec") == ("c:m", "shard:rec")
    assert soak._family("eg:{c:m:3:h}:seg") == ("c:m", "head:seg")
    assert soak._family("eg:{c:m:3:L2c0}:seg") == ("c:m", "chunk:seg")
    assert soak._family("eg:workers") is None
