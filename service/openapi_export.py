"""Write the app's OpenAPI document to openapi/openapi.json (``make openapi``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from service.app import create_app

PATH = Path(__file__).resolve().parent.parent / "openapi" / "openapi.json"


def document() -> str:
    return json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    PATH.write_text(document())
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
