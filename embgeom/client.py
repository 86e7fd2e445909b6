"""The v1 API from Python: :class:`EmbgeomClient` (blocking) and :class:`AsyncEmbgeomClient`.

Every endpoint is written once, in :class:`Calls`, as the description of the request
(a :class:`Call`: method, path, query, body, and how to read the answer), or as a plan
that yields several (``tokens`` follows the cursor, ``wait`` polls). A client runs those
descriptions: the blocking one over ``httpx.Client``, the async one over
``httpx.AsyncClient``; ``Calls()`` itself only builds them. So a notebook reads::

    from embgeom.client import EmbgeomClient

    client = EmbgeomClient("http://127.0.0.1:8080")
    client.layers("bbc", "minilm", as_frame=True)          # a pandas DataFrame
    client.figure("bbc", "minilm", "layer_summary")        # shows itself inline

    async with AsyncEmbgeomClient(url) as client:
        rows = await client.layers("bbc", "minilm")

Answers are the service's JSON, typed by :mod:`embgeom.api_types`; the endpoints that
answer a table take ``as_frame=True`` for a DataFrame (the rest of the answer, ``as_of``
and the filters, in ``DataFrame.attrs``); figures are :class:`Figure` (PNG or SVG bytes
with ``_repr_png_``/``_repr_svg_``). Every error body ``{"type", "message", "detail"}``
is raised as :class:`ApiError`, and a 429 (the queue is full) is retried after the
server's ``Retry-After``, or after an exponential backoff when it gives none; a 503 with
``Retry-After`` (a model still loading in the API, the store briefly away) is retried
after it too, within the same ``max_retries``.

A query or body parameter left ``None`` is not sent: the service's default applies.
"""

from __future__ import annotations

import asyncio
import email.utils
import html
import io
import random
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import (TYPE_CHECKING, Any, Awaitable, BinaryIO, Callable, Generator, Mapping, NamedTuple,
                    Optional, Sequence, Union)

import httpx

from embgeom import api_types as T
from embgeom.tables import square_frame, to_frame

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ApiError", "AsyncEmbgeomClient", "Call", "Calls", "EmbgeomClient", "Figure", "Report",
           "Space", "TERMINAL"]

TERMINAL = ("done", "failed")

# A space of the comparison endpoints: "collection:model:layer", (collection, model, layer)
# or {"collection", "model", "layer"}; layer an integer or "input".
Space = Union[str, Sequence, Mapping]


class ApiError(Exception):
    """An error answered by the service: HTTP ``status``, stable ``type``, human ``message``
    and the ``detail`` object of its body (DESIGN.md section 2)."""

    def __init__(self, status: int, type: str, message: str, detail: Optional[dict] = None):
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.detail = detail or {}

    @classmethod
    def from_response(cls, response: httpx.Response) -> "ApiError":
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "type" in body:
            return cls(response.status_code, str(body["type"]), str(body.get("message", "")),
                       body.get("detail") or {})
        # Not the service's error shape (a proxy in between, for instance).
        return cls(response.status_code, "http_error", response.text[:500] or response.reason_phrase)


def _retry_after(response: httpx.Response) -> Optional[float]:
    """Seconds from a ``Retry-After`` header: delta-seconds or an HTTP date."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


# ------------------------------------------------------------------- answers
class Figure(bytes):
    """A figure's PNG or SVG bytes (``format``), shown inline by Jupyter.

    It is ``bytes``: ``Path(...).write_bytes(figure)`` saves it as the service sent it.
    """

    format: str

    def __new__(cls, data: bytes, format: str) -> "Figure":
        figure = super().__new__(cls, data)
        figure.format = format
        return figure

    def _repr_png_(self) -> Optional[bytes]:
        return bytes(self) if self.format == "png" else None

    def _repr_svg_(self) -> Optional[str]:
        return self.decode("utf-8") if self.format == "svg" else None

    def __repr__(self) -> str:
        return f"<Figure {self.format}, {len(self)} bytes>"

    def __reduce__(self):
        return Figure, (bytes(self), self.format)

    def save(self, path) -> None:
        with open(path, "wb") as out:
            out.write(self)


class Report(NamedTuple):
    """The report page (self-contained HTML) and the layer its per-layer figures show."""

    html: str
    layer: Optional[int]

    def _repr_html_(self) -> str:
        # In a frame of its own: the page's styles stay out of the notebook's.
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                'style="width: 100%; height: 720px; border: 0"></iframe>')


@dataclass(frozen=True)
class Call:
    """One request and how to read its answer.

    ``parse`` turns a successful response into the method's result; with ``sink`` the
    body is streamed into that binary file instead and the result is the bytes written.
    """

    method: str
    path: str
    params: Optional[Mapping[str, Any]] = None
    json: Any = None
    headers: Optional[Mapping[str, str]] = None
    parse: Callable[[httpx.Response], Any] = httpx.Response.json
    sink: Optional[BinaryIO] = None

    def finish(self, response: httpx.Response) -> Any:
        """The result of a read response: :class:`ApiError` for an error answer."""
        if response.is_error:
            raise ApiError.from_response(response)
        return self.parse(response)


@dataclass(frozen=True)
class Sleep:
    """A step of a plan: wait this many seconds (``time.sleep`` or ``asyncio.sleep``)."""

    seconds: float


Plan = Generator[Union[Call, Sleep], Any, Any]


def _query(**params) -> dict:
    """The query parameters that were given (None: the service's default)."""
    return {k: v for k, v in params.items() if v is not None}


_body = _query


def _answer(as_frame: bool, key: Optional[str] = None,
            rows: Optional[Callable[[Any], list]] = None) -> Callable[[httpx.Response], Any]:
    """Read JSON; with ``as_frame``, the table at ``key`` (or ``rows(body)``; the whole
    body when it is a list) as a DataFrame, the answer's other fields in its attrs."""
    def parse(response: httpx.Response):
        body = response.json()
        if not as_frame:
            return body
        if key is None:
            return to_frame(body)
        return to_frame(rows(body) if rows else body[key], {k: v for k, v in body.items() if k != key})
    return parse


def _figure(fmt: str) -> Callable[[httpx.Response], Figure]:
    return lambda response: Figure(response.content, fmt)


def _report(response: httpx.Response) -> Report:
    shown = response.headers.get("x-embgeom-layer")
    return Report(response.text, int(shown) if shown is not None else None)


def _export(fmt: str, as_frame: bool) -> Callable[[httpx.Response], Any]:
    def parse(response: httpx.Response):
        if not as_frame:
            return response.content
        import pandas as pd

        data = io.BytesIO(response.content)
        return pd.read_parquet(data) if fmt == "parquet" else pd.read_csv(data, float_precision="round_trip")
    return parse


def _space(space: Space) -> dict:
    """``{"collection", "model", "layer"}`` of a space given in any of :data:`Space`'s forms."""
    if isinstance(space, Mapping):
        return dict(space)
    if isinstance(space, str):
        parts = space.split(":")
        if len(parts) != 3:
            raise ValueError(f"a space is collection:model:layer, not {space!r}")
    else:
        parts = list(space)
    collection, model, layer = parts
    if isinstance(layer, str) and layer.isdigit():
        layer = int(layer)
    return {"collection": collection, "model": model, "layer": layer}


def _space_ref(space: Space) -> str:
    s = _space(space)
    return f"{s['collection']}:{s['model']}:{s['layer']}"


def _pair(collection: str, model: str) -> str:
    return f"/v1/collections/{collection}/models/{model}"


# ------------------------------------------------------------------ endpoints
class Calls:
    """Every endpoint of the v1 API, once. ``Calls()`` returns each call's description;
    :class:`EmbgeomClient` returns its result, :class:`AsyncEmbgeomClient` an awaitable."""

    def _run(self, step: Union[Call, Plan]) -> Any:
        return step

    # ------------------------------------------------------------- health
    def healthz(self) -> T.Health:
        return self._run(Call("GET", "/healthz"))

    def readyz(self) -> T.Readiness:
        """Whether the service can take jobs (503, as :class:`ApiError`, when it cannot)."""
        return self._run(Call("GET", "/readyz"))

    def metrics(self) -> str:
        """The Prometheus exposition text."""
        return self._run(Call("GET", "/metrics", parse=lambda r: r.text))

    # --------------------------------------------------------------- jobs
    def submit(self, texts: Sequence[str], collection: str = "default", model: str = "minilm",
               include_special: Optional[bool] = None, idempotency_key: Optional[str] = None) -> str:
        """Queue ``texts``; returns the job id (the first job's, for a repeated key).

        ``include_special`` None leaves it to the collection's settings (a job that says
        otherwise than an existing collection is refused with 409)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        body = _body(collection=collection, model=model, texts=list(texts), include_special=include_special)
        return self._run(Call("POST", "/v1/jobs", json=body, headers=headers,
                              parse=lambda r: r.json()["job_id"]))

    def job(self, job_id: str) -> T.JobStatus:
        return self._run(Call("GET", f"/v1/jobs/{job_id}"))

    def jobs(self, job_ids: Sequence[str], as_frame: bool = False) -> list[T.JobStatus]:
        """Status of many jobs in one request (``GET /v1/jobs?ids=``), in order."""
        return self._run(Call("GET", "/v1/jobs", params={"ids": ",".join(job_ids)}, parse=_answer(as_frame)))

    def wait(self, job_ids: Sequence[str], on_progress: Optional[Callable[[list], None]] = None,
             timeout: Optional[float] = None, poll_interval: float = 0.5,
             window: int = 64) -> list[T.JobStatus]:
        """Poll until every job is done or failed; returns their final statuses, in order.

        ``on_progress(statuses)`` is called after each round with the latest status of
        every job (``None`` for one not polled yet). A round asks for the ``window`` oldest
        unfinished jobs in one request: workers take jobs in order, so later ones rarely
        moved. Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        return self._run(_wait(list(job_ids), on_progress, timeout, poll_interval, window))

    # -------------------------------------------------- models, collections
    def models(self, as_frame: bool = False) -> list[T.ModelOut]:
        return self._run(Call("GET", "/v1/models", parse=_answer(as_frame)))

    def collections(self, as_frame: bool = False) -> list[T.CollectionOut]:
        return self._run(Call("GET", "/v1/collections", parse=_answer(as_frame)))

    def collection(self, collection: str) -> T.CollectionInfo:
        """A collection's settings and models."""
        return self._run(Call("GET", f"/v1/collections/{collection}"))

    def create_collection(self, collection: str, preset: Optional[str] = None, key: Optional[str] = None,
                          unit: Optional[str] = None, include_special: Optional[bool] = None,
                          layers: Optional[Sequence[int]] = None,
                          self_similarity: Optional[bool] = None,
                          cross_layer: Optional[bool] = None) -> T.CollectionInfo:
        """Create a collection with fixed settings (``preset="paper"``, or ``key`` id|string,
        ``unit`` token|word, ``cross_layer`` to keep the moments of :meth:`similarity`, ...).
        The same settings again answer the collection (``created`` false); other settings
        for an existing one are a 409 :class:`ApiError`."""
        body = _body(preset=preset, key=key, unit=unit, include_special=include_special,
                     layers=list(layers) if layers is not None else None, self_similarity=self_similarity,
                     cross_layer=cross_layer)
        return self._run(Call("PUT", f"/v1/collections/{collection}", json=body))

    def delete_collection(self, collection: str) -> T.Deleted:
        return self._run(Call("DELETE", f"/v1/collections/{collection}"))

    # --------------------------------------------------------------- layers
    def layers(self, collection: str, model: str, min_count: int = 1, max_count: Optional[int] = None,
               as_frame: bool = False) -> Union[T.LayersOut, "pd.DataFrame"]:
        """The per-layer decomposition and summary, ``{"layers": [row per layer], "as_of", ...}``;
        with ``as_frame`` the rows as a DataFrame."""
        return self._run(Call("GET", f"{_pair(collection, model)}/layers",
                              params=_query(min_count=min_count, max_count=max_count),
                              parse=_answer(as_frame, "layers")))

    def decomposition(self, collection: str, model: str, layer: int, min_count: int = 1,
                      max_count: Optional[int] = None) -> T.Decomposition:
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/decomposition",
                              params=_query(min_count=min_count, max_count=max_count)))

    def tokens(self, collection: str, model: str, layer: int, order_by: str = "n", desc: bool = True,
               min_count: int = 1, max_count: Optional[int] = None, token: Optional[str] = None,
               page_size: int = 1000, as_frame: bool = False) -> Union[list[T.TokenStats], "pd.DataFrame"]:
        """Every token type's stats at ``layer`` (following ``next_cursor`` page by page)."""
        first = Call("GET", f"{_pair(collection, model)}/layers/{layer}/tokens",
                     params=_query(order_by=order_by, desc=desc, limit=page_size, min_count=min_count,
                                   max_count=max_count, token=token))
        return self._run(_pages(first, "tokens", as_frame))

    def token(self, collection: str, model: str, layer: int, token_id: int) -> T.TokenDetail:
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/tokens/{token_id}"))

    def neighbors(self, collection: str, model: str, layer: int, token_id: int, k: Optional[int] = None,
                  min_count: Optional[int] = None, as_frame: bool = False) -> Union[T.Neighbors, "pd.DataFrame"]:
        """The ``k`` nearest token types of one (cosine of mean vectors)."""
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/tokens/{token_id}/neighbors",
                              params=_query(k=k, min_count=min_count), parse=_answer(as_frame, "neighbors")))

    def similarity(self, collection: str, model: str, metric: Optional[str] = None,
                   as_frame: bool = False) -> Union[T.LayerSimilarity, "pd.DataFrame"]:
        """Layer-by-layer similarity over every occurrence ingested (``metric`` linear_cka |
        rv; collections created with ``cross_layer``, else a 409 ``cross_layer_not_kept``);
        with ``as_frame`` the L x L matrix indexed by layer on both axes."""
        def parse(response: httpx.Response):
            body = response.json()
            if not as_frame:
                return body
            return square_frame(body["layers"], body["matrix"],
                                {k: v for k, v in body.items() if k not in ("layers", "matrix")})
        return self._run(Call("GET", f"{_pair(collection, model)}/similarity", params=_query(metric=metric),
                              parse=parse))

    # ----------------------------------------------------------- isotropy
    def isotropy(self, collection: str, model: str, layer: int, transform: Optional[str] = None,
                 spectrum: Optional[bool] = None, partition: Optional[bool] = None,
                 min_count: Optional[int] = None) -> T.Isotropy:
        """IsoScore, mean cosine, spectrum summaries and I(W) of a layer (``transform``
        none | standardize | abtt:D)."""
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/isotropy",
                              params=_query(transform=transform, spectrum=spectrum, partition=partition,
                                            min_count=min_count)))

    def isotropy_sample(self, collection: str, model: str, layer: int, texts: Sequence[str],
                        reference: Optional[str] = None, zeta: Optional[float] = None,
                        include_special: Optional[bool] = None) -> T.SampleIsotropy:
        """IsoScore* of the given texts' embeddings at ``layer``."""
        body = _body(texts=list(texts), reference=reference, zeta=zeta, include_special=include_special)
        return self._run(Call("POST", f"{_pair(collection, model)}/layers/{layer}/isotropy/sample", json=body))

    def outliers(self, collection: str, model: str, layer: int, threshold: Optional[float] = None,
                 transform: Optional[str] = None, top: Optional[int] = None,
                 as_frame: bool = False) -> Union[T.Outliers, "pd.DataFrame"]:
        """Outlier dimensions of a layer (``as_frame``: one row per dimension) and its rogue ones."""
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/outliers",
                              params=_query(threshold=threshold, transform=transform, top=top),
                              parse=_answer(as_frame, "dimensions")))

    def model_outliers(self, collection: str, model: str, threshold: Optional[float] = None,
                       transform: Optional[str] = None,
                       as_frame: bool = False) -> Union[T.ModelOutliers, "pd.DataFrame"]:
        """Outlier dimensions of every layer (``as_frame``: a row per layer and dimension)."""
        rows = lambda body: [{"layer": l["layer"], "n": l["n"], **d}  # noqa: E731
                             for l in body["layers"] for d in l["dimensions"]]
        return self._run(Call("GET", f"{_pair(collection, model)}/outliers",
                              params=_query(threshold=threshold, transform=transform),
                              parse=_answer(as_frame, "layers", rows)))

    def intrinsic_dimension(self, collection: str, model: str, layer: int, k: Optional[int] = None,
                            method: Optional[str] = None, threshold: Optional[float] = None,
                            min_count: Optional[int] = None, limit: Optional[int] = None,
                            neighbors: Optional[int] = None,
                            as_frame: bool = False) -> Union[T.IntrinsicDimension, "pd.DataFrame"]:
        """Local intrinsic dimension (``method`` local_pca | twonn | mle); ``as_frame``: the
        highest and lowest tokens, a row each, ``end`` saying which."""
        rows = lambda body: [{"end": end, **t} for end in ("highest", "lowest")  # noqa: E731
                             for t in body[end]]
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/intrinsic-dimension",
                              params=_query(k=k, method=method, threshold=threshold, min_count=min_count,
                                            limit=limit, neighbors=neighbors),
                              parse=_answer(as_frame, "tokens", rows)))

    def outlier_probe(self, model: str, layer: int, texts: Sequence[str], labels: Sequence,
                      pooling: Optional[str] = None, top_k: Optional[int] = None,
                      test_fraction: Optional[float] = None, seed: Optional[int] = None,
                      include_special: Optional[bool] = None,
                      as_frame: bool = False) -> Union[T.ProbeResult, "pd.DataFrame"]:
        """How well single dimensions separate labelled texts (``as_frame``: a row per dimension)."""
        body = _body(model=model, layer=layer, texts=list(texts), labels=list(labels), pooling=pooling,
                     top_k=top_k, test_fraction=test_fraction, seed=seed, include_special=include_special)
        return self._run(Call("POST", "/v1/probes/outlier-dimension", json=body,
                              parse=_answer(as_frame, "dimensions")))

    # ------------------------------------------------------ comparisons
    def compare_global(self, a: Space, b: Space, min_count: Optional[int] = None,
                       sample: Optional[int] = None, seed: Optional[int] = None,
                       k: Optional[int] = None) -> T.GlobalSimilarity:
        """Pearson of cosines, linear and unbiased CKA, the Procrustes residual, mutual k-NN
        and CKNNA (``k`` neighbours) between two spaces, each beside its shuffled baseline."""
        body = _body(a=_space(a), b=_space(b), min_count=min_count, sample=sample, seed=seed, k=k)
        return self._run(Call("POST", "/v1/compare/global", json=body))

    def compare_lle(self, a: Space, b: Space, k: Optional[int] = None, reg: Optional[float] = None,
                    min_count: Optional[int] = None, sample: Optional[int] = None,
                    seed: Optional[int] = None) -> T.LLEResult:
        """How well each token's local linear reconstruction in ``a`` transfers to ``b``."""
        body = _body(a=_space(a), b=_space(b), k=k, reg=reg, min_count=min_count, sample=sample, seed=seed)
        return self._run(Call("POST", "/v1/compare/lle", json=body))

    def steering_transfer(self, a: Space, b: Space, vector: Optional[Sequence[float]] = None,
                          positive_texts: Optional[Sequence[str]] = None,
                          negative_texts: Optional[Sequence[str]] = None, ridge: Optional[float] = None,
                          held_out: Optional[float] = None, min_count: Optional[int] = None,
                          sample: Optional[int] = None, seed: Optional[int] = None,
                          return_vector: Optional[bool] = None) -> T.SteeringResult:
        """A steering vector of ``a`` (given, or positive minus negative texts) mapped into ``b``."""
        body = _body(a=_space(a), b=_space(b), vector=list(vector) if vector is not None else None,
                     positive_texts=list(positive_texts) if positive_texts is not None else None,
                     negative_texts=list(negative_texts) if negative_texts is not None else None,
                     ridge=ridge, held_out=held_out, min_count=min_count, sample=sample, seed=seed,
                     return_vector=return_vector)
        return self._run(Call("POST", "/v1/steering/transfer", json=body))

    # ---------------------------------------------------- figures, report
    def figure(self, collection: str, model: str, name: str, fmt: str = "png", layer: Optional[int] = None,
               min_count: int = 1, max_count: Optional[int] = None,
               models: Optional[Sequence[str]] = None, fresh: bool = False) -> Figure:
        """One figure (``layer`` for vm_scatter, frequency, spectrum; ``models`` to overlay
        in layer_summary). While the collection changes the service may answer the newest
        drawing of an earlier version; ``fresh`` waits for the current one."""
        return self._run(Call("GET", f"{_pair(collection, model)}/figures/{name}",
                              params=_query(format=fmt, layer=layer, min_count=min_count, max_count=max_count,
                                            models=",".join(models) if models else None,
                                            fresh="true" if fresh else None),
                              parse=_figure(fmt)))

    def layer_figure(self, collection: str, model: str, layer: int, name: str = "intrinsic_dimension",
                     fmt: str = "png", k: Optional[int] = None, method: Optional[str] = None,
                     threshold: Optional[float] = None, min_count: Optional[int] = None,
                     limit: Optional[int] = None) -> Figure:
        return self._run(Call("GET", f"{_pair(collection, model)}/layers/{layer}/figures/{name}",
                              params=_query(format=fmt, k=k, method=method, threshold=threshold,
                                            min_count=min_count, limit=limit),
                              parse=_figure(fmt)))

    def compare_figure(self, name: str, a: Space, b: Space, fmt: str = "png", min_count: Optional[int] = None,
                       sample: Optional[int] = None, seed: Optional[int] = None, pairs: Optional[int] = None,
                       k: Optional[int] = None, reg: Optional[float] = None) -> Figure:
        """The figure of a comparison (``name`` global | lle)."""
        return self._run(Call("GET", f"/v1/compare/figures/{name}",
                              params=_query(a=_space_ref(a), b=_space_ref(b), format=fmt, min_count=min_count,
                                            sample=sample, seed=seed, pairs=pairs, k=k, reg=reg),
                              parse=_figure(fmt)))

    def report(self, collection: str, model: str, min_count: int = 1, max_count: Optional[int] = None,
               layer: Optional[int] = None, fmt: str = "png", fresh: bool = False) -> Report:
        """The report page (HTML) and the layer its per-layer figures show (``fresh`` as
        :meth:`figure`)."""
        return self._run(Call("GET", f"{_pair(collection, model)}/report",
                              params=_query(format=fmt, min_count=min_count, max_count=max_count, layer=layer,
                                            fresh="true" if fresh else None),
                              parse=_report))

    def export(self, collection: str, model: str, layer: int, out: Optional[BinaryIO] = None,
               fmt: str = "parquet", min_count: int = 1, max_count: Optional[int] = None,
               means: bool = False, as_frame: bool = False) -> Union[int, bytes, "pd.DataFrame"]:
        """A layer's per-token export (Parquet or CSV): streamed into the binary file ``out``
        (returns the bytes written), else its bytes, or with ``as_frame`` a DataFrame."""
        call = Call("GET", f"{_pair(collection, model)}/layers/{layer}/export",
                    params=_query(format=fmt, means=bool(means), min_count=min_count, max_count=max_count),
                    parse=_export(fmt, as_frame), sink=out)
        return self._run(call)


_CALLS = Calls()


def _pages(first: Call, key: str, as_frame: bool) -> Plan:
    """Every row of a cursor-paged listing, ``first`` being the request of its first page."""
    rows: list = []
    call = first
    while True:
        page = yield call
        rows.extend(page[key])
        if not page.get("next_cursor"):
            break
        call = replace(call, params={**call.params, "cursor": page["next_cursor"]})
    if as_frame:
        return to_frame(rows, {k: v for k, v in page.items() if k not in (key, "next_cursor")})
    return rows


def _wait(job_ids: list[str], on_progress, timeout, poll_interval: float, window: int) -> Plan:
    ids = list(dict.fromkeys(job_ids))
    latest: dict[str, Optional[dict]] = {j: None for j in ids}
    pending = list(ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for status in (yield _CALLS.jobs(pending[:window])):
            latest[status["job_id"]] = status
        pending = [j for j in pending if (latest[j] or {}).get("status") not in TERMINAL]
        if on_progress is not None:
            on_progress([latest[j] for j in job_ids])
        if not pending:
            return [latest[j] for j in job_ids]
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{len(pending)} jobs not finished after {timeout}s: "
                               f"{', '.join(pending[:5])}{' ...' if len(pending) > 5 else ''}")
        yield Sleep(poll_interval)


# ------------------------------------------------------------------- clients
class _Transport:
    """What both clients share: the connection's settings and the retry policy (429, and
    503 with ``Retry-After``)."""

    def __init__(self, url: str, api_key: Optional[str], timeout: float, max_retries: int,
                 max_backoff: float):
        self._base = dict(base_url=url.rstrip("/"), timeout=timeout,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.max_retries = max_retries
        self.max_backoff = max_backoff

    def _backoff(self, response: httpx.Response, attempt: int) -> Optional[float]:
        """Seconds to wait before sending again, or None: neither a 429 nor a 503 with
        ``Retry-After`` (a model still loading, the store briefly away), or no retries left."""
        if attempt >= self.max_retries:
            return None
        delay = _retry_after(response)
        if response.status_code == 503:
            if delay is None:  # a 503 that names no time is not one to wait out
                return None
        elif response.status_code != 429:
            return None
        if delay is None:  # full jitter, so many clients do not come back together
            delay = random.uniform(0, 0.5 * 2 ** attempt)
        return min(delay, self.max_backoff)

    @staticmethod
    def _request(http, call: Call) -> httpx.Request:
        return http.build_request(call.method, call.path, params=call.params, json=call.json,
                                  headers=call.headers)


class EmbgeomClient(_Transport, Calls):
    """The v1 API over HTTP (blocking).

    Parameters
    ----------
    url : base URL of the service, e.g. ``http://127.0.0.1:8080``.
    api_key : sent as ``Authorization: Bearer <key>`` when given.
    timeout : seconds per request.
    max_retries : 429 answers (and 503 with ``Retry-After``) retried before
        :class:`ApiError` is raised.
    max_backoff : upper bound, in seconds, of one wait between retries.
    transport : an ``httpx`` transport (tests pass ``httpx.MockTransport``).
    sleep : the function that waits (tests pass a recorder).
    """

    def __init__(self, url: str, api_key: Optional[str] = None, timeout: float = 60.0,
                 max_retries: int = 10, max_backoff: float = 30.0,
                 transport: Optional[httpx.BaseTransport] = None,
                 sleep: Callable[[float], None] = time.sleep):
        super().__init__(url, api_key, timeout, max_retries, max_backoff)
        self._http = httpx.Client(transport=transport, **self._base)
        self._sleep = sleep

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EmbgeomClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, step):
        if isinstance(step, Call):
            return self._execute(step)
        try:
            instruction = next(step)
            while True:
                if isinstance(instruction, Sleep):
                    result = self._sleep(instruction.seconds)
                else:
                    result = self._execute(instruction)
                instruction = step.send(result)
        except StopIteration as stop:
            return stop.value
        finally:
            step.close()

    def _execute(self, call: Call):
        request = self._request(self._http, call)
        for attempt in range(self.max_retries + 1):
            response = self._http.send(request, stream=True)
            delay = self._backoff(response, attempt)
            if delay is None:
                break
            response.close()
            self._sleep(delay)
        try:
            if call.sink is not None and not response.is_error:
                written = 0
                for piece in response.iter_bytes():
                    call.sink.write(piece)
                    written += len(piece)
                return written
            response.read()
            return call.finish(response)
        finally:
            response.close()


class AsyncEmbgeomClient(_Transport, Calls):
    """The v1 API over ``httpx.AsyncClient``: every method of :class:`EmbgeomClient`,
    awaited (``await client.layers(...)``). Parameters as :class:`EmbgeomClient`'s, with an
    ``httpx.AsyncBaseTransport`` and an async ``sleep``."""

    def __init__(self, url: str, api_key: Optional[str] = None, timeout: float = 60.0,
                 max_retries: int = 10, max_backoff: float = 30.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        super().__init__(url, api_key, timeout, max_retries, max_backoff)
        self._http = httpx.AsyncClient(transport=transport, **self._base)
        self._sleep = sleep

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncEmbgeomClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _run(self, step):
        if isinstance(step, Call):
            return await self._execute(step)
        try:
            instruction = next(step)
            while True:
                if isinstance(instruction, Sleep):
                    result = await self._sleep(instruction.seconds)
                else:
                    result = await self._execute(instruction)
                instruction = step.send(result)
        except StopIteration as stop:
            return stop.value
        finally:
            step.close()

    async def _execute(self, call: Call):
        request = self._request(self._http, call)
        for attempt in range(self.max_retries + 1):
            response = await self._http.send(request, stream=True)
            delay = self._backoff(response, attempt)
            if delay is None:
                break
            await response.aclose()
            await self._sleep(delay)
        try:
            if call.sink is not None and not response.is_error:
                written = 0
                async for piece in response.aiter_bytes():
                    call.sink.write(piece)
                    written += len(piece)
                return written
            await response.aread()
            return call.finish(response)
        finally:
            await response.aclose()
