"""End to end: isotropy, outlier dimensions, self-similarity, IsoScore* samples and the 1-D
outlier probe, served over HTTP, against independent computations on raw hidden states.

Set-up (one module-scoped world): a fresh redis-server, the FastAPI app built by
``create_app`` against it (driven through ``TestClient``), and one in-process worker
(``WorkerThread``). 120 BBC paragraphs (every 97th, all topics; 10,105 counted tokens) are
ingested three times through ``POST /v1/jobs``:

- ``iso_a``: 4 jobs in corpus order;
- ``iso_c``: the very same 4 jobs, submitted in reverse order;
- ``iso_b``: the same texts shuffled and cut into 7 jobs of other sizes;

plus ``iso_tiny`` (2 sentences) for the IsoScore* reference-covariance convention.

The reference is ``embgeom.testing.reference.raw_hidden_states``: the model run one text at a time,
no padding, no windows, no batching, returning the float32 hidden states of every counted
position. Every reference statistic is a two-pass float64 numpy / sklearn / isoscore
computation over those raw states; none of it goes through the service's accumulators.

Tolerances (the measured maxima are printed at the end of the module with ``-s``)
--------------------------------------------------------------------------------
The service runs the model in padded batches of several windows; the reference runs each
text alone. The float32 forward passes then differ by kernel blocking only: measured
``max|dh| / max|h|`` is 0 at layer 0 (embedding lookup + LayerNorm, no GEMM across
positions) and grows to ~1.7e-6 at layer 6 (float32 eps 6e-8 amplified through 6
blocks). Aggregates over ~10^4 points move far less, since these perturbations are small
and nearly independent. Measured (service vs reference) and allowed:

- IsoScore vs ``IsoScore.IsoScore.IsoScore`` on all raw states: 4.4e-8, allowed 1e-4
  (the brief's bound; the package's own float32 sqrt(d) is ~1e-7 of noise).
- mean cosine: 1.5e-9, allowed 1e-5 absolute (the brief's bound).
- eigenvalues: max |d lam_i| = 3.9e-8 * lam_max, allowed 1e-5 * lam_max. By Weyl's
  inequality |d lam_i| <= ||dC||_2 ~ 2 x (state noise ~1e-6) x lam_max; a covariance
  divided by n - 1 instead of n (1e-4 relative at n = 10,105) or a dropped job fails it.
- effective rank, participation ratio, top eigenvalue ratio (<= 3e-8 measured), outlier
  variances / ratios / means (<= 9e-7): 1e-5 relative, same argument.
- rogue contributions CC_i: ~1e-8 (the unit-vector sums of each batch are float32 column
  sums, ~1e-7 relative), allowed 1e-7 absolute; the largest CC_i are ~0.02-0.1.
- job split invariance: the same jobs in another order, or cut into other jobs, land in
  other windows; each window's float32 reduction centres on its own first batch, so the
  sums differ by float32 rounding of the deviations (~sqrt(n) * 6e-8 of the spread), and
  other job sizes also change the batches, hence the states by the forward noise above.
  Measured up to ~1.5e-7 relative (mean cosine), allowed 1e-6 for both. An accumulator
  that kept raw float32 sums or lost one job would be off by orders of magnitude more.
- partition isotropy I(W), IsoScore* and the probe: see those tests.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from IsoScore import IsoScore as isopkg
from sklearn.decomposition import PCA
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from embgeom import corpora, diagnostics
from embgeom.store.server import RedisServer
from service.app import create_app
from tests.conftest import WorkerThread, wait_for_jobs
from tests.conftest import test_settings as make_settings
from embgeom.testing.reference import raw_hidden_states, token_stats

pytestmark = pytest.mark.slow

MODEL = "minilm"
NUM_LAYERS = 7  # hidden_states of MiniLM: embeddings + 6 blocks
D = 384

PARAGRAPHS = corpora.bbc_texts("paragraphs")
TEXTS = PARAGRAPHS[::97][:120]
SAMPLE_TEXTS = PARAGRAPHS[41::97][:12]  # disjoint from TEXTS (offset 41 of every 97)
# a tiny collection, where the ddof of the reference covariance C0 matters (n/(n-1) ~ 7%)
TINY_TEXTS = ["The central bank raised interest rates again on Thursday.",
              "Shares fell sharply in early trading in London."]
TINY_SAMPLE = ["Oil prices hit a record high.", "The minister resigned after the vote."]
SPLIT_A = [40, 25, 35, 20]
SPLIT_B = [10, 22, 15, 18, 20, 13, 22]

# Tolerances; see the module docstring.
TOL_ISOSCORE = 1e-4
TOL_MEAN_COSINE = 1e-5
TOL_SPECTRUM = 1e-5
TOL_ROGUE = 1e-7
TOL_SAME_BATCHES = 1e-6
TOL_OTHER_BATCHES = 1e-6

MEASURED: dict[str, float] = {}


def record(name: str, value: float) -> None:
    MEASURED[name] = max(MEASURED.get(name, 0.0), float(value))


def rel(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


# ------------------------------------------------------------------------------- the world


@dataclass
class RefLayer:
    X: np.ndarray          # (N, d) float64 raw states
    mean: np.ndarray
    cov: np.ndarray        # population covariance (ddof 0), two-pass
    lam: np.ndarray        # its eigenvalues, descending
    units: np.ndarray      # x / ||x||


@dataclass
class World:
    client: TestClient
    ids: np.ndarray
    states: list
    model: object
    tokenizer: object
    jobs: list
    _layers: dict = field(default_factory=dict)
    _tokens: dict = field(default_factory=dict)
    _sample: object = None

    def token_stats(self, l: int) -> dict:
        """Per token type, two-pass float64 (embgeom.testing.reference.token_stats): ids, n, means."""
        if l not in self._tokens:
            self._tokens[l] = token_stats(self.ids, self.states[l].astype(np.float64))
        return self._tokens[l]

    def layer(self, l: int) -> RefLayer:
        if l not in self._layers:
            X = self.states[l].astype(np.float64)
            mean = X.mean(axis=0)
            cov = np.cov(X.T, bias=True)
            lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
            units = X / np.linalg.norm(X, axis=1, keepdims=True)
            self._layers[l] = RefLayer(X, mean, cov, lam, units)
        return self._layers[l]

    def sample_states(self, layer: int) -> np.ndarray:
        """Raw float64 states of SAMPLE_TEXTS (one text at a time), cached."""
        if self._sample is None:
            self._sample = raw_hidden_states(self.model, self.tokenizer, SAMPLE_TEXTS)
        return self._sample.states[layer].astype(np.float64)

    def get(self, path: str, **params) -> dict:
        r = self.client.get(path, params=params)
        assert r.status_code == 200, (path, params, r.status_code, r.text)
        return r.json()


def layer_url(collection: str, l: int) -> str:
    return f"/v1/collections/{collection}/models/{MODEL}/layers/{l}"


def submit(client: TestClient, collection: str, chunks: list[list[str]]) -> list[str]:
    ids = []
    for chunk in chunks:
        r = client.post("/v1/jobs", json={"collection": collection, "model": MODEL, "texts": chunk})
        assert r.status_code == 202, r.text
        ids.append(r.json()["job_id"])
    return ids


def cut(texts: list[str], sizes: list[int]) -> list[list[str]]:
    assert sum(sizes) == len(texts)
    bounds = np.cumsum([0, *sizes])
    return [texts[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # The forward passes and numpy run with one thread: on a shared 2-core machine, two
    # OpenMP/OpenBLAS threads per pool spin against each other (measured: 30 short texts
    # took 33 s with 2 torch threads, 2.5 s with 1; the whole module went from 5.7 to
    # 1.3 minutes). Numerically this only changes float32 blocking inside the model.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    blas = threadpool_limits(limits=1)
    server = None
    started = time.monotonic()
    try:
        # The reference model is loaded before any service thread starts: transformers'
        # lazy imports are not thread safe (importing AutoModel here while the worker
        # thread imported its model classes raised "cannot import name 'AutoModel'").
        from transformers import AutoModel, AutoTokenizer

        from embgeom.sources import minilm_path

        path = str(minilm_path())
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        server = RedisServer(tmp_path_factory.mktemp("e2e_isotropy") / "redis").start()
        settings = make_settings(server.url)
        with TestClient(create_app(settings)) as client, WorkerThread(settings):
            # The API loads a model in the background (503 model_loading meanwhile): load first.
            client.app.state.runtime.sync_pool.get("minilm")
            chunks_a = cut(TEXTS, SPLIT_A)
            order = list(range(len(TEXTS)))
            random.Random(7).shuffle(order)
            chunks_b = cut([TEXTS[i] for i in order], SPLIT_B)
            jobs = {
                "iso_a": submit(client, "iso_a", chunks_a),
                "iso_c": submit(client, "iso_c", chunks_a[::-1]),
                "iso_b": submit(client, "iso_b", chunks_b),
                "iso_tiny": submit(client, "iso_tiny", [TINY_TEXTS]),
            }
            # The reference runs while the worker ingests.
            ref = raw_hidden_states(model, tokenizer, TEXTS)
            statuses = wait_for_jobs(client, [j for js in jobs.values() for j in js], timeout=900)
            assert all(s["status"] == "done" for s in statuses), statuses
            print(f"\n[e2e_isotropy] ingestion + reference: {time.monotonic() - started:.1f}s, "
                  f"{len(ref.ids)} counted tokens")
            yield World(client, ref.ids, ref.states, model, tokenizer, statuses)
    finally:
        if server is not None:
            server.kill()
        torch.set_num_threads(threads)
        blas.restore_original_limits()
        if MEASURED:
            print("\n[e2e_isotropy] measured maximum errors:")
            for k in sorted(MEASURED):
                print(f"  {k:62s} {MEASURED[k]:.3e}")


# ---------------------------------------------------------------------------- ingestion


def test_every_counted_token_is_ingested(world):
    n = len(world.ids)
    for c in ("iso_a", "iso_b", "iso_c"):
        iso = world.get(layer_url(c, 0) + "/isotropy", partition="false")
        assert iso["n"] == n, c
    # tokens reported by the jobs of collection a sum to the reference count
    assert sum(s["tokens"] for s in world.jobs[: len(SPLIT_A)]) == n


# ---------------------------------------------------------------- isotropy vs raw states


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_isotropy_matches_raw_states(world, layer):
    ref = world.layer(layer)
    iso = world.get(layer_url("iso_a", layer) + "/isotropy", spectrum="true", partition="false")
    assert iso["n"] == ref.X.shape[0]
    assert iso["transform"] == "none" and iso["unavailable"] == {}

    # IsoScore against the isoscore package on all raw states of the layer. Fed float64
    # (torch.cov of float32 input would add ~1e-6 of its own rounding to the reference).
    expected = float(isopkg.IsoScore(ref.X))
    record("isoscore vs package (abs)", abs(iso["isoscore"] - expected))
    assert iso["isoscore"] == pytest.approx(expected, abs=TOL_ISOSCORE)
    # the package on the float32 states as given agrees as well
    assert float(isopkg.IsoScore(world.states[layer])) == pytest.approx(expected, abs=1e-5)

    # mean cosine: the normalised-sum identity (||U||^2 - n) / (n (n - 1)), computed here
    # from the raw unit vectors in float64 (the all-pairs brute force is in the next test)
    n = ref.X.shape[0]
    U = ref.units.sum(axis=0)
    mc = (U @ U - n) / (n * (n - 1.0))
    record("mean_cosine vs float64 identity (abs)", abs(iso["mean_cosine"] - mc))
    assert iso["mean_cosine"] == pytest.approx(mc, abs=TOL_MEAN_COSINE)

    # spectrum and its summaries against numpy eigenvalues of np.cov(bias=True)
    lam_s = np.asarray(iso["eigenvalues"])
    assert lam_s.shape == (D,) and np.all(np.diff(lam_s) <= 0) and np.all(lam_s >= 0)
    err = np.max(np.abs(lam_s - ref.lam)) / ref.lam[0]
    record("eigenvalues (max |dlam| / lam_max)", err)
    assert err <= TOL_SPECTRUM
    lam = np.clip(ref.lam, 0, None)
    p = lam / lam.sum()
    p = p[p > 0]
    eff = float(np.exp(-(p * np.log(p)).sum()))
    pr = float(lam.sum() ** 2 / (lam**2).sum())
    top = float(lam[0] / lam.sum())
    for name, want in (("effective_rank", eff), ("participation_ratio", pr), ("top_eigenvalue_ratio", top)):
        record(f"{name} (rel)", rel(iso[name], want))
        assert iso[name] == pytest.approx(want, rel=TOL_SPECTRUM), name
    # without ?spectrum the eigenvalues are not sent
    assert world.get(layer_url("iso_a", layer) + "/isotropy", partition="false")["eigenvalues"] is None


def brute_force_mean_cosine(units: np.ndarray, block: int = 2048) -> float:
    """Mean of cos(x, y) over all ordered pairs of distinct occurrences, summing the Gram
    matrix block by block (upper blocks doubled, the diagonal entries removed)."""
    n = units.shape[0]
    total = 0.0
    for i in range(0, n, block):
        a = units[i : i + block]
        g = a @ a.T
        total += g.sum() - np.trace(g)
        for j in range(i + block, n, block):
            total += 2.0 * (a @ units[j : j + block].T).sum()
    return total / (n * (n - 1.0))


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_mean_cosine_brute_force_over_all_pairs(world, layer):
    """All ~5.1e7 unordered pairs of the ~10.1k embeddings, float64 (<1 s of GEMM each)."""
    ref = world.layer(layer)
    expected = brute_force_mean_cosine(ref.units)
    iso = world.get(layer_url("iso_a", layer) + "/isotropy", partition="false")
    record("mean_cosine vs all-pairs brute force (abs)", abs(iso["mean_cosine"] - expected))
    assert iso["mean_cosine"] == pytest.approx(expected, abs=TOL_MEAN_COSINE)


# ------------------------------------------------------------------------------ outliers


def reference_outliers(variances: np.ndarray, threshold: float) -> set[int]:
    return set(np.flatnonzero(variances >= threshold * variances.mean()).tolist())


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_outlier_and_rogue_dimensions_match_raw_states(world, layer):
    ref = world.layer(layer)
    # two-pass per-dimension population variance
    var = ((ref.X - ref.mean) ** 2).mean(axis=0)
    ratio = var / var.mean()
    for threshold in (5.0, 2.0):
        out = world.get(layer_url("iso_a", layer) + "/outliers", threshold=threshold, top=D)
        got = {d["dim"] for d in out["dimensions"]}
        want = reference_outliers(var, threshold)
        # the sets are only well defined if no ratio sits on the threshold within noise
        margin = float(np.min(np.abs(ratio - threshold)) / threshold)
        assert margin > 1e-4, f"a dimension sits on the threshold (margin {margin:.2e})"
        assert got == want, (threshold, sorted(got ^ want))
        ratios = [d["ratio"] for d in out["dimensions"]]
        assert ratios == sorted(ratios, reverse=True)
        for d in out["dimensions"]:
            i = d["dim"]
            record("outlier variance/ratio/mean (rel)",
                   max(rel(d["variance"], var[i]), rel(d["ratio"], ratio[i]), rel(d["mean"], ref.mean[i])))
            assert d["variance"] == pytest.approx(var[i], rel=TOL_SPECTRUM)
            assert d["ratio"] == pytest.approx(ratio[i], rel=TOL_SPECTRUM)
            assert d["mean"] == pytest.approx(ref.mean[i], rel=TOL_SPECTRUM, abs=1e-6)

    # rogue dimensions: CC_i = mean over ordered distinct pairs of u_i v_i
    #   = ((sum u_i)^2 - sum u_i^2) / (n (n - 1)), from the raw unit vectors in float64
    n = ref.X.shape[0]
    cc = (ref.units.sum(0) ** 2 - (ref.units**2).sum(0)) / (n * (n - 1.0))
    rogue = out["rogue"]
    assert len(rogue) == D
    got_cc = np.zeros(D)
    for r in rogue:
        got_cc[r["dim"]] = r["contribution"]
    assert sorted(r["dim"] for r in rogue) == list(range(D))
    record("rogue CC_i (abs)", np.max(np.abs(got_cc - cc)))
    np.testing.assert_allclose(got_cc, cc, rtol=0, atol=TOL_ROGUE)
    contributions = [r["contribution"] for r in rogue]
    assert contributions == sorted(contributions, reverse=True)
    # the contributions add up to the mean cosine, and share = CC_i / mean cosine
    assert out["mean_cosine"] == pytest.approx(cc.sum(), abs=TOL_MEAN_COSINE)
    for r in rogue[:5]:
        assert r["share"] == pytest.approx(r["contribution"] / out["mean_cosine"], rel=1e-12)
    # ?top= truncates to the leading dimensions of the same ranking
    top3 = world.get(layer_url("iso_a", layer) + "/outliers", top=3)["rogue"]
    assert [r["dim"] for r in top3] == [r["dim"] for r in rogue[:3]]


def test_model_outliers_consistent_with_layers(world):
    for threshold in (5.0, 2.0):
        model = world.get(f"/v1/collections/iso_a/models/{MODEL}/outliers", threshold=threshold)
        assert [row["layer"] for row in model["layers"]] == list(range(NUM_LAYERS))
        where: dict[int, list[int]] = {}
        for row in model["layers"]:
            per_layer = world.get(layer_url("iso_a", row["layer"]) + "/outliers", threshold=threshold)
            assert row["dimensions"] == per_layer["dimensions"]
            assert row["n"] == per_layer["n"] == len(world.ids)
            ref = world.layer(row["layer"])
            var = ((ref.X - ref.mean) ** 2).mean(axis=0)
            assert {d["dim"] for d in row["dimensions"]} == reference_outliers(var, threshold)
            for d in row["dimensions"]:
                where.setdefault(d["dim"], []).append(row["layer"])
        persistent = model["persistent"]
        assert {p["dim"]: p["layers"] for p in persistent} == where
        assert all(p["num_layers"] == len(p["layers"]) for p in persistent)
        keys = [(-p["num_layers"], p["dim"]) for p in persistent]
        assert keys == sorted(keys)
    # standardised dimensions all have variance 1: nothing is an outlier anywhere
    std = world.get(f"/v1/collections/iso_a/models/{MODEL}/outliers", transform="standardize")
    assert std["persistent"] == [] and all(row["dimensions"] == [] for row in std["layers"])


# ----------------------------------------------------------------------------- transforms


def transformed_points(X: np.ndarray, spec: str) -> tuple[np.ndarray, object]:
    """The transform applied explicitly to the raw points with sklearn."""
    if spec == "standardize":
        scaler = StandardScaler().fit(X)  # population std, as the service's correlation matrix
        return scaler.transform(X), scaler.transform
    assert spec == "abtt:3"
    # covariance_eigh: eigenvectors of the d x d covariance (the full SVD of the
    # 10k x 384 matrix takes 10 s here and gives the same components)
    pca = PCA(n_components=3, svd_solver="covariance_eigh").fit(X)

    def apply(P):
        centred = P - pca.mean_
        return centred - (centred @ pca.components_.T) @ pca.components_

    return apply(X), apply


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
@pytest.mark.parametrize("spec", ["standardize", "abtt:3"])
def test_transformed_isotropy_matches_explicit_transform(world, layer, spec):
    ref = world.layer(layer)
    Xt, apply = transformed_points(ref.X, spec)
    iso = world.get(layer_url("iso_a", layer) + "/isotropy", transform=spec, spectrum="true")
    expected = float(isopkg.IsoScore(Xt))
    record(f"isoscore {spec} vs package on transformed points (abs)", abs(iso["isoscore"] - expected))
    assert iso["isoscore"] == pytest.approx(expected, abs=TOL_ISOSCORE)
    assert iso["transform"] == spec
    # the cosine of transformed points is not a function of the streamed moments
    assert iso["mean_cosine"] is None and "mean_cosine" in iso["unavailable"]
    lam_t = np.sort(np.linalg.eigvalsh(np.cov(Xt.T, bias=True)))[::-1]
    lam_s = np.asarray(iso["eigenvalues"])
    record(f"eigenvalues {spec} (max |dlam| / lam_max)", np.max(np.abs(lam_s - lam_t)) / lam_t[0])
    assert np.max(np.abs(lam_s - lam_t)) <= TOL_SPECTRUM * lam_t[0]
    if spec == "abtt:3":
        assert np.all(lam_s[-3:] <= 1e-9 * lam_s[0])  # three directions removed
    # partition isotropy of the transformed per-token means
    t = world.token_stats(layer)
    want = brute_partition_isotropy(apply(t["means"]))
    record(f"partition_isotropy {spec} (rel)", rel(iso["partition_isotropy"], want))
    assert iso["partition_isotropy"] == pytest.approx(want, rel=1e-4)
    # outliers under the transform: no rogue (cosine) figures
    out = world.get(layer_url("iso_a", layer) + "/outliers", transform=spec, threshold=2.0)
    assert out["rogue"] is None and "rogue" in out["unavailable"]
    var_t = Xt.var(axis=0)
    if spec == "standardize":
        assert out["dimensions"] == []
    else:
        assert {d["dim"] for d in out["dimensions"]} == reference_outliers(var_t, 2.0)


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_standardize_gives_every_varying_dimension_unit_variance(world, layer):
    """Per-dimension z-scoring gives unit variance to every dimension that varies.

    "Varies" is judged against the dimension's own scale: var_i > 1e-16 * (var_i +
    mean_i^2). A constant coordinate streamed through float64 Chan merges keeps a residue
    of ~eps^2 * mean_i^2 (var/Q ~ 1e-32), which this excludes; sklearn's StandardScaler
    likewise scales every dimension whose variance is not ~0 relative to its mean.

    Pins a bug at layer 6 of MiniLM: the final LayerNorm has pruned dimensions 127 and 223
    (gamma ~ -6e-33, -5e-33; values ~1e-32 with a coefficient of variation of 18 and 6.6)
    and 319 (gamma -1.5e-9, std 6.7e-9, mean -1e-7). ``diagnostics.transform_covariance``
    (and ``transform_points``) zero every dimension with var_i <= 1e-12 * max_j var_j, a
    threshold on the scale of the *largest* dimension, so these three get a zero row and
    column instead of unit variance: the standardised IsoScore of layer 6 is 0.41504
    where StandardScaler + the isoscore package give 0.40843.
    """
    ref = world.layer(layer)
    var = ref.X.var(axis=0)
    varying = set(np.flatnonzero(var > 1e-16 * (var + ref.mean**2)).tolist())
    # every dimension with variance >= 1e-6 x the mean variance (~1 after z-scoring)
    out = world.get(layer_url("iso_a", layer) + "/outliers", transform="standardize",
                    threshold=1e-6, top=1)
    unit = {d["dim"] for d in out["dimensions"] if abs(d["variance"] - 1.0) <= 1e-9}
    assert unit == varying, f"varying dimensions without unit variance: {sorted(varying - unit)}"


@pytest.mark.parametrize("spec", ["foo", "abtt", "abtt:", "abtt:-1", "abtt:2.5", "abtt:x",
                                  "abtt:384", "abtt:1000", "standardise", "pca:3", ""])
def test_bad_transform_specs_are_422(world, spec):
    for path in (layer_url("iso_a", 2) + "/isotropy", layer_url("iso_a", 2) + "/outliers",
                 f"/v1/collections/iso_a/models/{MODEL}/outliers"):
        r = world.client.get(path, params={"transform": spec})
        assert r.status_code == 422, (path, spec, r.status_code, r.text)
        assert r.json()["type"] == "invalid_transform", (path, spec, r.json())


def test_identity_transforms(world):
    """"abtt:0" removes nothing and " Standardize " is the same spec as "standardize"."""
    base = world.get(layer_url("iso_a", 5) + "/isotropy", spectrum="true")
    zero = world.get(layer_url("iso_a", 5) + "/isotropy", transform="abtt:0", spectrum="true")
    for f in ("isoscore", "effective_rank", "participation_ratio", "top_eigenvalue_ratio", "eigenvalues"):
        assert zero[f] == base[f], f
    std = world.get(layer_url("iso_a", 5) + "/isotropy", transform="standardize")
    spaced = world.get(layer_url("iso_a", 5) + "/isotropy", transform=" Standardize ")
    assert spaced["isoscore"] == std["isoscore"]


def test_bad_isotropy_parameters_are_422(world):
    base = layer_url("iso_a", 1)
    for path, params in ((base + "/isotropy", {"min_count": 0}),
                         (base + "/outliers", {"threshold": 0}),
                         (base + "/outliers", {"threshold": -1}),
                         (base + "/outliers", {"top": 0})):
        r = world.client.get(path, params=params)
        assert r.status_code == 422, (path, params, r.text)
    r = world.client.get(layer_url("iso_a", NUM_LAYERS) + "/isotropy")
    assert r.status_code == 404 and r.json()["type"] == "layer_not_found"


# ------------------------------------------------------------------ job split invariance


SPLIT_FIELDS = ("isoscore", "mean_cosine", "effective_rank", "participation_ratio",
                "top_eigenvalue_ratio", "partition_isotropy")


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_isotropy_does_not_depend_on_how_texts_were_split_into_jobs(world, layer):
    a = world.get(layer_url("iso_a", layer) + "/isotropy", spectrum="true")
    for other, tol, label in (("iso_c", TOL_SAME_BATCHES, "same jobs, reverse order"),
                              ("iso_b", TOL_OTHER_BATCHES, "7 shuffled jobs")):
        b = world.get(layer_url(other, layer) + "/isotropy", spectrum="true")
        assert b["n"] == a["n"] and b["partition_types"] == a["partition_types"]
        for f in SPLIT_FIELDS:
            record(f"split invariance, {label} (rel)", rel(b[f], a[f]))
            assert b[f] == pytest.approx(a[f], rel=tol), (other, f)
        la, lb = np.asarray(a["eigenvalues"]), np.asarray(b["eigenvalues"])
        record(f"split invariance, {label}, eigenvalues (/lam_max)", np.max(np.abs(la - lb)) / la[0])
        assert np.max(np.abs(la - lb)) <= tol * la[0], other
        oa = world.get(layer_url("iso_a", layer) + "/outliers", threshold=2.0)
        ob = world.get(layer_url(other, layer) + "/outliers", threshold=2.0)
        assert [d["dim"] for d in oa["dimensions"]] == [d["dim"] for d in ob["dimensions"]]


# ------------------------------------------------------------------- per-token geometry


def brute_self_similarity(X: np.ndarray) -> float:
    u = X / np.linalg.norm(X, axis=1, keepdims=True)
    g = u @ u.T
    n = len(u)
    return float((g.sum() - np.trace(g)) / (n * (n - 1)))


@pytest.mark.parametrize("layer", [0, 3, 6])
def test_token_self_similarity_is_the_pairwise_mean_cosine(world, layer):
    ids = world.ids
    types, counts = np.unique(ids, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    frequent = types[order[:4]].tolist()
    rare = [int(types[np.flatnonzero(counts == 2)[0]]), int(types[np.flatnonzero(counts == 3)[0]])]
    X = world.states[layer].astype(np.float64)
    for tid in frequent + rare:
        occ = X[ids == tid]
        tok = world.get(layer_url("iso_a", layer) + f"/tokens/{tid}")
        assert tok["n"] == len(occ)
        want = brute_self_similarity(occ)
        record("token self_similarity (abs)", abs(tok["self_similarity"] - want))
        assert tok["self_similarity"] == pytest.approx(want, abs=TOL_MEAN_COSINE), tid
        mu = occ.mean(0)
        assert tok["M"] == pytest.approx(mu @ mu, rel=TOL_SPECTRUM)
        assert tok["V"] == pytest.approx(((occ - mu) ** 2).sum(1).mean(), rel=TOL_SPECTRUM)
    # the token list reports the same self-similarity as the detail endpoint
    page = world.get(layer_url("iso_a", layer) + "/tokens", order_by="n", desc="true", limit=4)
    assert [t["token_id"] for t in page["tokens"]] == frequent
    for t in page["tokens"]:
        detail = world.get(layer_url("iso_a", layer) + f"/tokens/{t['token_id']}")
        assert t["self_similarity"] == detail["self_similarity"]
    single = int(types[np.flatnonzero(counts == 1)[0]])
    tok = world.get(layer_url("iso_a", layer) + f"/tokens/{single}")
    assert tok["n"] == 1 and tok["self_similarity"] is None


def brute_partition_isotropy(W: np.ndarray) -> float:
    """I(W) = min_c Z(c) / max_c Z(c), Z(c) = sum_w exp(c . w), over the eigenvectors c of
    W^T W and their opposites (Mu & Viswanath 2018), with scipy's logsumexp: written here,
    independently of embgeom.diagnostics."""
    from scipy.special import logsumexp

    _, vecs = np.linalg.eigh(W.T @ W)
    dots = W @ np.hstack([vecs, -vecs])              # (words, 2 d)
    log_z = logsumexp(dots, axis=0)
    return float(np.exp(log_z.min() - log_z.max()))


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_partition_isotropy_of_per_token_means(world, layer):
    """I(W) of Mu & Viswanath on the per-token means, vs a direct computation (below, not
    the service's function) on means computed two-pass from the raw states. I(W) is
    exp(log Z_min - log Z_max)
    over the eigenvectors of W^T W; state noise ~1e-6 moves log Z by ~1e-6 * ||w||, so a
    relative tolerance of 1e-4 on I(W) is ample (measured value printed)."""
    t = world.token_stats(layer)
    for min_count in (1, 3):
        keep = t["n"] >= min_count
        want = brute_partition_isotropy(t["means"][keep])
        iso = world.get(layer_url("iso_a", layer) + "/isotropy", min_count=min_count)
        assert iso["partition_types"] == int(keep.sum())
        record("partition_isotropy (rel)", rel(iso["partition_isotropy"], want))
        assert iso["partition_isotropy"] == pytest.approx(want, rel=1e-4)
    assert world.get(layer_url("iso_a", layer) + "/isotropy", partition="false")["partition_isotropy"] is None
    # a count filter that keeps no type leaves I(W) undefined, the rest unchanged
    none_kept = world.get(layer_url("iso_a", layer) + "/isotropy", min_count=10**6)
    assert none_kept["partition_isotropy"] is None and none_kept["isoscore"] == iso["isoscore"]


# ---------------------------------------------------------------------- IsoScore* sample


TOL_SAMPLE = 1e-6  # see test_isotropy_sample_matches_isoscore_star


def post_sample(world, collection: str, layer: int, **body) -> dict:
    r = world.client.post(layer_url(collection, layer) + "/isotropy/sample", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def package_star(P: np.ndarray, C0: np.ndarray, zeta: float) -> float:
    return float(isopkg.IsoScore_star(P, torch.tensor(C0, dtype=torch.float64), zeta))


@pytest.mark.parametrize("layer", [0, 3, 6])
def test_isotropy_sample_matches_isoscore_star(world, layer):
    """IsoScore / IsoScore* of a 12-paragraph sample (~900 points) vs the isoscore package
    on the sample's raw states (embgeom.testing.reference.raw_hidden_states, float64).

    The API runs the sample batched, the reference one text at a time: the points differ
    by the forward noise (~1e-6 relative) and IsoScore* is a smooth function of the shrunk
    covariance; measured errors are ~5e-8, we allow 1e-6 (20x). That is tight enough to
    tell C0 conventions apart on this collection (ddof=0 vs ddof=1 moves IsoScore* by up
    to ~5e-6), see also the tiny-collection test below.

    Convention: the package's IsoScore_star computes the sample covariance itself with
    ddof=1 (torch.cov) and uses C0 as given. The service passes C0 = co-moment / n, the
    population (ddof=0) covariance of the collection (service/routes/diagnostics.py), so
    the reference C0 is np.cov(raw states, bias=True)."""
    P = world.sample_states(layer)
    zeta = 0.25
    body = post_sample(world, "iso_a", layer, texts=SAMPLE_TEXTS, zeta=zeta, reference="identity")
    assert body["n_points"] == P.shape[0] and body["reference"] == "identity" and body["zeta"] == zeta
    want = package_star(P, np.eye(D), zeta)
    record("isoscore_star identity (abs)", abs(body["isoscore_star"] - want))
    assert body["isoscore_star"] == pytest.approx(want, abs=TOL_SAMPLE)
    plain = float(isopkg.IsoScore(P))
    record("sample isoscore (abs)", abs(body["isoscore"] - plain))
    assert body["isoscore"] == pytest.approx(plain, abs=TOL_SAMPLE)

    ref = world.layer(layer)
    body = post_sample(world, "iso_a", layer, texts=SAMPLE_TEXTS, zeta=zeta, reference="collection")
    assert body["reference"] == "collection"
    want = package_star(P, ref.cov, zeta)
    record("isoscore_star collection, C0 ddof=0 (abs)", abs(body["isoscore_star"] - want))
    n = ref.X.shape[0]
    record("isoscore_star: |C0 ddof=0 - C0 ddof=1| on iso_a (info)",
           abs(want - package_star(P, ref.cov * n / (n - 1), zeta)))
    assert body["isoscore_star"] == pytest.approx(want, abs=TOL_SAMPLE)
    # the shrinkage toward the collection moved the score away from the sample's IsoScore
    assert abs(body["isoscore_star"] - body["isoscore"]) > 1e-3
    # zeta = 0 is plain IsoScore of the sample; zeta = 1 is IsoScore of C0 alone
    body0 = post_sample(world, "iso_a", layer, texts=SAMPLE_TEXTS, zeta=0.0, reference="collection")
    assert body0["isoscore_star"] == pytest.approx(plain, abs=TOL_SAMPLE)
    body1 = post_sample(world, "iso_a", layer, texts=SAMPLE_TEXTS, zeta=1.0, reference="collection")
    assert body1["isoscore_star"] == pytest.approx(float(isopkg.IsoScore(ref.X)), abs=TOL_SAMPLE)


def test_isotropy_sample_collection_reference_is_the_population_covariance(world):
    """On a 2-text collection (~18 points) ddof matters: C0 with ddof=1 is 1/(n-1) ~ 6%
    larger than with ddof=0, which moves IsoScore* by far more than the noise. The
    service must use its documented C0 = co-moment / n (ddof=0); the sample's own
    covariance keeps the package's ddof=1. Also checks include_special: the sample then
    counts [CLS]/[SEP] too."""
    layer, zeta = 4, 0.5
    C = raw_hidden_states(world.model, world.tokenizer, TINY_TEXTS).states[layer].astype(np.float64)
    P = raw_hidden_states(world.model, world.tokenizer, TINY_SAMPLE).states[layer].astype(np.float64)
    body = post_sample(world, "iso_tiny", layer, texts=TINY_SAMPLE, zeta=zeta, reference="collection")
    assert body["n_points"] == P.shape[0]
    want = package_star(P, np.cov(C.T, bias=True), zeta)
    other = package_star(P, np.cov(C.T, ddof=1), zeta)
    record("isoscore_star tiny collection, C0 ddof=0 (abs)", abs(body["isoscore_star"] - want))
    record("isoscore_star: |C0 ddof=0 - C0 ddof=1| on iso_tiny (info)", abs(want - other))
    assert abs(want - other) > 20 * TOL_SAMPLE  # the check below can tell them apart
    assert body["isoscore_star"] == pytest.approx(want, abs=TOL_SAMPLE)

    Ps = raw_hidden_states(world.model, world.tokenizer, TINY_SAMPLE, include_special=True)
    Ps = Ps.states[layer].astype(np.float64)
    body = post_sample(world, "iso_tiny", layer, texts=TINY_SAMPLE, zeta=zeta, reference="identity",
                       include_special=True)
    assert body["n_points"] == Ps.shape[0] == P.shape[0] + 2 * len(TINY_SAMPLE)
    assert body["isoscore_star"] == pytest.approx(package_star(Ps, np.eye(D), zeta), abs=TOL_SAMPLE)


def test_isotropy_sample_bad_inputs(world):
    url = layer_url("iso_a", 1) + "/isotropy/sample"
    r = world.client.post(url, json={"texts": ["a b c"], "zeta": 1.5})
    assert r.status_code == 422
    r = world.client.post(url, json={"texts": ["a b c"], "reference": "nope"})
    assert r.status_code == 422
    r = world.client.post(url, json={"texts": ["hello"], "reference": "identity"})
    assert r.status_code == 422 and r.json()["type"] == "sample_too_small"
    r = world.client.post(layer_url("no_such_collection", 1) + "/isotropy/sample",
                          json={"texts": ["a b c"]})
    assert r.status_code == 404


# ------------------------------------------------------------------ outlier-dimension probe


def probe_articles(tokenizer) -> tuple[list[str], list[str]]:
    """40 sport and 40 business articles: per topic the 38 shortest plus 2 of more than
    510 content tokens (they are cut into two windows, as the service must do)."""
    texts, labels = [], []
    for topic in ("sports", "business"):
        arts = [t for _, t in corpora.bbc_articles([topic])]
        lengths = np.array([len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in arts])
        order = np.argsort(lengths, kind="stable")
        long_ = [i for i in order if 520 <= lengths[i] <= 700][:2]
        chosen = [int(i) for i in order[:38]] + [int(i) for i in long_]
        assert len(chosen) == 40 and len(long_) == 2
        texts += [arts[i] for i in chosen]
        labels += [topic] * len(chosen)
    return texts, labels


def mean_pooled_reference(model, tokenizer, texts, layer: int, window: int = 510) -> np.ndarray:
    """Mean of the counted (non-special) states of each text; a text longer than the
    model's 512 positions is cut into consecutive windows of 510 content tokens, each run
    on its own between [CLS] and [SEP]. One window per forward, no padding."""
    out = np.zeros((len(texts), D))
    with torch.inference_mode():
        for t, text in enumerate(texts):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            total, count = np.zeros(D), 0
            for s in range(0, len(ids), window):
                chunk = [tokenizer.cls_token_id, *ids[s : s + window], tokenizer.sep_token_id]
                h = model(input_ids=torch.tensor([chunk]), output_hidden_states=True).hidden_states[layer]
                total += h[0, 1:-1].double().numpy().sum(0)
                count += len(chunk) - 2
            out[t] = total / count
    return out


def brute_threshold(train_x, train_y, test_x, test_y):
    """The documented rule, searched by brute force: candidates are the midpoints of the
    sorted distinct training values plus the adjacent floats outside them, each with both
    directions; the first best in the order (+1 then -1, increasing threshold) wins."""
    v = np.unique(train_x)
    cands = [np.nextafter(v[0], -np.inf), *[(a / 2 + b / 2) for a, b in zip(v[:-1], v[1:])],
             np.nextafter(v[-1], np.inf)]
    best = None
    for direction in (1, -1):
        for thr in cands:
            acc = np.mean((direction * (train_x - thr) > 0) == (train_y == 1))
            if best is None or acc > best[0]:
                best = (acc, thr, direction)
    acc, thr, direction = best
    return thr, direction, acc, float(np.mean((direction * (test_x - thr) > 0) == (test_y == 1)))


def run_probe_and_check(world, texts, labels, X, layer, pooling, top_k, seed, frac) -> dict:
    """POST the probe and check it against pooled reference features ``X``.

    Features differ from the service's by the forward noise: measured <= 1.1e-7 relative
    on the variances with mean pooling (noise averaged over a text), up to 7.4e-6 with
    cls/last pooling (one position, 18 training points), 1.1e-7 absolute on thresholds.
    Variances are compared at 1e-4 relative, thresholds at 1e-5 absolute (features are
    O(0.1)); a wrong pooling, window or split moves them by O(1). Accuracies are
    counts over the same split, so they must be equal exactly: a flipped comparison would
    need a training value within ~1e-7 of a midpoint, which the assertions would reveal.
    """
    r = world.client.post("/v1/probes/outlier-dimension", json={
        "model": MODEL, "layer": layer, "texts": texts, "labels": labels, "pooling": pooling,
        "test_fraction": frac, "seed": seed, "top_k": top_k})
    assert r.status_code == 200, r.text
    res = r.json()
    for key in ("model", "layer", "pooling", "labels", "n_train", "n_test", "top_k", "dimensions",
                "best_dimension", "logistic_regression", "majority_baseline"):
        assert key in res, key
    classes = sorted(set(labels))
    assert res["labels"] == [str(c) for c in classes] and res["pooling"] == pooling and res["model"] == MODEL
    assert res["layer"] == layer and res["top_k"] == top_k and len(res["dimensions"]) == top_k

    y = np.array([classes.index(lab) for lab in labels])
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=frac, random_state=seed, stratify=y)
    assert (res["n_train"], res["n_test"]) == (len(y_tr), len(y_te))
    var = X_tr.var(axis=0)
    top = np.argsort(-var, kind="stable")[:top_k]
    assert [d["dim"] for d in res["dimensions"]] == top.tolist()
    for d in res["dimensions"]:
        i = d["dim"]
        thr, direction, train_acc, test_acc = brute_threshold(X_tr[:, i], y_tr, X_te[:, i], y_te)
        record("probe variance (rel)", rel(d["variance"], var[i]))
        assert d["variance"] == pytest.approx(var[i], rel=1e-4)
        assert d["variance_ratio"] == pytest.approx(var[i] / var.mean(), rel=1e-4)
        assert d["direction"] == direction, i
        assert d["train_accuracy"] == train_acc, i
        assert d["test_accuracy"] == test_acc, i
        record("probe threshold (abs)", abs(d["threshold"] - thr))
        assert d["threshold"] == pytest.approx(thr, abs=1e-5)
    best = max(res["dimensions"], key=lambda d: (d["train_accuracy"], -d["dim"]))
    assert res["best_dimension"] == best
    majority = int(np.bincount(y_tr).argmax())
    assert res["majority_baseline"]["test_accuracy"] == pytest.approx(np.mean(y_te == majority))
    return res


def test_outlier_dimension_probe_matches_recomputation(world):
    """Sport vs business, 80 articles, mean pooling at the last layer (runs synchronously)."""
    texts, labels = probe_articles(world.tokenizer)
    layer = 6
    X = mean_pooled_reference(world.model, world.tokenizer, texts, layer)
    res = run_probe_and_check(world, texts, labels, X, layer, "mean", top_k=8, seed=3, frac=0.3)
    # topic is linearly decodable from mean-pooled sentence-transformer states
    assert res["logistic_regression"]["test_accuracy"] > res["majority_baseline"]["test_accuracy"]


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_outlier_probe_cls_and_last_pooling(world, pooling):
    """On 24 short paragraphs: ``cls`` is the state at position 0 ([CLS]), ``last`` the
    state at the last position ([SEP]) of each text, taken from a one-text forward."""
    sport = corpora.bbc_texts("paragraphs", topics=["sports"])[5::61][:12]
    business = corpora.bbc_texts("paragraphs", topics=["business"])[5::61][:12]
    texts, labels = sport + business, [1] * 12 + [0] * 12  # integer labels this time
    layer = 3
    X = np.zeros((len(texts), D))
    with torch.inference_mode():
        for t, text in enumerate(texts):
            enc = world.tokenizer(text, return_tensors="pt")
            h = world.model(**enc, output_hidden_states=True).hidden_states[layer][0]
            X[t] = (h[0] if pooling == "cls" else h[-1]).double().numpy()
    res = run_probe_and_check(world, texts, labels, X, layer, pooling, top_k=5, seed=1, frac=0.25)
    assert res["labels"] == ["0", "1"]


def test_outlier_probe_rejects_invalid_inputs(world):
    texts = ["one text here", "another text", "a third one", "and a fourth", "fifth", "sixth"]
    base = {"model": MODEL, "layer": 1, "texts": texts}
    cases = [
        ({**base, "labels": ["a", "b", "c", "a", "b", "c"]}, "invalid_labels"),   # 3 values
        ({**base, "labels": ["a", "b", "a", "b", "a"]}, "invalid_labels"),        # 5 labels, 6 texts
        ({**base, "labels": ["a", "b", "a", "b", "a", "a"], "pooling": "max"}, None),
        ({**base, "labels": ["a", "a", "a", "a", "a", "b"]}, "invalid_labels"),   # 1 text of b
        ({**base, "labels": ["a", "b"] * 3, "test_fraction": 1.0}, None),
    ]
    for body, type_ in cases:
        r = world.client.post("/v1/probes/outlier-dimension", json=body)
        assert r.status_code == 422, (body, r.text)
        if type_:
            assert r.json()["type"] == type_, r.json()
    r = world.client.post("/v1/probes/outlier-dimension", json={**base, "labels": ["a", "b"] * 3, "layer": 7})
    assert r.status_code == 404 and r.json()["type"] == "layer_not_found"
    r = world.client.post("/v1/probes/outlier-dimension", json={**base, "labels": ["a", "b"] * 3,
                                                                "model": "no-such-model"})
    assert r.status_code == 404 and r.json()["type"] == "unknown_model"
