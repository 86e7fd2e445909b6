"""The README's notebook block, run as written against a fresh ``embgeom serve``.

Every line of the block runs, top-level ``await`` included, with two substitutions only:
the service's URL (a free port) and ``corpus.txt`` (BBC paragraphs written to a file). The
service is fresh: its API has loaded no model, so ``compare_global`` with an ``input``
space is the first call that runs MiniLM in the API, and must answer, not raise a 503.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import re
from pathlib import Path

from embgeom.testing.serve import ServiceProcess

README = Path(__file__).resolve().parents[1] / "README.md"
URL_IN_README = "http://127.0.0.1:8080"


def notebook_block() -> str:
    """The README's first python block under "The client in a notebook"."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The client in a notebook"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_notebook_block_runs_as_written_on_a_fresh_service(tmp_path):
    from embgeom.corpora import bbc_texts

    block = notebook_block()
    assert URL_IN_README in block and 'open("corpus.txt"' in block and "compare_global" in block
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(bbc_texts("paragraphs")[:120]), encoding="utf-8")
    proc = ServiceProcess.serve(data_dir=tmp_path / "data", log_path=tmp_path / "serve.log").start()
    url = proc.url
    code = block.replace(URL_IN_README, url).replace('"corpus.txt"', repr(str(corpus)))
    try:
        proc.wait_ready()
        compiled = compile(code, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        scope: dict = {}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = eval(compiled, scope)  # a coroutine: the block awaits at top level
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        # What the block's lines left behind, checked rather than only run.
        assert [s["status"] for s in scope["client"].wait(scope["jobs"])] == ["done"]
        assert printed.getvalue().startswith("404 collection_not_found"), printed.getvalue()
        frame = scope["frame"]
        assert len(frame) == 7 and list(frame["layer"]) == list(range(7))
        compared = scope["client"].compare_global("demo:minilm:3", "demo:minilm:input")
        assert compared["shared_tokens"] > 0 and 0.0 < compared["pearson_cosine"] <= 1.0
    finally:
        proc.terminate()
