"""``corrflow factorize``: build a correlated-noise factorization, or describe a saved one."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from corrflow.cli.common import AsJson, emit, fail, load_factorization
from corrflow.cli.options import Verbosity, config_from_cli, given_on_command_line, param_name
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError
from corrflow.paths import writable_file
from corrflow.planning.resources import check_fits, estimate
from corrflow.planning.run import build_factorization, mechanism_notes
from corrflow.progress import Progress


def factorize(
    ctx: typer.Context,
    stamps: Annotated[
        int, typer.Option(help="repeat a rounds/stamps mechanism along the diagonal")
    ] = 1,
    gamma: Annotated[
        float | None, typer.Option(help="γ for bifr/bsr/lambda-cgd (default: searched / 1/2)")
    ] = None,
    search_gamma: Annotated[bool, typer.Option(help="bsr: search γ (the γ-BFR family)")] = False,
    tol: Annotated[float, typer.Option(help="dense: relative duality gap to stop at")] = 5e-4,
    out: Annotated[
        Path | None, typer.Option(help="write the factorization to this .npz file")
    ] = None,
    describe: Annotated[
        Path | None, typer.Option(help="describe a saved factorization instead")
    ] = None,
    as_json: AsJson = False,
    verbose: Verbosity = None,
    workload: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="deprecated: prefix is --momentum 0 --cooldown-fraction 0; momentum the default",
        ),
    ] = None,
    **settings,
) -> None:
    """Build a correlated-noise factorization (or describe a saved one) and print its errors. The
    settings are simulate's, with its defaults: with the same flags this is the factorization
    `corrflow simulate` trains with (the workload of its server optimizer: momentum, cooldown)."""
    try:
        if describe is not None:
            emit(load_factorization(describe, "--describe").summary(), as_json)
            return
        if workload is not None:
            _deprecated_workload(workload, settings, given_on_command_line(ctx))
        cfg = config_from_cli(settings)
        if not (math.isfinite(tol) and tol > 0):
            raise InvalidArgumentError("--tol", "a positive, finite relative duality gap", tol)
        if out is not None:
            writable_file(out, "--out")
        check_fits(
            estimate(0, cfg.num_rounds, cfg.kind, cfg.bands, 0),
            {"factorization": "--rounds", "users": "--rounds", "noise": "--rounds"},
        )
        with Progress(f"factorize {cfg.kind}", quiet=verbose is False) as cb:
            fac = build_factorization(
                cfg, stamps=stamps, gamma=gamma, search_gamma=search_gamma, tol=tol, callback=cb
            )
        for note in mechanism_notes(cfg, fac):
            print(f"warning: {note}", file=sys.stderr)
        summary = fac.summary()
        if out is not None:
            summary["path"] = str(fac.save(out))
        emit(summary, as_json)
    except (CorrflowError, IntegrityError) as exc:
        fail(exc)


def _deprecated_workload(workload: str, settings: dict, typed: set[str]) -> None:
    """``--workload`` (before the settings model): prefix is momentum 0 without cooldown, momentum
    the default workload. Warns; fills ``settings`` in place."""
    if workload not in ("prefix", "momentum"):
        raise InvalidArgumentError("--workload", "prefix or momentum (deprecated)", workload)
    if workload == "prefix":
        settings[param_name("momentum")] = 0.0
        if "cooldown_fraction" not in typed:
            settings[param_name("cooldown_fraction")] = 0.0
    typer.echo(
        "warning: --workload is deprecated: the workload is the server optimizer's, set by "
        "--momentum and --cooldown-fraction (--workload prefix is --momentum 0 "
        "--cooldown-fraction 0)",
        err=True,
    )
