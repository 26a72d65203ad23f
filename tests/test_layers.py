"""The package layout's promises, read from the source: imports flow downward (function-level
imports included), the strategy stays a thin shell over the round core, and run state changes only
in the recorder's apply step."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "corrflow"

#: Layer of each top-level module or package, bottom up. A module may import its own package and
# lower layers : only; packages on one layer do not import each other (strategies never import
# clients, nor clients strategies).
LAYERS = {
    "errors": 0,
    "fileio": 1,
    "progress": 1,
    "choices": 1,
    "protocol": 1,
    "paths": 1,
    "hashing": 1,
    "schemas": 1,
    "factorization": 2,
    "noise": 3,
    "accounting": 3,
    "participation": 3,
    "data": 4,
    "config": 4,
    "planning": 5,
    "run": 6,
    "strategies": 7,
    "clients": 7,
    "server": 8,
}


def _unit(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, corrflow unit) of every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [
                f"{node.module}.{a.name}" for a in node.names if node.module == "corrflow"
            ]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "corrflow" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def test_every_module_has_a_layer():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert units <= set(LAYERS), units - set(LAYERS)


def test_imports_flow_downward():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":  # the package root re-exports lazily for users
            continue
        unit = _unit(path)
        for line, target in _imports(path):
            if target == unit or target not in LAYERS:
                continue
            if LAYERS[target] >= LAYERS[unit]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({unit}) imports {target}")
    assert not wrong, "\n".join(wrong)


def _source(rel: str) -> ast.Module:
    return ast.parse((PACKAGE / rel).read_text())


def _statements(node: ast.AST) -> int:
    """Statements inside ``node``, docstrings excluded: a size independent of the layout."""
    return (
        sum(
            isinstance(n, ast.stmt)
            and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            for n in ast.walk(node)
        )
        - 1
    )


def test_the_strategy_is_a_thin_shell():
    tree = _source("strategies/correlated.py")
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CorrelatedNoiseStrategy"
    )
    assert _statements(cls) <= 80
    long = []
    for path in sorted((PACKAGE / "strategies").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            size = _statements(node) if isinstance(node, ast.FunctionDef) else 0
            if size > 45:
                long.append(f"{path.name}:{node.lineno} {node.name}: {size} statements")
    assert not long, long


def _assigned_attributes(func: ast.FunctionDef, owner: str) -> list[str]:
    """Attributes of ``owner`` (``self`` or ``self.state``-like chains) assigned in ``func``."""
    out = []
    for node in ast.walk(func):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for t in targets:
            for elt in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(elt, ast.Attribute) and ast.unparse(elt.value) == owner:
                    out.append(elt.attr)
    return out


@pytest.mark.parametrize(
    "rel, cls",
    [
        ("strategies/correlated.py", "CorrelatedNoiseStrategy"),
        ("strategies/wrapper.py", "DifferentialPrivacyCorrelatedNoise"),
    ],
)
def test_strategies_assign_no_state_outside_their_constructor(rel, cls):
    node = next(n for n in _source(rel).body if isinstance(n, ast.ClassDef) and n.name == cls)
    wrong = [
        f"{f.name}: self.{a}"
        for f in node.body
        if isinstance(f, ast.FunctionDef) and f.name != "__init__"
        for a in _assigned_attributes(f, "self")
        if not (cls.startswith("Differential") and a == "core")
    ]
    assert not wrong, wrong


def test_run_state_changes_only_in_the_recorders_apply_step():
    """Outside the recorder no module assigns an attribute of the run's state; inside it only apply
    and the round it applies do (the state a run starts from is built, not assigned)."""
    wrong = []
    for path in sorted((PACKAGE / "strategies").glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            assigned = (
                _assigned_attributes(func, "s")
                + _assigned_attributes(func, "self.state")
                + _assigned_attributes(func, "state")
            )
            if assigned and not (
                path.name == "recorder.py" and func.name in ("apply", "_apply_round")
            ):
                wrong.append(f"{path.name}:{func.lineno} {func.name} assigns {assigned}")
    assert not wrong, wrong
