"""JSON responses encoded by orjson: the hot read routes build their dict and return it
as is (no second validation pass through the response model, which only documents it).
NaN and infinities become null, as JSON has no other spelling for them."""

from __future__ import annotations

import orjson
from fastapi.responses import Response

__all__ = ["FastJSON"]


class FastJSON(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
