"""docs/architecture.md says what the code is: it names every module and C source of the package by
its path, names nothing that does not exist, and its layers are tests/test_layers.py's LAYERS,
prefix for prefix."""

from __future__ import annotations

import re
from pathlib import Path

from test_layers import LAYERS

from lockstep.registry import OPS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "lockstep"
DOC = (ROOT / "docs" / "architecture.md").read_text()
# `backends/<backend>/<op>.py` and `ops/<op>.py` stand for one file per op in OPS.
PATTERNS = {"backends/<backend>/<op>.py", "ops/<op>.py"}


def spans(doc: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", doc)


def sources() -> set[str]:
    """Every Python module and C source of the package, as a path relative to src/lockstep."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts}


def named_paths(doc: str) -> set[str]:
    """The spans that name a file or folder of the package: `engine/engine.py`, `numerics/`."""
    return {s for s in spans(doc) if re.fullmatch(r"[\w./<>]+\.(py|c|h|toml|json)|[\w/]+/", s)}


def by_pattern(path: str, named: set[str]) -> bool:
    parts = Path(path).with_suffix("").parts
    if parts[-1] not in OPS:
        return False
    if parts[0] == "backends" and len(parts) == 3:
        return "backends/<backend>/<op>.py" in named
    return parts[0] == "ops" and len(parts) == 2 and "ops/<op>.py" in named


def unnamed(doc: str) -> list[str]:
    named = named_paths(doc)
    return sorted(p for p in sources() if p not in named and not by_pattern(p, named)
                  and not (p.endswith("__init__.py") and p[:-len("__init__.py")] in named))


def stale(doc: str) -> list[str]:
    paths = [s for s in named_paths(doc) - PATTERNS if not (PACKAGE / s).exists()]
    dotted = [s for s in spans(doc) if re.fullmatch(r"lockstep(\.\w+)+", s)]
    gone = [s for s in dotted if not (PACKAGE.joinpath(*s.split(".")[1:]).with_suffix(".py").exists()
                                      or PACKAGE.joinpath(*s.split(".")[1:]).is_dir())]
    return sorted(paths + gone)


def layers(doc: str) -> dict[int, list[str]]:
    """Each '### Layer N' section's 'Holds ...' line: the module prefixes it lists, in order."""
    heads = list(re.finditer(r"^### Layer (\d+)\b.*$", doc, flags=re.M))
    out = {}
    for head, after in zip(heads, heads[1:] + [None]):
        body = doc[head.end():after.start() if after else len(doc)]
        holds = re.search(r"^Holds (.*)$", body, flags=re.M)
        out[int(head.group(1))] = re.findall(r"`(lockstep[\w.]*)`", holds.group(1)) if holds else []
    return out


def test_every_module_and_c_source_is_named():
    assert not unnamed(DOC), f"docs/architecture.md does not name {unnamed(DOC)}"


def test_nothing_named_is_stale():
    assert not stale(DOC), f"docs/architecture.md names what the package does not hold: {stale(DOC)}"


def test_the_layers_are_test_layers_layers():
    assert layers(DOC) == LAYERS


def test_the_checks_catch_a_stale_a_missing_and_a_moved_name():
    drifted = DOC.replace("`engine/scheduler.py`", "`engine/chat.py`")
    assert "engine/chat.py" in stale(drifted) and "engine/scheduler.py" in unnamed(drifted)
    assert "lockstep.fixed_order" in stale(DOC + "\n`lockstep.fixed_order`\n")
    assert layers(DOC.replace("`lockstep.sampling`", "`lockstep.engine`")) != LAYERS
