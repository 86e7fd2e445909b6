"""Write the app's OpenAPI document to openapi/openapi.json, and the client's types that
follow from it to embgeom/api_types.py (``make openapi``)."""

from __future__ import annotations

import json
import keyword
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = ROOT / "openapi" / "openapi.json"
TYPES_PATH = ROOT / "embgeom" / "api_types.py"

_SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


def document() -> str:
    from service.app import create_app

    return json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"


def _name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _annotation(schema: dict) -> str:
    """The Python annotation of a JSON schema (the subset FastAPI's documents use)."""
    if "$ref" in schema:
        return _name(schema["$ref"])
    if "anyOf" in schema or "oneOf" in schema:
        options = [_annotation(s) for s in schema.get("anyOf", schema.get("oneOf"))]
        kept = [o for o in dict.fromkeys(options) if o != "None"]
        inner = kept[0] if len(kept) == 1 else f"Union[{', '.join(kept)}]"
        return f"Optional[{inner}]" if "None" in options else inner
    if "enum" in schema:
        return f"Literal[{', '.join(repr(v) for v in schema['enum'])}]"
    if "const" in schema:
        return f"Literal[{schema['const']!r}]"
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_annotation(schema.get('items', {}))}]"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"dict[str, {_annotation(extra) if isinstance(extra, dict) and extra else 'Any'}]"
    return _SCALARS.get(kind, "Any")


def _refs(schema) -> list[str]:
    """Names of the component schemas that ``schema`` refers to, in order of appearance."""
    if isinstance(schema, dict):
        found = [_name(schema["$ref"])] if "$ref" in schema else []
        return found + [r for value in schema.values() for r in _refs(value)]
    if isinstance(schema, list):
        return [r for value in schema for r in _refs(value)]
    return []


def api_types(doc: dict) -> str:
    """``embgeom/api_types.py``: a TypedDict per schema a 2xx JSON answer can hold.

    Every field is a key of the answer (the service serialises each model whole, nulls
    included), so each TypedDict is total. Dependencies come first; a schema whose field
    names are not all identifiers ("M/Q") uses the functional form.
    """
    components = doc["components"]["schemas"]
    roots = [r for item in doc["paths"].values() for op in item.values()
             for code, answer in op.get("responses", {}).items() if code.startswith("2")
             for r in _refs(answer.get("content", {}).get("application/json", {}).get("schema", {}))]
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in _refs(components[name].get("properties", {})):
            if dep != name:
                visit(dep)
        order.append(name)

    for name in roots:
        visit(name)
    out = ['"""The JSON answers of the v1 API as TypedDicts (generated from openapi/openapi.json by',
           "``make openapi``; do not edit: tests/test_client_notebook.py checks it is in sync).",
           '"""', "", "from __future__ import annotations", "",
           "from typing import Any, Literal, Optional, TypedDict, Union", "", "",
           "__all__ = ["] + [f'    "{n}",' for n in sorted(order)] + ["]", ""]
    for name in order:
        schema = components[name]
        fields = {k: _annotation(v) for k, v in schema.get("properties", {}).items()}
        out.append("")
        if all(k.isidentifier() and not keyword.iskeyword(k) for k in fields):
            out.append(f"class {name}(TypedDict):")
            doc_line = schema.get("description", "").strip().splitlines()
            if doc_line:
                out.append(f'    """{doc_line[0].rstrip(".").replace(chr(34) * 3, "")}."""')
            out.extend(f"    {k}: {v}" for k, v in fields.items())
            if not fields and not doc_line:
                out.append("    pass")
        else:
            out.append(f'{name} = TypedDict("{name}", {{')
            out.extend(f'    "{k}": {v},' for k, v in fields.items())
            out.append("})")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    text = document()
    PATH.write_text(text)
    TYPES_PATH.write_text(api_types(json.loads(text)))
    print(f"wrote {PATH} and {TYPES_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
