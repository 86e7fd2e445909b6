"""The reads that run a model in the API process: an input space's rows (the input
embedding matrix) and the vectors of texts (a forward pass, for steering).

``loaded`` is a :class:`~embgeom.compute.models.LoadedModel`. Its tensors are used through
their own methods; torch itself is imported only by the engine, and only when texts run.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from embgeom.compute.positions import encode

__all__ = ["INPUT", "input_rows", "text_vectors"]

# The layer of an input space: the model's input embedding matrix.
INPUT = "input"


def input_rows(loaded, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of the model's input embedding matrix: (len(ids), d) float64."""
    weight = loaded.model.get_input_embeddings().weight.detach()
    return weight[ids].double().cpu().numpy()


def text_vectors(loaded, layer: Union[int, str], texts: Sequence[str], include_special: bool,
                 token_budget: int) -> np.ndarray:
    """One vector per text: the mean of the text's counted positions (the collection's
    rule) at ``layer``, or of their input embedding rows (``layer="input"``): (len, d)."""
    if layer == INPUT:
        enc = encode(loaded.tokenizer, texts, loaded.info.max_length, include_special)
        text_of = np.repeat(enc.text_index, enc.lengths)[enc.counted]
        rows = input_rows(loaded, enc.input_ids[enc.counted])
        sums = np.zeros((len(texts), rows.shape[1]))
        np.add.at(sums, text_of, rows)
        counts = np.bincount(text_of, minlength=len(texts)).astype(np.float64)
        return sums / np.maximum(counts, 1.0)[:, None]
    from embgeom.compute.engine import text_embeddings  # torch only when texts are sent

    return text_embeddings(loaded, list(texts), [layer], "mean", include_special,
                           token_budget)[layer]
