"""The docs' benchmark and soak tables, written from the committed results.

``python -m benchmarks.docs_tables [--bench bench.json] [--soak soak.json] [--check]``

``benchmarks/results/bench.json`` and ``benchmarks/results/soak.json`` are the latest full
``make bench`` and ``make soak`` kept in the repository; ``--bench`` / ``--soak`` first
copy a new run's file there. Each table is rewritten between its marker comments
(``<!-- docs_tables:NAME -->`` ... ``<!-- /docs_tables:NAME -->``) in the page that shows
it, with the run's date and its machine (the ``machine`` record the writers keep). The
rows are those the benchmark prints (:func:`benchmarks.run.rows`, :func:`~benchmarks.run.verdict`),
so a page and a terminal never disagree. ``--check`` rewrites nothing and exits 1 when a
page differs from what the results make (``tests/test_docs.py`` does the same).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.run import machine_summary, rows, verdict

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _heading(what: str, res: dict) -> str:
    line = f"{what} of {res.get('started', 'an unknown date')} on {machine_summary(res.get('machine') or {})}."
    if res.get("transcribed"):
        line += " Transcribed from the run's printed lines (its own json was not kept; see the file)."
    return line


def bench_table(res: dict) -> str:
    """``make bench``'s figures: value, target, verdict, and what each was measured against."""
    what = "`make bench`" + (" --quick" if res.get("quick") else "")
    if res.get("wall_s"):
        what += f" ({res['wall_s']:,.0f} s)"
    lines = [_heading(what, res), "",
             "| figure | value | target | verdict | limit / measured against |",
             "|---|---:|---:|---|---|"]
    for name, value, note in rows(res):
        target, mark = verdict(res, name)
        lines.append(f"| `{name}` | {_cell(value)} | {_cell(target)} | {_cell(mark)} | {_cell(note)} |")
    return "\n".join(lines)


def soak_table(res: dict) -> str:
    """``make soak``'s acceptance lines, after what ran."""
    jobs = ", ".join(f"{n} {status}" for status, n in (res.get("jobs") or {}).items())
    what = (f"`make soak` ({res.get('minutes', '?'):g} min, plan {res.get('plan')}, models "
            f"{', '.join(res.get('models') or [])}; jobs: {jobs})")
    lines = [_heading(what, res), "", "| acceptance check | result | detail |", "|---|---|---|"]
    for a in res.get("acceptance") or []:
        lines.append(f"| {_cell(a['check'])} | {'PASS' if a['ok'] else '**FAIL**'} | {_cell(a['detail'])} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Table:
    name: str
    results: Path
    page: Path
    make: Callable[[dict], str]


TABLES = (
    Table("bench", RESULTS / "bench.json", REPO / "docs" / "benchmarks.md", bench_table),
    Table("soak", RESULTS / "soak.json", REPO / "docs" / "operations.md", soak_table),
)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- docs_tables:{name} -->", f"<!-- /docs_tables:{name} -->"


def rewrite(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``name``'s markers replaced by ``block``."""
    start, end = markers(name)
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} in the page")
    return pattern.sub(lambda _: f"{start}\n{block}\n{end}", text, count=1)


def generated(table: Table) -> str:
    """The page as the committed results make it."""
    res = json.loads(table.results.read_text(encoding="utf-8"))
    return rewrite(table.page.read_text(encoding="utf-8"), table.name, table.make(res))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.docs_tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=Path, help="a new run's bench.json, copied to benchmarks/results/ first")
    parser.add_argument("--soak", type=Path, help="a new run's soak.json, copied to benchmarks/results/ first")
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 when a page differs")
    args = parser.parse_args(argv)
    for table in TABLES:
        new_run = getattr(args, table.name)
        if new_run is not None and not args.check:
            shutil.copyfile(new_run, table.results)
    stale = []
    for table in TABLES:
        text = generated(table)
        if text == table.page.read_text(encoding="utf-8"):
            continue
        stale.append(str(table.page.relative_to(REPO)))
        if not args.check:
            table.page.write_text(text, encoding="utf-8")
    verb = "differs from its results" if args.check else "rewritten"
    print("\n".join(f"{page}: {verb}" for page in stale) or "every table is up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
