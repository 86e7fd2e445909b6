"""API keys and their scopes: which key may do what, decided from the method and the path.

A request to ``/v1`` needs ``Authorization: Bearer <key>`` as soon as any key is
configured; the scope it needs follows from its method alone, so a route added later is
covered without declaring anything:

    GET, HEAD, OPTIONS          read
    POST, PUT, PATCH            write   (jobs, collection settings, synchronous model runs)
    DELETE                      admin

Scopes are independent: a key holds the ones it lists. ``EMBGEOM_API_KEY`` (one key)
holds them all. ``/metrics`` needs ``read`` when ``EMBGEOM_METRICS_REQUIRE_KEY`` is set;
``/healthz``, ``/readyz`` and the documentation are always open.

Keys are parsed once, at start-up. A presented token is hashed (SHA-256) and compared with
every configured key's hash by ``hmac.compare_digest``, without stopping at a match: the
time taken does not depend on how much of a key was guessed right, nor on which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from embgeom.settings import Settings

__all__ = ["SCOPES", "KeyTable", "required_scope", "document"]

SCOPES = ("read", "write", "admin")
SCOPE_OF_METHOD = {"GET": "read", "HEAD": "read", "OPTIONS": "read",
                   "POST": "write", "PUT": "write", "PATCH": "write", "DELETE": "admin"}
SCHEME = "bearer"
# What a bearer token may contain (RFC 6750 b64token, a little wider): printable ASCII,
# no space, so a key sent in a header arrives byte for byte.
_KEY_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


def required_scope(method: str, path: str, metrics_protected: bool) -> Optional[str]:
    """The scope a request needs, or None when the path is open."""
    if path.startswith("/v1/") or path == "/v1":
        # An unknown method needs the strongest scope rather than none.
        return SCOPE_OF_METHOD.get(method, "admin")
    if metrics_protected and path == "/metrics":
        return "read"
    return None


@dataclass(frozen=True)
class KeyTable:
    """The configured keys, as (SHA-256 of the key, scopes) pairs."""

    entries: tuple[tuple[bytes, frozenset], ...]
    metrics_protected: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @classmethod
    def from_settings(cls, settings: Settings) -> "KeyTable":
        """Every key of ``api_key``, ``api_keys`` and ``api_keys_file``; ``ValueError`` on a
        malformed one (the service refuses to start)."""
        keys: dict[str, frozenset] = {}

        def add(key, scopes, where: str) -> None:
            if not isinstance(key, str) or not key or not set(key) <= _KEY_CHARS:
                raise ValueError(f"{where}: an API key must be a non-empty string of printable "
                                 "ASCII without spaces")
            if isinstance(scopes, str) or not all(s in SCOPES for s in scopes):
                raise ValueError(f"{where}: scopes must be a list drawn from {list(SCOPES)}, "
                                 f"not {scopes!r}")
            keys[key] = keys.get(key, frozenset()) | frozenset(scopes)

        if settings.api_key:
            add(settings.api_key, SCOPES, "EMBGEOM_API_KEY")
        for key, scopes in settings.api_keys.items():
            add(key, scopes, "EMBGEOM_API_KEYS")
        if settings.api_keys_file is not None:
            try:
                raw = json.loads(Path(settings.api_keys_file).read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"EMBGEOM_API_KEYS_FILE {settings.api_keys_file}: {exc}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"EMBGEOM_API_KEYS_FILE {settings.api_keys_file}: expected a JSON "
                                 'object {"key": ["read", "write", "admin"]}')
            for key, scopes in raw.items():
                add(key, scopes if isinstance(scopes, list) else str(scopes),
                    f"EMBGEOM_API_KEYS_FILE {settings.api_keys_file}")
        if settings.metrics_require_key and not keys:
            raise ValueError("EMBGEOM_METRICS_REQUIRE_KEY is set but no API key is configured")
        return cls(tuple((hashlib.sha256(k.encode()).digest(), s) for k, s in keys.items()),
                   settings.metrics_require_key)

    def scopes_of(self, token: str) -> Optional[frozenset]:
        """The scopes of the key ``token``, or None when it is no configured key."""
        digest = hashlib.sha256(token.encode("latin-1", "replace")).digest()
        found = None
        for key_digest, scopes in self.entries:
            if hmac.compare_digest(digest, key_digest):
                found = scopes
        return found


def document(openapi: dict, metrics_protected: bool) -> None:
    """Declare the bearer scheme, and on every operation that needs a key, that it does and
    that it can answer 401 and 403."""
    components = openapi.setdefault("components", {})
    components.setdefault("securitySchemes", {})[SCHEME] = {
        "type": "http", "scheme": "bearer",
        "description": "An API key, when the service has any configured. Scopes: read (GET), "
                       "write (POST, PUT), admin (DELETE); EMBGEOM_API_KEY holds all three.",
    }
    for path, item in openapi.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            scope = required_scope(method.upper(), path, metrics_protected)
            if scope is None:
                continue
            op["security"] = [{SCHEME: []}]
            op["description"] = (op.get("description", "").rstrip()
                                 + f"\n\nNeeds an API key with the `{scope}` scope when keys are "
                                   "configured.").lstrip()
            challenge = {"WWW-Authenticate": {"description": "Bearer challenge (RFC 6750)",
                                              "schema": {"type": "string"}}}
            for status, what in (("401", "No API key, or not a configured one: unauthorized"),
                                 ("403", f"The API key lacks the `{scope}` scope: forbidden")):
                op["responses"].setdefault(status, {
                    "description": what, "headers": challenge,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
                })
