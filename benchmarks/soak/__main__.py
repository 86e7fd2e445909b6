"""``python -m benchmarks.soak``: one soak, its table printed, ``soak.json`` written; the exit
status is 1 when an acceptance line fails."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import benchmarks.soak as package
from benchmarks.soak.harness import run
from benchmarks.soak.plan import PLANS, REPO
from benchmarks.soak.report import table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 20)))
    parser.add_argument("--plan", choices=sorted(PLANS), default="full")
    parser.add_argument("--json", default=os.environ.get("SOAK_JSON", str(REPO / "soak.json")))
    parser.add_argument("--keep", action="store_true", help="keep the tmp folder (logs, AOF)")
    args = parser.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: the children (own sessions) are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(args.minutes, args.plan, Path(args.json), keep=args.keep)
    print(table(res))
    print(f"\nwrote {args.json}")
    return 0 if all(a["ok"] for a in res["acceptance"]) else 1


if __name__ == "__main__":
    sys.exit(main())
