"""Architecture metrics of src/kvcanary (issue: one shape for the house), printed as JSON.

* ``back_arrows``: imports that run back up the layers ``ops`` <- ``runtime`` <- ``faults`` / ``engines`` <- ``cli``
  (a module importing one of a higher layer; ``faults`` and ``engines`` share a layer but neither imports ``cli``);
* ``cycles``: pairs of modules importing each other (directly, lazy imports included, ``TYPE_CHECKING`` ones not);
* ``long_functions``: functions over 60 lines;
* ``test_monkeypatches``: ``monkeypatch.setattr`` / ``mock.patch`` calls in tests that target a ``kvcanary`` module.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LAYER = {"ops": 0, "runtime": 1, "faults": 2, "engines": 2, "cli": 3}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(mod: str):
    parts = mod.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (type-only imports run no code)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports(path: Path, mod: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvcanary")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("kvcanary"):
                out.add(name)
    return out


def main() -> int:
    graph = {}
    long_functions = []
    for path in sorted(SRC.rglob("*.py")):
        mod = module_name(path)
        graph[mod] = imports(path, mod)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long_functions.append(f"{mod}.{node.name} ({n})")
    back = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    known = set(graph)

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    edges = {a: {resolve(b) for b in deps} - {a, ""} for a, deps in graph.items()}
    cycles = sorted({" <-> ".join(sorted((a, b))) for a, deps in edges.items() for b in deps if a in edges.get(b, ())
                     and not (a.startswith(b + ".") or b.startswith(a + "."))})
    patch = re.compile(r"(monkeypatch\.setattr|mock\.patch(?:\.object)?)\(\s*([\"']kvcanary[\w.]*|[a-z_]+\b)")
    monkeypatches = 0
    for path in (ROOT / "tests").rglob("*.py"):
        for m in patch.finditer(path.read_text()):
            target = m.group(2)
            if target.strip("\"'").startswith("kvcanary") or target not in ("os", "sys", "torch", "time", "builtins"):
                monkeypatches += 1
    print(json.dumps({"back_arrows": back, "cycles": cycles, "long_functions": sorted(long_functions),
                      "counts": {"back_arrows": len(back), "cycles": len(cycles), "long_functions": len(long_functions),
                                 "test_monkeypatches": monkeypatches}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
