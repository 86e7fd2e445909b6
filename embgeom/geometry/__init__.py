"""Cross-model geometry: how alike two embedding spaces are, globally and locally.

The inputs are matrices of per-token mean embeddings with matched rows, ``A`` of shape
(k, d_a) and ``B`` of shape (k, d_b): row i of both is the same token, seen by two models
or two layers. Following Lee, Weber, Viegas & Wattenberg (2025) and Huh et al. (2024), a
file per family::

    matching    which rows are the same token (by key, or by canonical string)
    similarity  global: Pearson of cosines, linear CKA (biased and debiased), Procrustes,
                mutual k-NN, CKNNA; and the layer-by-layer CKA of a streamed co-moment
    neighbors   the one exact neighbour search
    local       LLE weights and their transfer from A to B
    intrinsic   per-token dimension: local PCA, TwoNN, Levina-Bickel MLE
    steering    Emb2Emb: B ~ A W + c (ridge); a steering vector maps as v_b = v_a W

Every measure of the first groups comes with a baseline (rows of B shuffled, or random
weights), without which it does not mean much: the biased linear CKA of two unrelated
spaces is about sqrt(d_a d_b) / k, not 0.

Every module is float64 numpy, pure and without I/O: no torch, no Redis, nothing of the
store, the compute layer or the service. The object that reads spaces from the store (and
runs a model for an input space), caches and bounds the work is
:mod:`embgeom.comparisons`, a layer above. Invalid input raises ``ValueError`` (the
comparisons map it to 422); a quantity undefined on valid input (no spread) is ``nan``
(they report null).

References
----------
A. Lee, M. Weber, F. Viegas, M. Wattenberg. "Shared Global and Local Geometry of Language
Model Embeddings". COLM 2025 (arXiv:2503.21073).
M. Huh, B. Cheung, T. Wang, P. Isola. "The Platonic Representation Hypothesis". ICML 2024.
"""

from embgeom.geometry.intrinsic import (IntrinsicDimension, MLEDimension, intrinsic_dimension,
                                        local_pca_dimension, mle_dimension, twonn_dimension,
                                        twonn_local_dimension)
from embgeom.geometry.local import (lle_transfer, lle_transfer_rows, lle_weights,
                                    reconstruction_error)
from embgeom.geometry.neighbors import nearest_neighbors
from embgeom.geometry.similarity import (MAX_COSINE_ROWS, cknna, cosine_matrix, global_similarity,
                                         layer_cka, linear_cka, mutual_knn, pearson_cosine,
                                         procrustes_residual, unbiased_cka)
from embgeom.geometry.steering import LinearMap, fit_linear_map, random_map_like, transfer_vector

__all__ = [
    "IntrinsicDimension",
    "LinearMap",
    "MAX_COSINE_ROWS",
    "MLEDimension",
    "cknna",
    "cosine_matrix",
    "fit_linear_map",
    "global_similarity",
    "intrinsic_dimension",
    "layer_cka",
    "linear_cka",
    "lle_transfer",
    "lle_transfer_rows",
    "lle_weights",
    "local_pca_dimension",
    "mle_dimension",
    "mutual_knn",
    "nearest_neighbors",
    "pearson_cosine",
    "procrustes_residual",
    "random_map_like",
    "reconstruction_error",
    "transfer_vector",
    "twonn_dimension",
    "twonn_local_dimension",
    "unbiased_cka",
]
