"""The settings of a run that ``corrflow simulate`` and ``corrflow audit`` start: flags, a preset, a
plan's recipe and a dataset file's defaults, checked before anything is written."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from corrflow.accounting.noise_scale import resolve_noise_multiplier
from corrflow.accounting.policy import RunAccounting
from corrflow.cli.common import as_flag
from corrflow.cli.options import config_from_cli, given_on_command_line, param_name
from corrflow.config import RunConfig, recipe_names, surface_name
from corrflow.data.federated import data_format, train_clients_count
from corrflow.data.partition import load_manifest
from corrflow.errors import DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.paths import run_directory, writable_directory, writable_file
from corrflow.planning.recipe import install_factorization, load_recipe, load_recipe_factorization
from corrflow.planning.resources import check_fits, estimate
from corrflow.planning.run import (
    build_factorization,
    build_planner,
    load_graph,
    plan_privacy,
    training_budget,
)
from corrflow.run.checkpoint import has_checkpoint
from corrflow.run.noise_shards import check_ray_address

#: compare's preset fields → the settings they fill for ``--preset`` (flags typed on the command
# line win).
PRESET_SETTINGS = {
    "users": "num_users",
    "rounds": "num_rounds",
    "epochs": "epochs",
    "epsilon": "target_epsilon",
    "delta": "delta",
    "client": "client",
    "clip_norm": "clip_norm",
    "server_lr": "server_lr",
    "momentum": "momentum",
    "local_lr": "local_lr",
    "local_steps": "local_steps",
    "eval_every": "eval_every",
}


def apply_preset(preset: str | None, settings: dict, typed: set[str], plan: Path | None) -> None:
    """Fill ``settings`` (the command's flag values) with a `corrflow compare` preset's task and
    schedule.

    Args:
        preset: the preset's name (None: nothing to fill).
        settings: the command's flag values, filled in place (`PRESET_SETTINGS`).
        typed: the settings typed on the command line, which win; a typed --noise-multiplier keeps
            the preset's ε out.
        plan: the command's --plan, whose recipe fixes the mechanism and population.

    Raises:
        InvalidArgumentError: an unknown preset, or a preset with --plan (naming --preset).
    """
    if preset is None:
        return
    # The presets live with the comparison, which loads Flower: only when a preset is asked for.
    from corrflow.server.compare import PRESETS

    if preset not in PRESETS:
        raise InvalidArgumentError("--preset", f"one of {', '.join(PRESETS)}", preset)
    if plan is not None:
        raise InvalidArgumentError(
            "--preset", "no preset with --plan (the plan fixes the mechanism)", preset
        )
    chosen = PRESETS[preset]
    for field, name in PRESET_SETTINGS.items():
        if name not in typed and not (name == "target_epsilon" and "noise_multiplier" in typed):
            settings[param_name(name)] = getattr(chosen, field)


@contextlib.contextmanager
def refusal_leaves(out: Path):
    """Leave --out as it was found when the start is refused.

    Args:
        out: the run's directory.

    Yields:
        Nothing; a refusal (exit 2) inside removes the lock, .gitignore and engine.log the start
        wrote, and the directory if the start created it (nothing once a round was checkpointed
        or journaled).
    """
    # The simulation module loads Flower; a refusal before training needs only its undo.
    from corrflow.server.simulation import new_files_undo

    undo = new_files_undo(out)
    try:
        yield
    except typer.Exit as exc:
        if exc.exit_code == 2:
            undo()
        raise


def check_first_round(cfg: RunConfig) -> None:
    """Refuse a fixed σ whose first round alone spends more than --target-epsilon.

    The same ε the in-run budget guard computes (`RunAccounting.budget_exceeded` for round 1 of a
    fresh run), known before anything is written, here only where the plan alone fixes it and
    cheaply: fixed-epoch participation (unamplified, no Monte Carlo) of simulated cross-device
    users with no attribution or dataset file (the guard in the run covers the rest). Only with
    both flags given; the factorization is built here and again by the run.

    Args:
        cfg: the run's settings.

    Raises:
        InvalidArgumentError: round 1 alone exceeds the target, naming both flags.
    """
    if (
        cfg.noise_multiplier is None
        or cfg.target_epsilon is None
        or cfg.participation != "fixed-epoch"
        or cfg.mode != "cross-device"
        or cfg.attribution_path
        or cfg.data_path
    ):
        return
    users = [f"user-{i}" for i in range(cfg.num_users)]
    planner, _, _ = build_planner(cfg, users)
    fac = build_factorization(cfg)
    privacy = plan_privacy(cfg, fac, planner)
    accounting = RunAccounting.of(
        fac, privacy, cfg.delta if privacy.delta is None else privacy.delta, privacy.target_epsilon
    )
    eps = accounting.budget_exceeded({}, [], 0, users[:1])
    if eps is not None:
        raise InvalidArgumentError(
            "--noise-multiplier/--target-epsilon",
            f"a σ whose first round spends at most the target ε = {cfg.target_epsilon:g}: with "
            f"σ = {cfg.noise_multiplier:g} round 1 alone spends ε = {eps:.4f} (raise "
            "--noise-multiplier or --target-epsilon)",
            cfg.noise_multiplier,
        )


def simulate_config(
    ctx: typer.Context,
    settings: dict,
    plan: Path | None,
    fresh: bool,
    per_participation: float | None = None,
) -> RunConfig:
    """The run's settings from the flags, and the plan, which fixes the mechanism.

    Args:
        ctx: the command's context (which flags were typed).
        settings: the command's flag values.
        plan: a recipe written by `corrflow plan`, or None.
        fresh: the run starts anew (the plan's factorization replaces the directory's).
        per_participation: σ in the papers' convention (--noise-multiplier-per-participation),
            converted through the run's factorization; None: --noise-multiplier or a target ε.

    Returns:
        The validated run configuration.

    Raises:
        InvalidArgumentError: a bad flag, or one that differs from the plan (naming it).
    """
    # first, before any data, factorization or registry work: an unreachable head in 10 s
    check_ray_address(settings.get(param_name("ray_address")) or "")
    out = writable_directory(settings[param_name("state_dir")], "--out")
    if settings.get(param_name("release_registry")):
        writable_file(settings[param_name("release_registry")], "--release-registry")
    overrides: dict = {"state_dir": str(run_directory(out))}
    if settings.get(param_name("mode")) == "cross-silo":  # one simulated node per manifest silo
        overrides["num_users"] = _silos(settings.get(param_name("manifest_path")))
    if settings.get(param_name("data_path")):
        overrides.update(_data_defaults(settings, given_on_command_line(ctx)))
    if plan is None:
        cfg = _checked_data(_fits(config_from_cli(settings, **overrides)))
        if per_participation is None:
            return cfg
        sigma = resolve_noise_multiplier(
            build_factorization(cfg), cfg.noise_multiplier, per_participation
        )
        return _checked_data(config_from_cli(settings, **overrides, noise_multiplier=sigma))
    if per_participation is not None:
        raise InvalidArgumentError(
            "--noise-multiplier-per-participation",
            "no --plan (the plan fixes σ)",
            per_participation,
        )
    return _planned_config(ctx, settings, plan, fresh, overrides)


def _silos(manifest: str | None) -> int:
    """The number of silos of a cross-silo run's partition manifest (--manifest)."""
    if not manifest:
        raise InvalidArgumentError("--manifest", "a partition manifest with --mode cross-silo")
    try:
        return int(load_manifest(manifest)["num_partitions"])
    except DataFormatError as exc:
        raise InvalidArgumentError(
            "--manifest", "a partition manifest written by `corrflow data partition`", str(exc)
        ) from None


def _planned_config(
    ctx: typer.Context, settings: dict, plan: Path, fresh: bool, overrides: dict
) -> RunConfig:
    """The run's settings under a plan's recipe: typed flags that differ from it are refused, and
    its factorization is installed in the run's directory."""
    recipe, fac_path = load_recipe(plan)
    try:
        load_recipe_factorization(recipe, fac_path)
    except IntegrityError as exc:  # a plan the user gave: a bad argument, named
        raise InvalidArgumentError(
            "--plan", f"a plan whose factorization file is intact ({exc})"
        ) from None
    typed = given_on_command_line(ctx)
    given = {name: settings[param_name(name)] for name in recipe_names().values() if name in typed}
    diff = recipe.differences(given, {name: surface_name(name, "cli") for name in given})
    # The plan's population fixes its cohort (population / min-sep) and, for a sampler, the
    # sampling probability σ was calibrated for: a --users that differs is refused like the rest
    # (the wrapper may still run a plan on another population; the CLI's --plan promises the plan).
    if "num_users" in given and given["num_users"] != recipe.population:
        diff.append(f"--users: plan {recipe.population!r}, run {given['num_users']!r}")
    if diff:
        raise InvalidArgumentError(
            "--plan", "flags that agree with the plan (or leave them out)", "; ".join(diff)
        )
    overrides["num_users"] = recipe.population  # over --data's default (every partition)
    cfg = _checked_data(_fits(config_from_cli(settings, **recipe.strategy_settings(), **overrides)))
    install_factorization(
        recipe, fac_path, cfg, replace=fresh or not has_checkpoint(cfg.checkpoint_dir)
    )
    return cfg


def _data_defaults(settings: dict, typed: set[str]) -> dict:
    """Defaults of a run on a dataset file (--data): every training partition (--users), and for
    arXiv the author as the privacy unit — multi-attribution participation with k_u = 2 papers per
    author (004 §7.3) — unless the flags say otherwise."""
    path = settings[param_name("data_path")]
    if not Path(path).is_file():
        raise InvalidArgumentError(
            "--data",
            "an existing dataset file (TFF StackOverflow SQLite or arXiv JSON lines)",
            path,
        )
    out: dict = {}
    if "num_users" not in typed:
        out["num_users"] = train_clients_count(path)
    if data_format(path) == "arxiv-jsonl":
        if "participation" not in typed:
            out["participation"] = "multi-attribution"
        if "max_items_per_user" not in typed:
            out["max_items_per_user"] = 2
    return out


def _checked_data(cfg: RunConfig) -> RunConfig:
    """A run on a dataset file: --users within the file's training partitions, the vocabulary's
    share of the budget leaves some for training; an attribution file that can be read (exit 2
    naming the flag, before --out is touched)."""
    if cfg.attribution_path:
        try:
            load_graph(cfg.attribution_path)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError("--attribution", exc.expected, exc.got) from None
        except DataFormatError as exc:
            raise InvalidArgumentError("--attribution", str(exc)) from None
    if cfg.data_path:
        # The simulation module loads Flower: only for a run on a dataset file.
        from corrflow.server.simulation import check_data_population

        check_data_population(cfg, "--users")
        try:
            training_budget(cfg)
        except InvalidArgumentError as exc:
            raise as_flag(exc) from None
    return cfg


def _fits(cfg: RunConfig) -> RunConfig:
    """The run's configuration, refused (naming the flag) when its estimated memory exceeds what is
    available."""
    check_fits(
        estimate(cfg.num_users, cfg.num_rounds, cfg.kind, cfg.bands or cfg.b, cfg.model_dim),
        {"users": "--users", "factorization": "--rounds", "noise": ("--bands", "--model-dim")},
    )
    return cfg
