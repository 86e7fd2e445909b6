"""The base install is the client: ``pip install embgeom`` (no extras), from this tree into a
fresh virtual environment, brings no torch, and the client and its commands run there.

pip resolves the base dependencies from the package index, as a user's install does. The
tree is copied first (what the Dockerfiles copy), so the build writes nothing into the
repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from embgeom.store.server import free_port
from embgeom.testing.serve import REPO

CLIENT_IMPORTS = """
import sys
import embgeom.api_types, embgeom.client, embgeom.errors, embgeom.inputs, embgeom.tables
server = {"torch", "transformers", "fastapi", "redis", "numpy", "matplotlib"} & set(sys.modules)
assert not server, server
print(embgeom.client.__file__)
"""


def _run(args, cwd, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_base_install_is_the_client_without_torch(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for package in ("embgeom", "service"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", venv], tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"

    installed = _run([python, "-m", "pip", "install", "--quiet", src], tmp_path, timeout=600)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    imported = _run([python, "-c", CLIENT_IMPORTS], tmp_path)  # not the tree's copy: cwd is tmp
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(str(venv)), imported.stdout
    assert _run([python, "-m", "pip", "show", "torch"], tmp_path).returncode != 0

    # A client command runs up to its request: settings, client and table code all there.
    table = _run([venv / "bin" / "embgeom", "table", "--collection", "c", "--model", "minilm",
                  "--url", f"http://127.0.0.1:{free_port()}"], tmp_path)
    assert table.returncode == 1 and table.stderr.startswith("embgeom table:"), table.stderr
    report = _run([venv / "bin" / "embgeom", "report", "--collection", "c", "--model", "minilm",
                   "--out", tmp_path / "report", "--url", f"http://127.0.0.1:{free_port()}"], tmp_path)
    assert report.returncode == 1 and report.stderr.startswith("embgeom report:"), report.stderr
