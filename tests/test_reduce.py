"""The device side: :func:`embgeom.compute.reduce.reduce_batch` and the window accumulator
(:class:`embgeom.compute.window.WindowAccumulator`), against plain numpy two-pass float64
computations over the counted positions only (the reference calls nothing of embgeom).

Tolerances
----------
With ``precision="fp64"`` the reduction does float64 arithmetic on float32 inputs, as the
reference does with another summation order: each result is a sum of at most a few
hundred terms, so they differ by ~1e-14 of the scale of the summed quantities (||x||^2 for
m2 and co-moments, ||x|| for means, 1 for unit vectors). We allow 1e-10 of that scale.

With ``precision="fp32"`` (the default) sums run in float32 on batch-centred data: the
deviations from the batch centre are exact (Sterbenz), and their float32 sums carry
~sqrt(n) * 6e-8 of their own scale, i.e. of the *variance*, not of the mean. We allow
1e-5 of the variance-scale (sqrt(V) for means, n V for m2 and co-moments): two orders of
headroom over the worst case seen, and the adversarial test below (M / V ~ 1e8, where a
float32 raw-sum formula is O(1) wrong) pins that the centring is what makes it hold.

Counts and ids are integers and are compared exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embgeom.compute.reduce import PRECISIONS, reduce_batch
from embgeom.compute.window import WindowAccumulator

REL64 = 1e-10
REL32 = 1e-5


def ref_reduce(hidden, layers, keys, counted):
    """Numpy two-pass float64 moments over the counted positions only, token-major."""
    mask = counted.numpy()
    flat_keys = keys.numpy()[mask]
    ids = np.unique(flat_keys)
    n = np.array([(flat_keys == i).sum() for i in ids])
    L, d = len(layers), hidden[0].shape[-1]
    mean, m2, unit = np.zeros((len(ids), L, d)), np.zeros((len(ids), L)), np.zeros((len(ids), L, d))
    lay = {"mean": np.zeros((L, d)), "com": np.zeros((L, d, d)), "unit": np.zeros((L, d)),
           "unit_sq": np.zeros((L, d)), "within": np.zeros(L)}
    for li, layer in enumerate(layers):
        x = hidden[layer].numpy()[mask].astype(np.float64)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        for j, i in enumerate(ids):
            xi = x[flat_keys == i]
            mean[j, li] = xi.mean(0)
            m2[j, li] = ((xi - mean[j, li]) ** 2).sum()
            unit[j, li] = u[flat_keys == i].sum(0)
        mu = x.mean(0)
        lay["mean"][li], lay["com"][li] = mu, (x - mu).T @ (x - mu)
        lay["unit"][li], lay["unit_sq"][li] = u.sum(0), (u * u).sum(0)
        lay["within"][li] = m2[:, li].sum()
    return {"ids": ids, "n": n, "mean": mean, "m2": m2, "unit_sum": unit}, lay, int(mask.sum())


def random_batch(rng, rows=5, T=11, d=8, L=3, vocab=7, pad_value=np.nan, offset=0.0, spread=3.0):
    """Hidden states with right padding; padded positions hold garbage (NaN by default)."""
    lengths = rng.integers(1, T + 1, size=rows)
    lengths[0] = T
    hidden = []
    base = offset + rng.standard_normal((vocab, d)) * spread  # distinct token means
    keys = torch.from_numpy(rng.integers(0, vocab, size=(rows, T)))
    counted = torch.zeros((rows, T), dtype=torch.bool)
    for r, n in enumerate(lengths):
        counted[r, :n] = True
        counted[r, 0] = False  # a [CLS]-like position that does not count
    for _ in range(L):
        h = base[keys.numpy()] + rng.standard_normal((rows, T, d))
        h[~(np.arange(T)[None, :] < lengths[:, None])] = pad_value
        hidden.append(torch.from_numpy(h.astype(np.float32)))
    return hidden, keys, counted


def close(a, b, scale, rel):
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.max(np.abs(a - b)) if a.size else 0.0
    assert err <= rel * scale, (err, scale)
    return err


def scales(hidden, layers, counted):
    """(Q-scale: max ||x||^2, V-scale: max per-layer variance) of the counted points."""
    q = v = 0.0
    for layer in layers:
        x = hidden[layer].numpy()[counted.numpy()].astype(np.float64)
        q = max(q, float((x ** 2).sum(1).max()))
        v = max(v, float(((x - x.mean(0)) ** 2).sum(1).mean()))
    return q, v


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize("pad_value", [np.nan, 1e6, 0.0])
@pytest.mark.parametrize("seed", range(3))
def test_reduce_batch_matches_two_pass_and_ignores_padding(seed, pad_value, precision):
    rng = np.random.default_rng(seed)
    hidden, keys, counted = random_batch(rng, pad_value=pad_value)
    layers = [0, 2]  # a subset: the collection keeps these layers only
    tok, lay = reduce_batch(hidden, layers, keys, counted, precision=precision)
    ref_tok, ref_lay, N = ref_reduce(hidden, layers, keys, counted)
    q, v = scales(hidden, layers, counted)
    # m2 and co-moments are compared on the variance's scale, never on ||x||^2's (a
    # tolerance of n Q would pass an m2 of 0 whenever M >> V)
    rel, mean_scale, sq_scale = (REL64, np.sqrt(q), N * v) if precision == "fp64" \
        else (REL32, np.sqrt(v), N * v)
    np.testing.assert_array_equal(tok.ids.numpy(), ref_tok["ids"])
    np.testing.assert_array_equal(tok.n.numpy(), ref_tok["n"])
    assert lay.n == N == int(tok.n.sum())
    close(tok.mean, ref_tok["mean"], mean_scale, rel)
    close(tok.m2, ref_tok["m2"], sq_scale, rel)
    close(tok.unit_sum, ref_tok["unit_sum"], N, rel)
    close(lay.mean, ref_lay["mean"], mean_scale, rel)
    close(lay.comoment, ref_lay["com"], sq_scale, rel)
    close(lay.unit_sum, ref_lay["unit"], N, rel)
    close(lay.unit_sq_sum, ref_lay["unit_sq"], N, rel)
    for arr in (tok.mean, tok.m2, tok.unit_sum, lay.mean, lay.comoment):
        assert torch.isfinite(arr).all()  # NaN padding never leaked


@pytest.mark.parametrize("seed", range(5))
def test_fp32_reduction_on_centred_data_is_exact_where_raw_sums_are_not(seed):
    """M / V ~ 1e8 (an offset of 1e4 on every dimension, unit noise): the float32
    reduction stays within 1e-5 of V; the float32 raw-sum formula is off by O(1)."""
    rng = np.random.default_rng(seed)
    hidden, keys, counted = random_batch(rng, rows=8, T=40, d=16, L=1, vocab=3, offset=1e4,
                                         spread=0.5)
    tok, lay = reduce_batch(hidden, [0], keys, counted, precision="fp32")
    ref_tok, ref_lay, N = ref_reduce(hidden, [0], keys, counted)
    V_ref = ref_tok["m2"][:, 0] / ref_tok["n"]
    V = tok.m2[:, 0].numpy() / tok.n.numpy()
    x = hidden[0].numpy()[counted.numpy()]
    assert (x.astype(np.float64) ** 2).sum(1).mean() / V_ref.mean() > 1e6
    assert np.max(np.abs(V - V_ref) / V_ref) < 1e-5
    v_layer = np.trace(ref_lay["com"][0]) / N
    assert abs(np.trace(lay.comoment[0].numpy()) / N - v_layer) < 1e-5 * v_layer
    # the formula the centring avoids: sum ||x||^2 / n - ||mean||^2 in float32
    x32 = x.astype(np.float32)
    raw = np.mean(np.sum(x32 * x32, axis=1, dtype=np.float32)) - np.sum(x32.mean(0) ** 2)
    assert abs(raw - v_layer) / v_layer > 1e-3


def test_uncounted_positions_with_a_counted_key_do_not_contribute():
    # The same key both counted and not counted ([CLS] typed in the text vs added [CLS]):
    # only the counted occurrences contribute.
    d = 4
    h = torch.tensor([[[1.0] * d, [2.0] * d, [100.0] * d]])  # (1, 3, d)
    keys = torch.tensor([[5, 5, 5]])
    counted = torch.tensor([[True, True, False]])
    tok, lay = reduce_batch([h], [0], keys, counted)
    assert tok.ids.tolist() == [5] and tok.n.tolist() == [2]
    np.testing.assert_allclose(tok.mean[0, 0].numpy(), [1.5] * d)
    np.testing.assert_allclose(tok.m2[0].numpy(), [2 * d * 0.25])
    assert lay.n == 2


def test_nothing_counted_gives_empty_moments():
    h = torch.randn(2, 3, 4)
    tok, lay = reduce_batch([h, h], [0, 1], torch.zeros((2, 3), dtype=torch.long),
                            torch.zeros((2, 3), dtype=torch.bool))
    assert len(tok) == 0 and lay.n == 0
    assert tok.mean.shape == (0, 2, 4) and lay.mean.shape == (2, 4)


def test_self_similarity_off_keeps_no_unit_sums():
    rng = np.random.default_rng(0)
    hidden, keys, counted = random_batch(rng)
    tok, lay = reduce_batch(hidden, [1], keys, counted, self_similarity=False)
    assert tok.unit_sum is None
    assert lay.unit_sum.shape == (1, 8)  # the layer's mean cosine needs them: always kept


# ------------------------------------------------------------------------------ window


def window_of(hidden, layers, keys, counted, groups, capacity=2, precision="fp64", fused=True):
    """Reduce row groups separately (each trimmed to its own longest row) and merge them
    in a window (a tiny capacity exercises its growth). ``fused``: each batch's per-type
    sums and GEMM go straight into the window (the worker's path); else each batch's
    token moments and co-moment are returned and folded in."""
    acc = WindowAccumulator(len(layers), hidden[0].shape[-1], True, capacity=capacity,
                            shift_dtype=PRECISIONS[precision])
    for rows in groups:
        idx = torch.tensor(rows)
        width = int(counted[idx].sum(1).max()) + 1  # [CLS] + counted positions
        sub_h = [h[idx, :width] for h in hidden]
        acc.add(*reduce_batch(sub_h, layers, keys[idx, :width], counted[idx, :width],
                              precision=precision, comoment=acc.layers if fused else None,
                              tokens=acc if fused else None))
    return acc.export()


@pytest.mark.parametrize("fused", [True, False])
def test_window_does_not_depend_on_batch_composition(fused):
    rng = np.random.default_rng(7)
    hidden, keys, counted = random_batch(rng, rows=12, T=9, d=6, L=2, vocab=5)
    layers = [0, 1]
    ref_tok, ref_lay, N = ref_reduce(hidden, layers, keys, counted)
    q, v = scales(hidden, layers, counted)
    splits = [
        [list(range(12))],
        [[i] for i in range(12)],
        [[11, 3, 5], [0, 1], [2, 4, 6, 7, 8, 9, 10]],
        [list(range(0, 12, 2)), list(range(1, 12, 2))],
    ]
    for groups in splits:
        tok, lay = window_of(hidden, layers, keys, counted, groups, fused=fused)
        np.testing.assert_array_equal(tok.ids, ref_tok["ids"])  # sorted by key on export
        np.testing.assert_array_equal(tok.n, ref_tok["n"])
        assert lay.n == N
        close(tok.mean, ref_tok["mean"], np.sqrt(q), REL64)
        close(tok.m2, ref_tok["m2"], N * v, REL64)
        close(tok.unit_sum, ref_tok["unit_sum"], N, REL64)
        close(lay.mean, ref_lay["mean"], np.sqrt(q), REL64)
        close(lay.comoment, ref_lay["com"], N * v, REL64)
        close(lay.unit_sum, ref_lay["unit"], N, REL64)


def test_every_split_of_a_small_batch_agrees():
    # All 2-way splits of 5 rows: exhaustive over batch composition.
    rng = np.random.default_rng(3)
    hidden, keys, counted = random_batch(rng, rows=5, T=6, d=3, L=1, vocab=3)
    ref_tok, ref_lay, N = ref_reduce(hidden, [0], keys, counted)
    q, v = scales(hidden, [0], counted)
    for r in range(1, 5):
        for first in itertools.combinations(range(5), r):
            second = [i for i in range(5) if i not in first]
            tok, lay = window_of(hidden, [0], keys, counted, [list(first), second])
            np.testing.assert_array_equal(tok.n, ref_tok["n"])
            close(tok.m2, ref_tok["m2"], N * v, REL64)
            close(lay.comoment, ref_lay["com"], N * v, REL64)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 12), vocab=st.integers(1, 15),
       d=st.integers(1, 6), offset=st.sampled_from([0.0, -3.0, 100.0, 1e4]),
       parts=st.integers(1, 6), fused=st.booleans(), precision=st.sampled_from(["fp64", "fp32"]))
def test_window_equals_two_pass_for_any_split(seed, rows, vocab, d, offset, parts, fused, precision):
    """Random data (large common offsets included), random batches in random order,
    huge sparse keys (no vocabulary-sized state): counts exact, values two-pass."""
    rng = np.random.default_rng(seed)
    hidden, keys, counted = random_batch(rng, rows=rows, T=7, d=d, L=2, vocab=vocab,
                                         offset=offset)
    keys = keys * 2**40 + 12345  # sparse, far beyond any vocabulary
    perm = rng.permutation(rows)
    groups = [g.tolist() for g in np.array_split(perm, min(parts, rows)) if len(g)]
    anything = counted.sum() > 0
    tok, lay = window_of(hidden, [0, 1], keys, counted, groups, capacity=1, precision=precision,
                         fused=fused)
    if not anything:
        assert len(tok.ids) == 0 and lay.n == 0
        return
    ref_tok, ref_lay, N = ref_reduce(hidden, [0, 1], keys, counted)
    q, v = scales(hidden, [0, 1], counted)
    np.testing.assert_array_equal(tok.ids, ref_tok["ids"])
    np.testing.assert_array_equal(tok.n, ref_tok["n"])
    if precision == "fp64":
        close(tok.m2, ref_tok["m2"], N * max(v, 1e-300), 1e-8 if offset < 1e3 else 1e-6)
        close(tok.mean, ref_tok["mean"], np.sqrt(q), REL64)
        close(lay.comoment, ref_lay["com"], N * max(v, 1e-300), 1e-8 if offset < 1e3 else 1e-6)
    else:  # float32 sums on centred data: relative to the variance, not the mean
        close(tok.m2, ref_tok["m2"], N * max(v, 1e-300), REL32)
        close(tok.mean, ref_tok["mean"], np.sqrt(v), REL32)
        close(lay.comoment, ref_lay["com"], N * max(v, 1e-300), REL32)
    close(lay.mean, ref_lay["mean"], np.sqrt(v), REL32)


def test_fp32_comoment_keeps_dimensions_of_any_scale():
    """A dimension whose values are ~1e-32 (MiniLM's last layer has LayerNorm weights of
    that size) has a variance ~1e-64, below float32's range: the reduction scales each
    dimension by a power of two before its GEMM, so that variance and the dimension's
    correlations still come out to float32 precision of their own scale."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 200, 4))
    x[..., 1] *= 1e-32
    x[..., 2] = x[..., 2] * 1e20 + 3e20  # and a huge one
    x[..., 3] = 0.5 * x[..., 0] + 0.5 * rng.standard_normal((1, 200)) * 1e-30 / 1e-30
    h = torch.from_numpy(x.astype(np.float32))
    keys = torch.zeros((1, 200), dtype=torch.long)
    counted = torch.ones((1, 200), dtype=torch.bool)
    _, lay = reduce_batch([h], [0], keys, counted, precision="fp32")
    _, ref, N = ref_reduce([h], [0], keys, counted)
    C, R = lay.comoment[0].numpy(), ref["com"][0]
    np.testing.assert_allclose(np.diag(C), np.diag(R), rtol=1e-5)
    corr = C / np.sqrt(np.outer(np.diag(C), np.diag(C)))
    corr_ref = R / np.sqrt(np.outer(np.diag(R), np.diag(R)))
    np.testing.assert_allclose(corr, corr_ref, atol=1e-5)


SMOLLM2_LAYERS = (0, 1, 5, 15, 30)  # 15: massive activations (|x|^2 up to ~1e4 x the median)


def test_window_on_smollm2_hidden_states_matches_two_pass_float64():
    """Real hidden states of a pre-norm decoder, with its massive activations: SmolLM2 on
    BBC paragraphs, reduced in float32 into one window about per-type shifts (the
    worker's path, batches in reverse order), against a float64 two-pass over the very
    same hidden states (so only the reduction's error is measured).

    Tolerances: each type's m2 within 1e-5 of its own m2 (float32's 6e-8, times the
    shifted-data factor 1 + ||mean - r_t||^2 / V_t of a few, times the growth of a sum
    over a batch; measured at most 6e-7), its mean within 1e-6 of its own standard
    deviation (measured 9e-8); identical occurrences exactly (m2 = 0, mean = x)."""
    from embgeom.compute.engine import CountingRule, Engine
    from embgeom.compute.models import ModelPool, ModelRegistry
    from embgeom.corpora import bbc_texts
    from embgeom.settings import Settings

    loaded = ModelPool(ModelRegistry.from_settings(Settings()), device="cpu").get("smollm2")
    engine = Engine(loaded, CountingRule(layers=SMOLLM2_LAYERS), token_budget=2048)
    job = engine.prepare([p for p in bbc_texts("paragraphs") if 40 < len(p) < 300][:40])
    assert len(job.batches) >= 2
    batches = []
    with torch.inference_mode():
        for b in job.batches:
            h = loaded.hidden_states(b["input_ids"], b["attention"])
            batches.append(([t.float() for t in h], b["keys"], b["counted"]))
    acc = WindowAccumulator(len(SMOLLM2_LAYERS), loaded.info.hidden_size, True, capacity=64)
    for hidden, keys, counted in reversed(batches):
        acc.add(*reduce_batch(hidden, SMOLLM2_LAYERS, keys, counted, True, "fp32", acc.layers, acc))
    tok, _ = acc.export()

    flat_keys = np.concatenate([k[c].numpy() for _, k, c in batches])
    ids, inverse, n = np.unique(flat_keys, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(tok.ids, ids)
    np.testing.assert_array_equal(tok.n, n)
    for li, layer in enumerate(SMOLLM2_LAYERS):
        x = np.concatenate([h[layer][c].double().numpy() for h, _, c in batches])
        sums = np.zeros((len(ids), x.shape[1]))
        np.add.at(sums, inverse, x)
        mean = sums / n[:, None]
        m2 = np.zeros(len(ids))
        np.add.at(m2, inverse, ((x - mean[inverse]) ** 2).sum(1))
        if layer == 15:  # the data holds the high-norm states the bound is about
            q = (x ** 2).sum(1)
            assert q.max() > 1e3 * np.median(q), (q.max(), np.median(q))
        tight = m2 == 0  # a lone occurrence, or identical ones (the embedding layer)
        np.testing.assert_array_equal(tok.m2[tight, li], 0.0)
        np.testing.assert_array_equal(tok.mean[tight, li], mean[tight])
        spread = ~tight
        assert np.all(np.abs(tok.m2[spread, li] - m2[spread]) <= 1e-5 * m2[spread])
        sd = np.sqrt(m2[spread] / n[spread])
        err = np.linalg.norm(tok.mean[spread, li] - mean[spread], axis=1)
        assert np.all(err <= 1e-6 * sd), (layer, (err / sd).max())
