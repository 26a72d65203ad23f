"""The package layout's promises, read from the source: imports flow downward (function-level
imports included), the layers below the Flower adapter never import Flower, the strategy stays a
thin shell over the run, and the run's state changes only in the run's apply step (and cannot be
changed from outside: the state is a read-only view)."""

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from corrflow.run.ledger import Ledger
from corrflow.run.state import RunState, RunView

PACKAGE = Path(__file__).parent.parent / "corrflow"

#: Layer of each top-level module or package, bottom up. A module may import its own package and
# lower layers only; packages on one layer do not import each other (strategies never import
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
    # the noise node's party: its protocol module is what the secure driver (strategies) and the
    # guard mod (clients) share; it uses the run's secure-sum grid
    "noisenode": 6.5,
    "strategies": 7,
    "clients": 7,
    "server": 8,
    "cli": 9,
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
        if path == PACKAGE / "server" / "cli.py":  # the CLI's former home re-exports corrflow.cli
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


#: The packages that know nothing of Flower: everything below the adapter (strategies/, clients/).
FLOWER_FREE = ("factorization", "noise", "accounting", "participation", "planning", "run")


@pytest.mark.parametrize("package", FLOWER_FREE)
def test_flower_free_packages_import_no_flwr(package):
    wrong = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            wrong += [
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] == "flwr"
            ]
    assert not wrong, wrong


def test_the_flower_free_run_loads_without_flower():
    """Importing the run (and everything it imports) loads no Flower module — in a fresh process,
    since this one has Flower loaded already."""
    code = (
        "import sys, corrflow.run, corrflow.run.core; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'flwr'); print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_strategies_is_the_flower_adapter_only():
    modules = sorted(p.name for p in (PACKAGE / "strategies").glob("*.py"))
    # 9: secagg.py, the SecAgg+ server driver, speaks Flower's message format (its Flower-free
    # numbers live in corrflow/run/secure_sum.py); 10: wire.py, the record of every reply the server
    # received under SecAgg+ (the report's server_saw is derived from it)
    assert len(modules) <= 10, modules


def test_the_strategy_is_a_thin_shell():
    tree = _source("strategies/correlated.py")
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CorrelatedNoiseStrategy"
    )
    assert _statements(cls) <= 80
    long = []
    for path in sorted([*(PACKAGE / "strategies").glob("*.py"), *(PACKAGE / "run").glob("*.py")]):
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


def _assigned_state(func: ast.FunctionDef) -> list[str]:
    """Attributes assigned in ``func`` on anything that names the run's state or ledger: ``s.x``,
    ``state.x``, ``self._state.x``, ``self.run.state.next_round``, ``….ledger.x``, …"""
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
                if not isinstance(elt, ast.Attribute):
                    continue
                owner = ast.unparse(elt.value)
                if owner == "s" or owner.split(".")[-1] in ("state", "_state", "ledger"):
                    out.append(f"{owner}.{elt.attr}")
    return out


def test_run_state_changes_only_in_the_runs_apply_step():
    """No module assigns an attribute of the run's state (or its ledger) but ``Run._apply`` and the
    round it applies (the state a run starts from is built, not assigned); and nothing outside
    corrflow/run/ reaches the run's private state."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            assigned = _assigned_state(func)
            if assigned and not (rel == "run/core.py" and func.name in ("_apply", "_apply_round")):
                wrong.append(f"{rel}:{func.lineno} {func.name} assigns {assigned}")
        if not rel.startswith("run/"):
            wrong += [
                f"{rel}:{n.lineno} reaches {n.attr}"
                for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and n.attr in ("_state", "_recorder", "_keys")
            ]
    assert not wrong, wrong


def test_the_run_state_is_read_only_outside_the_run(tmp_path):
    """What the strategy (or anyone) reads is a view: assigning, appending or writing an array
    raises, and the view reads through (a round's change shows without a new view)."""
    state = RunState([np.zeros(3, np.float32)], [np.zeros(3, np.float32)], Ledger())
    state.ledger.record_round(0, ["a", "b"], [], [], [], None)
    view = RunView(state)
    with pytest.raises(AttributeError):
        view.next_round += 0
    with pytest.raises(AttributeError):
        view.ledger.epsilon_history.append(None)
    with pytest.raises(AttributeError):
        view.ledger.selected["a"].append(3)
    with pytest.raises(TypeError):
        view.ledger.selected["c"] = [1]
    with pytest.raises(AttributeError):
        view.ledger.rounds_completed = 5
    with pytest.raises(ValueError):
        view.params[0][0] = 1.0
    with pytest.raises(AttributeError):
        view.metrics_history.append({})
    state.ledger.record_round(1, ["a"], [], [], [], None)
    assert view.ledger.selected == {"a": [0, 1], "b": [0]} and view.ledger.selected["a"] == [0, 1]
    assert {"a": [0, 1], "b": [0]} == view.ledger.selected


def test_the_noise_stream_and_disclosure_are_read_only_outside_the_run(tmp_path):
    """``Run.noise`` and ``Run.disclosure`` are facts: nothing outside the run can draw, skip or
    save a noise row (which would put the stream out of step with the checkpointed state) or append
    to the operator's files; what they report reads through as rounds pass."""
    from strategy_support import HANDLERS, KEY, small_config

    from corrflow.server.app import run_server
    from corrflow.server.inprocess import InProcessGrid

    seen = []

    def facts(strategy, metrics):
        noise = strategy.run.noise
        seen.append((noise.next_round, noise.segments.segment_for(0).first_round, noise.lost))
        for name in ("skip", "add", "save", "generator"):
            assert not hasattr(noise, name)
        with pytest.raises(AttributeError):
            noise.skip(noise.next_round)
        with pytest.raises(AttributeError):
            noise.next_round = 0
        disclosure = strategy.run.disclosure
        for name in ("record_round", "stop_reason", "public_report"):
            assert not hasattr(disclosure, name)
        assert disclosure.secret is False and disclosure.operator_dir == tmp_path / "operator"
        assert disclosure.public_metrics(metrics) == metrics

    s = run_server(
        InProcessGrid(HANDLERS, 12),
        small_config(tmp_path, num_rounds=2, epochs=1),
        noise_key=KEY,
        quiet=True,
        on_round_end=facts,
    )
    assert seen == [(1, 0, None), (2, 0, None)]
    bands = s.run.plan.factorization.bands
    assert (s.run.noise.mode, s.run.noise.dim) == ("banded", 7)  # 6 weights and a bias
    assert s.run.noise.buffer_bytes == (bands - 1) * 7 * 4  # the last bands − 1 rows, float32
