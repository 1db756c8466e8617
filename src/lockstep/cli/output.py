"""What the commands print and write: numbers, tables, and the --json and --html files."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

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


class LiveStatus:
    """A long command's progress on one status line of stderr, rewritten by `show(text)` with the
    seconds since the first; `say(line)` prints a result line on stdout, clearing the status first.
    On a stderr that is not a terminal (a log, CI) `active` is False and only results are printed."""

    def __init__(self):
        self.active = sys.stderr.isatty()
        self.started: float | None = None

    def show(self, text: str) -> None:
        if not self.active:
            return
        self.started = self.started or time.time()
        print(f"\r\033[K{text} ({time.time() - self.started:.0f}s)", end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.active:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def say(self, line: str) -> None:
        self.clear()
        print(line, flush=True)
