"""The package layout's rules (docs/design.md, "Module map"), checked on the source itself.

- no library module imports ``ddiloco_geo.cli`` (the CLI is on top);
- imports of the package's own modules sit at module level, not inside functions;
- no module imports a private (``_name``) from another package;
- no module is longer than MAX_LINES;
- every module has a docstring;
- imports point one way between packages (LAYERS: a package imports only packages at or below it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "ddiloco_geo"
MAX_LINES = 450
# lower index = lower layer; a module may import its own package and any package of a lower layer
LAYERS = [{"core"}, {"codec"}, {"storage"}, {"metrics"}, {"protocol"}, {"learner", "syncer"}, {"ops"}, {"tools"}, {"cli"}]


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, ".".join(parts), ast.parse(path.read_text())


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _own_imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddiloco_geo"):
            yield node, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ddiloco_geo"):
                    yield node, a.name, []


def _layer(package: str | None) -> int:
    return next((i for i, layer in enumerate(LAYERS) if package in layer), -1)


def test_no_library_module_imports_the_cli():
    bad = [f"{mod} imports {target}" for path, mod, tree in _modules() if not mod.startswith("ddiloco_geo.cli")
           and mod != "ddiloco_geo.__main__"
           for _, target, names in _own_imports(tree)
           if target.startswith("ddiloco_geo.cli") or (target == "ddiloco_geo" and "cli" in names)]
    assert not bad, bad


def test_own_imports_sit_at_module_level():
    bad = [f"{mod}:{node.lineno} {target}" for path, mod, tree in _modules()
           for node, target, _ in _own_imports(tree) if node.col_offset > 0]
    assert not bad, bad


def test_no_private_name_from_another_package():
    bad = []
    for path, mod, tree in _modules():
        for node, target, names in _own_imports(tree):
            if _package(target) != _package(mod):
                bad += [f"{mod} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


def test_imports_point_one_way():
    bad = []
    for path, mod, tree in _modules():
        own = _package(mod)
        if own == "__main__":  # the entry point, above everything
            continue
        for _, target, names in _own_imports(tree):
            targets = [_package(target)] if _package(target) else names  # "from ddiloco_geo import codec"
            for t in targets:
                if t in {"__version__"} or t == own:
                    continue
                if _layer(t) > _layer(own) and own is not None:
                    bad.append(f"{mod} ({own}) imports {t}")
    assert not bad, bad


def test_modules_are_short_and_documented():
    long = [f"{mod}: {len(path.read_text().splitlines())} lines" for path, mod, tree in _modules()
            if len(path.read_text().splitlines()) > MAX_LINES]
    undocumented = [mod for path, mod, tree in _modules() if not ast.get_docstring(tree) and path.stat().st_size > 200]
    assert not long, long
    assert not undocumented, undocumented
