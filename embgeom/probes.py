"""Requests that run the model synchronously on a small batch of texts.

- :func:`sample_isotropy`: IsoScore and IsoScore* (Rudman & Eickhoff 2024) of a
  mini-batch, shrinking its covariance toward the collection's (or the identity).
- :func:`outlier_dimension_probe`: the 1-D outlier probe of Rudman et al. 2023
  ("Outlier dimensions encode task-specific knowledge"): the best single-threshold
  classifier on each top-variance dimension, beside a logistic regression on all.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from embgeom import diagnostics
from embgeom.errors import InvalidInput
from embgeom.compute.models import LoadedModel
from embgeom.compute.engine import POOLINGS, text_embeddings

__all__ = ["sample_isotropy", "outlier_dimension_probe"]


def sample_isotropy(loaded: LoadedModel, texts: Sequence[str], layer: int, zeta: float,
                    reference_cov: Optional[np.ndarray], include_special: bool = False,
                    token_budget: int = 16384) -> dict:
    """IsoScore of the sample's embeddings and its IsoScore*.

    ``reference_cov`` is ``C0`` (the collection's covariance), or None for the identity.
    The sample covariance uses ddof = 1, the convention of the isoscore package's
    ``IsoScore_star`` (C0 is not rescaled, so the convention matters).
    """
    if not 0.0 <= zeta <= 1.0:
        raise InvalidInput("zeta must be in [0, 1]", type="invalid_zeta")
    points = text_embeddings(loaded, texts, [layer], None, include_special, token_budget)[layer]
    points = points.astype(np.float64)
    if points.shape[0] < 2:
        raise InvalidInput("the sample has fewer than 2 counted tokens", type="sample_too_small")
    d = points.shape[1]
    sample_cov = np.cov(points.T)
    c0 = np.eye(d) if reference_cov is None else reference_cov
    return {
        "layer": layer, "n_points": int(points.shape[0]), "zeta": zeta,
        "reference": "identity" if reference_cov is None else "collection",
        "isoscore": float(diagnostics.isoscore_from_covariance(sample_cov)),
        "isoscore_star": float(diagnostics.isoscore_star(sample_cov, c0, zeta)),
    }


def outlier_dimension_probe(loaded: LoadedModel, texts: Sequence[str], labels: Sequence,
                            layer: int, pooling: str = "mean", test_fraction: float = 0.3,
                            seed: int = 0, top_k: int = 10, include_special: bool = False,
                            token_budget: int = 16384) -> dict:
    """Accuracy of 1-D threshold classifiers on the top-variance dimensions.

    Texts are pooled (``cls``/``mean``/``last``), split stratified into train and test
    (``test_fraction``, ``seed``); the top ``top_k`` dimensions by training variance each
    get the single threshold that is best on the training set, scored on the test set.
    A logistic regression on all dimensions (standardised, L2, sklearn defaults) is the
    reference, and the majority class the floor.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if pooling not in POOLINGS:
        raise InvalidInput(f"pooling must be one of {', '.join(POOLINGS)}", type="invalid_pooling")
    if len(texts) != len(labels):
        raise InvalidInput("texts and labels must have the same length", type="invalid_labels")
    labels = [str(label) for label in labels]  # 1 and "1" name one class
    classes = sorted(set(labels))
    if len(classes) != 2:
        raise InvalidInput(f"the probe is binary: labels must take exactly 2 values, got {len(classes)}",
                           type="invalid_labels")
    if not 0.0 < test_fraction < 1.0:
        raise InvalidInput("test_fraction must be in (0, 1)", type="invalid_split")
    y = np.array([classes.index(label) for label in labels])
    if np.bincount(y).min() < 2:
        raise InvalidInput("each label needs at least 2 texts", type="invalid_labels")
    X = text_embeddings(loaded, texts, [layer], pooling, include_special, token_budget)[layer]
    try:
        X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=test_fraction, random_state=seed,
                                                  stratify=y)
    except ValueError as exc:
        raise InvalidInput(f"cannot split: {exc}", type="invalid_split") from None
    var = X_tr.var(axis=0)
    mean_var = float(var.mean())
    top = np.argsort(-var, kind="stable")[: max(1, min(top_k, X.shape[1]))]
    dims = []
    for i in top:
        threshold, direction, train_acc, test_acc = diagnostics.best_threshold_accuracy(
            X_tr[:, i], y_tr, X_te[:, i], y_te)
        dims.append({"dim": int(i), "variance": float(var[i]),
                     "variance_ratio": float(var[i] / mean_var) if mean_var else None,
                     "threshold": float(threshold), "direction": int(direction),
                     "train_accuracy": float(train_acc), "test_accuracy": float(test_acc)})
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    clf.fit(X_tr, y_tr)
    majority = int(np.bincount(y_tr).argmax())
    best = max(dims, key=lambda d: (d["train_accuracy"], -d["dim"]))
    return {
        "layer": layer, "pooling": pooling, "labels": [str(c) for c in classes],
        "n_train": int(len(y_tr)), "n_test": int(len(y_te)), "top_k": len(dims),
        "dimensions": dims,
        "best_dimension": best,
        "logistic_regression": {"train_accuracy": float(clf.score(X_tr, y_tr)),
                                "test_accuracy": float(clf.score(X_te, y_te))},
        "majority_baseline": {"test_accuracy": float(np.mean(y_te == majority))},
    }
