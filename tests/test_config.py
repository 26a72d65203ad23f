"""One settings model, four surfaces: `simulate`'s options, the ServerApp's run-config keys, the
wrapper's keywords and the recipe agree with `corrflow.config.RunConfig` on names and defaults (each
read from the surface itself, not from the model), and errors name the setting as each surface
spells it."""

import inspect
import tomllib
from pathlib import Path

import pytest
import typer

from corrflow import choices
from corrflow.config import (
    TRAINING_DEFAULTS,
    RunConfig,
    from_run_config,
    recipe_names,
    settings_on,
    surface_default,
    surface_name,
)
from corrflow.errors import InvalidArgumentError

ROOT = Path(__file__).parent.parent


def _simulate_options() -> dict[str, object]:
    """flag → default of `corrflow simulate`, as click parsed the command."""
    from corrflow.server.cli import app

    command = typer.main.get_command(app).commands["simulate"]
    return {opt: p.default for p in command.params for opt in p.opts if opt.startswith("--")}


def _plain(value):
    return getattr(value, "value", value)


def test_cli_options_are_the_models_settings_with_its_defaults():
    options = _simulate_options()
    cli = settings_on("cli")
    for name in cli:
        flag = surface_name(name, "cli")
        assert flag in options, flag
        assert _plain(options[flag]) == _plain(surface_default(name, "cli")), flag
    own = {"--backend", "--fresh", "--verbose", "--json", "--plan", "--preset", "--help"}
    own |= {"--noise-multiplier-per-participation"}  # σ in the papers' convention, converted
    # nothing declared twice
    assert set(options) - own - {surface_name(n, "cli") for n in cli} == set()
    assert (
        options["--users"] == 50 and options["--epochs"] == RunConfig.model_fields["epochs"].default
    )


def test_run_config_keys_and_the_shipped_tables_are_the_models():
    for name in settings_on("run_config"):
        key = surface_name(name, "run_config")
        assert key == "corrflow." + name.replace("_", "-")
    for path in (ROOT / "pyproject.toml", ROOT / "deploy" / "app" / "pyproject.toml"):
        table = tomllib.loads(path.read_text())["tool"]["flwr"]["app"]["config"]["corrflow"]
        # every shipped key is known
        cfg = from_run_config({f"corrflow.{k}": v for k, v in table.items()})
        for key, value in table.items():
            assert getattr(cfg, key.replace("-", "_")) == value, (path, key)


def test_wrapper_keywords_and_defaults_come_from_the_model():
    from corrflow import DifferentialPrivacyCorrelatedNoise

    params = inspect.signature(DifferentialPrivacyCorrelatedNoise.__init__).parameters
    wrapper = settings_on("wrapper")
    own = {
        "self",
        "strategy",
        "plan",
        "fresh",
        "canaries",
        "audit_seed",
    }  # the wrapper's, not run settings
    assert {surface_name(n, "wrapper") for n in wrapper} | own == set(params)
    for name in wrapper:
        assert _plain(params[surface_name(name, "wrapper")].default) == _plain(
            surface_default(name, "wrapper")
        )
    assert surface_name("clip_norm", "wrapper") == "clipping_norm"  # Flower's DP wrappers' name
    assert surface_name("server_lr", "wrapper") == "server_learning_rate"
    start = inspect.signature(DifferentialPrivacyCorrelatedNoise.start).parameters
    # the settings' defaults
    assert start["num_rounds"].default is None and start["timeout"].default is None


def test_recipe_fields_map_onto_settings():
    from dataclasses import fields

    from corrflow.planning.recipe import Recipe

    recipe_fields = {f.name for f in fields(Recipe)}
    assert set(recipe_names()) <= recipe_fields
    assert recipe_names()["rounds"] == "num_rounds" and recipe_names()["population"] == "num_users"


def test_one_default_per_setting_and_the_task_dependent_ones_from_one_table():
    cfg = RunConfig()
    assert (cfg.target_epsilon, cfg.noise_multiplier) == (8.0, None)  # ε = 8 when neither is given
    # σ given: no budget to calibrate for
    assert RunConfig(noise_multiplier=1.0).target_epsilon is None
    for client, defaults in TRAINING_DEFAULTS.items():
        got = RunConfig(client=client)
        assert {k: getattr(got, k) for k in defaults} == defaults
    assert (
        RunConfig(seed=7).schedule_seed == 7
        and RunConfig(seed=7, schedule_seed=3).schedule_seed == 3
    )


def test_choices_are_enums_shared_by_the_layers():
    from corrflow.accounting.accountant import ACCOUNTANTS_FOR, SAMPLINGS
    from corrflow.participation.planner import PARTICIPATIONS

    assert tuple(PARTICIPATIONS) == choices.values(choices.Participation)
    assert tuple(SAMPLINGS) == choices.values(choices.Sampling)
    assert {str(k): tuple(map(str, v)) for k, v in ACCOUNTANTS_FOR.items()} == {
        k.value: tuple(a.value for a in v) for k, v in choices.ACCOUNTANTS_FOR.items()
    }
    assert choices.accountants_for_participation("bminsep") == ("unamplified", "monte-carlo")
    assert choices.accountants_for_participation("poisson") == ("mmcc", "monte-carlo")


@pytest.mark.parametrize(
    "surface, values, name",
    [
        ("run_config", {"corrflow.clip-norm": -1.0}, "corrflow.clip-norm"),
        ("run_config", {"corrflow.epochs": True}, "corrflow.epochs"),
        ("run_config", {"corrflow.kind": "nope"}, "corrflow.kind"),
    ],
)
def test_run_config_errors_name_the_key(surface, values, name):
    with pytest.raises(InvalidArgumentError) as err:
        from_run_config(values)
    assert err.value.field == name


def test_wrapper_errors_name_the_keyword(tmp_path):
    from flwr.serverapp.strategy import FedAvg

    from corrflow import DifferentialPrivacyCorrelatedNoise

    with pytest.raises(InvalidArgumentError) as err:
        DifferentialPrivacyCorrelatedNoise(FedAvg(), clipping_norm=-1.0, state_dir=tmp_path)
    assert err.value.field == "clipping_norm"
    with pytest.raises(InvalidArgumentError) as err:
        # the model's name
        DifferentialPrivacyCorrelatedNoise(FedAvg(), clip_norm=1.0, state_dir=tmp_path)
    assert err.value.field == "clip_norm" and "clipping_norm" in err.value.expected


def test_cli_errors_name_the_flag(tmp_path):
    from typer.testing import CliRunner

    from corrflow.server.cli import app

    for args, flag in (
        (["--clip-norm", "-1"], "--clip-norm"),
        (["--epochs", "3"], "--epochs"),
        (["--delta", "2"], "--delta"),
        (["--users", "0"], "--users"),
    ):
        r = CliRunner().invoke(
            app, ["simulate", "--backend", "inprocess", "--out", str(tmp_path / "x"), *args]
        )
        assert r.exit_code == 2 and f"{flag}:" in r.output, (args, r.output)
    assert not (tmp_path / "x").exists()  # nothing written


# -- one vocabulary for every command --------------------------------------------------------------
#: Options a command has under a setting's flag that are not that setting, and why.
_OWN_FLAGS = {
    # --out: what the command writes (simulate's is the run's directory): factorize's .npz file,
    # plan's and compare's output directories
    "factorize": {"--out"},
    "plan": {"--out"},
    "compare": {"--out"},
    "account": {"--seed", "--mc-samples"},  # the Monte Carlo seed and first batch
}


def _command_params(name: str) -> dict[str, object]:
    """flag → click parameter of `corrflow NAME`, as click parsed the command."""
    from corrflow.server.cli import app

    command = typer.main.get_command(app).commands[name]
    return {opt: p for p in command.params for opt in p.opts if opt.startswith("--")}


def _choices(param) -> tuple | None:
    return tuple(param.type.choices) if hasattr(param.type, "choices") else None


@pytest.mark.parametrize("command", ["factorize", "plan", "account", "compare", "audit"])
def test_every_command_shares_simulates_flags_choices_and_defaults(command):
    """Every option of a command under a setting's flag is that setting, with simulate's choices
    and default — or the command's own default, declared by the model and shown by --help."""
    from corrflow.config import command_default_reason

    simulate = _command_params("simulate")
    flags = {surface_name(n, "cli"): n for n in settings_on("cli")}
    params = _command_params(command)
    shared = sorted(set(params) & set(flags) - _OWN_FLAGS.get(command, set()))
    assert len(shared) >= 5, shared
    for flag in shared:
        mine, theirs = params[flag], simulate[flag]
        assert _choices(mine) == _choices(theirs), (command, flag)
        assert mine.type.name == theirs.type.name, (command, flag)
        reason = command_default_reason(flags[flag], command)
        if reason is None:
            assert mine.default == theirs.default, (command, flag)
            assert mine.help == theirs.help, (command, flag)
        elif surface_default(flags[flag], "cli", command) is ...:  # required: no default
            assert mine.required and mine.default is None, (command, flag)
        else:
            assert mine.default == surface_default(flags[flag], "cli", command), (command, flag)
            assert reason in mine.help, (command, flag)


def test_the_issues_shared_settings_are_in_each_command():
    """kind, bands, buffers, epochs, min-sep, participation, momentum, cooldown, δ, ε, σ and the
    accountant, wherever the command has the concept; --client where a default depends on it."""
    expect = {
        "factorize": "--kind --bands --buffers --taper --rounds --epochs --min-sep --participation "
        "--momentum --cooldown-fraction --client",
        "plan": "--users --model-dim --rounds --target-epsilon --delta --momentum "
        "--cooldown-fraction --client",
        "account": "--participation --accountant --noise-multiplier --target-epsilon --delta",
        "compare": "--rounds --users --epochs --epsilons --delta --client",
    }
    for command, flags in expect.items():
        assert set(flags.split()) <= set(_command_params(command)), command
    simulate = _command_params("simulate")
    assert _command_params("factorize")["--participation"].default == "fixed-epoch"
    assert simulate["--client"].default == _command_params("plan")["--client"].default == "numpy"
    assert simulate["--momentum"].default is None  # the client's, in every command


def test_cli_help_shows_a_commands_own_default():
    from typer.testing import CliRunner

    from corrflow.server.cli import app

    r = CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "compare: the preset's" in r.output


def test_factorize_with_defaults_is_the_factorization_simulate_trains_with(tmp_path):
    """`corrflow factorize` with its defaults (and with momentum-relevant flags) writes the arrays
    simulate's planning builds for the same settings (same sha256)."""
    import numpy as np
    from typer.testing import CliRunner

    from corrflow.factorization import Factorization
    from corrflow.planning.run import load_or_build_factorization
    from corrflow.server.cli import app

    for i, (flags, settings) in enumerate(
        [
            ([], {}),
            (
                ["--client", "nextword", "--rounds", "12", "--epochs", "3", "--kind", "banded"],
                {"client": "nextword", "num_rounds": 12, "epochs": 3, "kind": "banded"},
            ),
        ]
    ):
        path = tmp_path / f"f{i}.npz"
        r = CliRunner().invoke(app, ["factorize", "--quiet", "--out", str(path), *flags])
        assert r.exit_code == 0, r.output
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        cfg = RunConfig(state_dir=str(run_dir), **settings)
        ours, theirs = Factorization.load(path), load_or_build_factorization(cfg, run_dir)
        assert ours.sha256() == theirs.sha256()
        assert ours.workload == theirs.workload and ours.workload.momentum == cfg.momentum
        np.testing.assert_array_equal(ours.encoder.matrix(), theirs.encoder.matrix())
    assert Factorization.load(tmp_path / "f0.npz").workload.momentum == 0.5  # numpy's
    assert Factorization.load(tmp_path / "f1.npz").workload.momentum == 0.9  # nextword's


def test_old_spellings_warn_or_are_refused_naming_the_flag(tmp_path):
    from typer.testing import CliRunner

    from corrflow.factorization import Factorization
    from corrflow.server.cli import app

    path = tmp_path / "p.npz"
    r = CliRunner().invoke(
        app, ["factorize", "--quiet", "--rounds", "4", "--workload", "prefix", "--out", str(path)]
    )
    assert r.exit_code == 0 and "--workload is deprecated" in r.output, r.output
    assert Factorization.load(path).workload == Factorization.load(path).workload.prefix()
    r = CliRunner().invoke(app, ["factorize", "--rounds", "4", "--participation", "min-sep"])
    assert r.exit_code == 0 and "use --participation bminsep" in r.output, r.output
    r = CliRunner().invoke(app, ["factorize", "--kind", "nope"])
    assert r.exit_code == 2 and "--kind" in r.output
    common = ["account", "--factorization", str(path), "--noise-multiplier", "1", "--json"]
    old = CliRunner().invoke(app, [*common, "--sampling", "none"])
    new = CliRunner().invoke(app, common)
    assert old.exit_code == new.exit_code == 0, old.output
    assert "--sampling none is deprecated: use --participation fixed-epoch" in old.output
    assert old.output.splitlines()[-1] == new.output.splitlines()[-1]
    r = CliRunner().invoke(app, [*common, "--sampling", "bminsep", "--participation", "bminsep"])
    assert r.exit_code == 2 and "--sampling" in r.output


def test_min_sep_zero_is_the_participations_own():
    """min-sep 0 means the participation's own separation: rounds/epochs for fixed-epoch, 1 for
    poisson (which the rules require); another value for poisson is still refused."""
    assert RunConfig(num_rounds=4, participation="poisson").min_sep == 1
    assert RunConfig(num_rounds=4, participation="poisson").b == 1
    assert RunConfig(num_rounds=4, epochs=2).b == 2
    with pytest.raises(InvalidArgumentError, match="min-sep"):
        RunConfig(num_rounds=4, participation="poisson", min_sep=2)
