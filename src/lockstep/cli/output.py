"""What the commands print and write: numbers, tables, and the --json and --html files."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from typing import Callable

from .arguments import UsageError


def fmt(x: float | None) -> str:
    """An error or difference in a table: "1.00e-07", "inf", or "-" for none."""
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.2e}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A text table, each column as wide as its widest cell, under a rule."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def require_extra(extra: str, *modules: str) -> None:
    """A UsageError that names the extra to install when one of `modules` is missing: the optional
    integrations are extras (pyproject.toml), and a command that needs one says so in one line."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise UsageError(f"needs the {extra} extra (pip install 'lockstep[{extra}]'): no module named {name!r}")


def prepare_outputs(args: argparse.Namespace) -> None:
    """Create the folders of --json / --html before any work, so a long run never ends on a missing
    folder."""
    for path in (getattr(args, "json", None), getattr(args, "html", None)):
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise UsageError(f"{'json' if path == getattr(args, 'json', None) else 'html'}: cannot create "
                                 f"the folder of {path} ({e.strerror})") from None
            if not os.access(parent, os.W_OK):
                raise UsageError(f"output: {parent} is not writable")


def write_outputs(args: argparse.Namespace, data: dict, title: str, sections: dict | None = None) -> None:
    """--json writes `data`; --html writes the self-contained report of `sections` (report.build_html's
    keys; by default `data` itself)."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
    if getattr(args, "html", None):
        from ..tools.report import write_html

        write_html(json.loads(json.dumps(data if sections is None else sections, default=str)), args.html, title)
        print(f"report: {args.html}")


def live_status() -> tuple[Callable[[str], None] | None, Callable[[], None]]:
    """(show, clear) for a long command's progress: `show(text)` rewrites one status line on stderr,
    with the seconds since the first call; `clear()` removes it before a result line. On a stderr
    that is not a terminal (a log, CI) show is None and clear does nothing, so logs hold results only."""
    if not sys.stderr.isatty():
        return None, lambda: None
    started: list[float] = []

    def show(text: str) -> None:
        started[:] = started or [time.time()]
        print(f"\r\033[K{text} ({time.time() - started[0]:.0f}s)", end="", file=sys.stderr, flush=True)

    def clear() -> None:
        print("\r\033[K", end="", file=sys.stderr, flush=True)

    return show, clear
