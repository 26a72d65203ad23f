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
    own = {"--backend", "--fresh", "--verbose", "--json", "--plan", "--help"}
    assert (
        set(options) - own - {surface_name(n, "cli") for n in cli} == set()
    )  # nothing declared twice
    assert (
        options["--users"] == 50 and options["--epochs"] == RunConfig.model_fields["epochs"].default
    )


def test_run_config_keys_and_the_shipped_tables_are_the_models():
    for name in settings_on("run_config"):
        key = surface_name(name, "run_config")
        assert key == "corrflow." + name.replace("_", "-")
    for path in (ROOT / "pyproject.toml", ROOT / "deploy" / "app" / "pyproject.toml"):
        table = tomllib.loads(path.read_text())["tool"]["flwr"]["app"]["config"]["corrflow"]
        cfg = from_run_config(
            {f"corrflow.{k}": v for k, v in table.items()}
        )  # every shipped key is known
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
    assert (
        start["num_rounds"].default is None and start["timeout"].default is None
    )  # the settings' defaults


def test_recipe_fields_map_onto_settings():
    from dataclasses import fields

    from corrflow.planning.recipe import Recipe

    recipe_fields = {f.name for f in fields(Recipe)}
    assert set(recipe_names()) <= recipe_fields
    assert recipe_names()["rounds"] == "num_rounds" and recipe_names()["population"] == "num_users"


def test_one_default_per_setting_and_the_task_dependent_ones_from_one_table():
    cfg = RunConfig()
    assert (cfg.target_epsilon, cfg.noise_multiplier) == (8.0, None)  # ε = 8 when neither is given
    assert (
        RunConfig(noise_multiplier=1.0).target_epsilon is None
    )  # σ given: no budget to calibrate for
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
        DifferentialPrivacyCorrelatedNoise(
            FedAvg(), clip_norm=1.0, state_dir=tmp_path
        )  # the model's name
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
