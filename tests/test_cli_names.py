"""One flag per concept across the commands, and the deprecated spellings that still map to it.

In process (typer's CliRunner, click's own parser): nothing here tests process isolation.
"""

from __future__ import annotations

import json

import click
import pytest
import typer
from typer.testing import CliRunner

from corrflow.choices import Participation
from corrflow.cli import app
from corrflow.cli.aliases import RENAMED_FLAGS, RENAMED_VALUES, rewrite
from corrflow.cli.options import COMMAND_SETTINGS, config_from_cli, param_name
from corrflow.cli.plan import _plan_settings
from corrflow.config import RunConfig
from corrflow.factorization.participation import Participation as Schema
from corrflow.factorization.sensitivity import brute_force_sensitivity
from corrflow.planning.run import build_factorization, participation_of

ROOT = typer.main.get_command(app)

#: Spellings of one concept: a command's visible options hold at most one of each group.
CONCEPTS = {
    "users": {"--users", "--population", "--num-users"},
    "model dimension": {"--model-dim", "--model-params"},
    "cohort": {"--cohort", "--cohort-size"},
    "ε": {"--epsilons", "--epsilon", "--target-epsilon"},
    "verbosity": {"--verbose", "--quiet", "-v", "-q"},
}
#: Spellings no command shows; a command's own renamed flags join them for that command (data
# vocab's --epsilon is the vocabulary's own ε, not compare's old spelling).
RETIRED = {"--population", "--num-users", "--model-params", "--cohort-size"}


def _commands(group: click.Group = ROOT, path: tuple[str, ...] = ()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def _params(command: str, args: list[str]) -> dict:
    """The values click parses for ``corrflow COMMAND ARGS`` (deprecated spellings rewritten)."""
    cmd = ROOT.commands[command]
    with cmd.make_context(command, list(args)) as ctx:
        return dict(ctx.params)


def _settings(params: dict) -> dict:
    """The settings among a plan's parsed values (its own --out is no run's --out)."""
    names = {param_name(name) for name in COMMAND_SETTINGS["plan"]}
    return {key: value for key, value in params.items() if key in names}


def _help(*command: str) -> str:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    return res.output


def test_plan_help_names_users_and_model_dim_only():
    text = _help("plan")
    assert "--users" in text and "--model-dim" in text and "--cohort " in text
    for old in ("--population", "--model-params", "--cohort-size", "--num-users"):
        assert old not in text


@pytest.mark.parametrize("path, cmd", [pytest.param(*c, id=" ".join(c[0])) for c in _commands()])
def test_no_command_shows_two_names_for_one_concept(path, cmd):
    names = {
        name
        for p in cmd.params
        if isinstance(p, click.Option) and not p.hidden
        for name in (*p.opts, *p.secondary_opts)
    }
    old = RETIRED | set(RENAMED_FLAGS.get(" ".join(path), {}))
    assert not names & old, (path, names & old)
    for concept, spellings in CONCEPTS.items():
        options = [p for p in cmd.params if set(p.opts) & spellings]
        assert len(options) <= 1, (path, concept, [p.opts for p in options])
    help_text = _help(*path)
    assert not any(f"{flag} " in help_text for flag in old), path


@pytest.mark.parametrize(
    "command, old, new, base",
    [
        ("plan", ["--population", "300"], ["--users", "300"], ["--cohort", "10"]),
        ("plan", ["--num-users", "300"], ["--users", "300"], ["--cohort", "10"]),
        (
            "plan",
            ["--model-params", "4096"],
            ["--model-dim", "4096"],
            ["--users", "3", "--cohort", "1"],
        ),
        ("plan", ["--cohort-size=30"], ["--cohort=30"], ["--users", "300"]),
        ("compare", ["--target-epsilon", "4"], ["--epsilons", "4"], []),
        ("compare", ["--epsilon", "4"], ["--epsilons", "4"], []),
        ("compare", ["--num-users", "120"], ["--users", "120"], []),
        ("simulate", ["--num-users", "60"], ["--users", "60"], []),
        ("audit", ["--num-users", "60"], ["--users", "60"], []),
        ("factorize", ["--participation", "min-sep"], ["--participation", "bminsep"], []),
        ("simulate", ["--participation=MIN-SEP"], ["--participation=bminsep"], []),
        ("account", ["--participation", "min-sep"], ["--participation", "bminsep"], []),
    ],
)
def test_old_spelling_warns_and_maps_to_the_new(capsys, command, old, new, base):
    extra = ["--factorization", "f.npz"] if command == "account" else []
    with_new = _params(command, [*base, *extra, *new])
    assert capsys.readouterr().err == ""
    with_old = _params(command, [*base, *extra, *old])
    warning = capsys.readouterr().err
    assert "deprecated" in warning and new[0].split("=")[0] in warning, warning
    assert with_old == with_new


def test_renamed_plan_flags_give_the_same_plan_settings(capsys):
    common = ["--rounds", "20", "--target-epsilon", "4"]
    new = _params("plan", [*common, "--users", "300", "--cohort", "30", "--model-dim", "4096"])
    old = _params(
        "plan",
        [*common, "--population", "300", "--cohort-size", "30"]
        + [
            "--model-params",
            "4096",
        ],
    )
    assert "use --users" in capsys.readouterr().err
    assert _plan_settings(_settings(old)) == _plan_settings(_settings(new))
    cfg, users, model_dim = _plan_settings(_settings(old))
    assert (users, model_dim, cfg.num_rounds, cfg.target_epsilon) == (300, 4096, 20, 4.0)
    assert old["cohort"] == 30


def test_simulate_config_from_min_sep_is_bminsep(capsys):
    old = config_from_cli(_params("simulate", ["--participation", "min-sep", "--rounds", "8"]))
    new = config_from_cli(_params("simulate", ["--participation", "bminsep", "--rounds", "8"]))
    assert old == new and old.participation == Participation.BMINSEP
    err = capsys.readouterr().err
    assert "--participation min-sep is deprecated: use --participation bminsep" in err
    assert "b-min-separation" in err  # the warning names what min-sep meant when published


def test_one_setting_under_two_spellings_is_refused():
    res = CliRunner().invoke(app, ["plan", "--users", "10", "--population", "20", "--cohort", "1"])
    assert res.exit_code == 2 and "--population" in res.output and "--users" in res.output
    res = CliRunner().invoke(app, ["compare", "--epsilon", "8", "--target-epsilon", "4"])
    assert res.exit_code == 2 and "give --epsilons once" in res.output


def test_rewrite_leaves_values_and_positionals_alone():
    args = ["--population=3", "--kinds", "dense", "--", "--population"]
    out, warnings = rewrite(args, {"--population": "--users"}, RENAMED_VALUES)
    # "--population" after "--" is a positional: untouched
    assert out == ["--users=3", "--kinds", "dense", "--", "--population"] and len(warnings) == 1


def test_participation_min_sep_warns_and_runs(tmp_path):
    """`factorize --participation min-sep` builds the factorization `--participation bminsep`
    builds (the b-min-separation schema of the first `corrflow factorize`), bit for bit."""
    runner = CliRunner()
    common = ["factorize", "--rounds", "8", "--epochs", "2", "--kind", "toeplitz", "--json", "-q"]
    old = runner.invoke(app, [*common, "--participation", "min-sep", "--out", str(tmp_path / "o")])
    new = runner.invoke(app, [*common, "--participation", "bminsep", "--out", str(tmp_path / "n")])
    assert old.exit_code == new.exit_code == 0, old.output
    assert "--participation min-sep is deprecated" in old.output
    old_summary = json.loads(old.stdout.strip().splitlines()[-1])
    new_summary = json.loads(new.stdout.strip().splitlines()[-1])
    for summary in (old_summary, new_summary):  # where it was written, and how long it took
        del summary["path"], summary["seconds"]
    assert old_summary == new_summary and old_summary["participation"] == "min-sep"


def test_min_sep_is_never_weaker_than_fixed_epoch_for_a_non_banded_factorization():
    """The participation min-sep maps to bounds the sensitivity over every b-separated pattern: for
    a dense (non-banded) encoder at least the fixed-epoch value, and at least the brute-force
    maximum over the b-min-sep patterns — the reading `fixed-epoch` would understate."""
    mapped = RENAMED_VALUES[("--participation", "min-sep")][0]
    cfg = RunConfig(kind="dense", num_rounds=6, epochs=2, participation="fixed-epoch", momentum=0.0)
    fac = build_factorization(cfg, tol=1e-3)
    schema = participation_of(cfg.replace(participation=mapped))
    assert (schema.kind, schema.min_sep, schema.max_participations) == ("min-sep", 3, 2)
    C = fac.encoder.matrix()
    fixed = fac.encoder.sensitivity(participation_of(cfg)).value
    under_min_sep = fac.encoder.sensitivity(schema).value
    brute = brute_force_sensitivity(C, Schema.min_separation(6, 3, 2))
    assert under_min_sep >= brute - 1e-9 and brute > fixed + 1e-6
