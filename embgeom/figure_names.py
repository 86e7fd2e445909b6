"""The figures the service draws, by name, and which parameters each uses: what the
service's routes, the renderer and the client commands (``embgeom report``) share. No
matplotlib here: a client-only install reads it."""

from __future__ import annotations

__all__ = ["FIGURES", "FORMATS", "LAYER_FIGURES", "FILTERED_FIGURES"]

FORMATS = ("png", "svg")

FIGURES: dict[str, str] = {
    "vm_scatter": "V against M per token type at one layer, coloured by log10 n, "
                  "with the least-squares line (paper Fig. 2)",
    "layer_summary": "cv_Q, slope and R^2 of the V-on-M regression across layers (paper Fig. 4)",
    "decomposition": "Q = M + V_W + V_B as stacked shares of Q per layer (paper Fig. 5)",
    "within_ratio": "share of the variance that is within token types, V_W/V, per layer (paper Fig. 6)",
    "frequency": "Q, M and V of each token type against log10 n at one layer (paper Fig. 7)",
    "isotropy": "IsoScore, mean cosine similarity and effective rank across layers",
    "outliers": "outlier dimensions (variance >= threshold x mean variance) across layers",
    "spectrum": "sorted covariance eigenvalues of one layer and their cumulative explained variance",
    "cka": "linear CKA of every pair of layers over every occurrence ingested (exact; collections "
           "created with cross_layer)",
}

# Figures of one layer (``?layer=`` required) and figures over the count-filtered types.
LAYER_FIGURES = ("vm_scatter", "frequency", "spectrum")
FILTERED_FIGURES = ("vm_scatter", "layer_summary", "decomposition", "within_ratio", "frequency")
