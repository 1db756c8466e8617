"""The package's structure: one-way layers, no import cycles, no private names across modules, and
an `import lockstep` that loads only what it says it loads (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "lockstep"

# Lower layers never import higher ones. A module's layer is that of its longest listed prefix.
LAYERS = {
    0: ["lockstep.registry", "lockstep.numerics", "lockstep.rotary", "lockstep.paged_cache", "lockstep.checks",
        "lockstep.autocast", "lockstep.contract", "lockstep.mismatch"],
    1: ["lockstep.ops", "lockstep.backends"],
    2: ["lockstep.harness", "lockstep.model", "lockstep.sampling", "lockstep.machine"],
    3: ["lockstep.engine", "lockstep.train", "lockstep.dist", "lockstep.mode", "lockstep.integrations.hf"],
    4: ["lockstep.tools", "lockstep.parity", "lockstep.integrations", "lockstep.rl", "lockstep.server"],
    5: ["lockstep.cli", "lockstep.__main__", "lockstep"],
}
# Same-layer groups that must not import each other: the public ops reach the backends only
# through the registry, and no backend builds on another.
APART = [("lockstep.ops", "lockstep.backends")] + [
    (f"lockstep.backends.{a}", f"lockstep.backends.{b}") for a in ("portable", "triton", "eager", "reference")
    for b in ("portable", "triton", "eager", "reference") if a != b]
# Import cycles that are accepted (none: the trainer imports lockstep.dist, never the reverse).
KNOWN_CYCLES: list[set[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in module `name`, function-level
    imports and those under `if TYPE_CHECKING:` included."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if is_package(name) else name.rpartition(".")[0]
    out = []
    # Imports under `if TYPE_CHECKING:` count: an annotation is a dependency for whoever reads the module.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("lockstep")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("lockstep"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:                         # `from . import ops` imports a module
                    out.append((sub, [], node.lineno))
                else:
                    out.append((target, [alias.name], node.lineno))
    return out


def layer(name: str) -> int:
    best, rank = -1, None
    for r, prefixes in LAYERS.items():
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), r
    assert rank is not None, f"{name} is in no layer of tests/test_layers.py"
    return rank


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_no_module_imports_from_a_layer_above_it():
    bad = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)}) at line {line}"
           for m in MODULES for t, _, line in imports(m) if layer(t) > layer(m)]
    assert not bad, "\n".join(bad)


def test_apart_groups_do_not_import_each_other():
    bad = [f"{m} imports {t} at line {line}" for m in MODULES for t, _, line in imports(m)
           for a, b in APART if within(m, a) and within(t, b)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in imports(m) if t in MODULES and t != m and not within(m, t)} for m in MODULES}
    cycles = []

    def visit(node, path, on_path):
        for nxt in graph[node]:
            if nxt in on_path:
                cycle = path[path.index(nxt):]
                if set(cycle) not in KNOWN_CYCLES and set(cycle) not in cycles:
                    cycles.append(set(cycle))
            elif nxt not in done:
                visit(nxt, path + [nxt], on_path | {nxt})
        done.add(node)

    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m], {m})
    assert not cycles, cycles


def test_an_import_for_annotations_only_still_counts(tmp_path, monkeypatch):
    # A circle closed by an import under `if TYPE_CHECKING:` is still a circle for its reader.
    fake = tmp_path / "annotated.py"
    fake.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .engine import Engine\n")
    monkeypatch.setitem(MODULES, "lockstep.engine.annotated", fake)
    assert ("lockstep.engine.engine", ["Engine"], 4) in imports("lockstep.engine.annotated")


def test_no_private_names_cross_modules():
    bad = []
    for m in MODULES:
        for t, names, line in imports(m):
            if t.rpartition(".")[2].startswith("_") and not t.endswith("__main__"):
                bad.append(f"{m}:{line} imports the private module {t}")
            bad += [f"{m}:{line} imports the private name {t}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
        # module._name through an imported lockstep module
        tree = ast.parse(MODULES[m].read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name
        local = {n for t, _, _ in imports(m) for n in [t.rpartition(".")[2]]}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.value.id in aliases and node.value.id in local):
                bad.append(f"{m}:{node.lineno} uses the private name {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_import_lockstep_loads_no_backend_model_or_mode():
    code = ("import sys, lockstep; loaded = sorted(m for m in sys.modules if m.startswith('lockstep')); "
            "print(' '.join(loaded))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in
             ("backends", "model", "engine", "train", "dist", "mode", "integrations", "harness", "parity", "tools")]
    assert "lockstep.ops" in loaded and not heavy, loaded


def test_a_backend_loads_on_first_use_and_registers_every_op_it_claims():
    code = ("import sys, torch, lockstep; from lockstep import ops; "
            "assert 'lockstep.backends.portable' not in sys.modules; "
            "ops.silu_mul(torch.ones(2, 3), torch.ones(2, 3)); "
            "from lockstep import registry; print(sorted(registry.registered('portable')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "silu_mul" in out.stdout and "attention" in out.stdout


@pytest.mark.parametrize("name", ["batch_invariant", "enable", "disable", "patch", "Engine", "load_model"])
def test_lazy_public_names_resolve(name):
    import lockstep

    assert callable(getattr(lockstep, name))
