"""The ``corrflow`` command (docs "Conventions"): one subcommand per job; ``--json`` prints exactly
one JSON object as the last stdout line; progress goes to stderr; bad arguments exit with code 2 and
name the argument."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from corrflow.choices import SAMPLING_OF, Accountant, Backend, Participation, Sampling, values
from corrflow.config import recipe_names, renamed, surface_name, validated_fields
from corrflow.errors import CorrflowError, DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.factorization.base import Factorization
from corrflow.factorization.registry import KINDS
from corrflow.paths import run_directory, writable_directory, writable_file
from corrflow.planning.regime import regime_lines
from corrflow.progress import Progress
from corrflow.run.journal import JOURNAL
from corrflow.server.compare_cli import compare_command
from corrflow.server.data_cli import data_app
from corrflow.server.options import (
    COMMAND_SETTINGS,
    cli_values,
    config_from_cli,
    file_error_message,
    given_on_command_line,
    param_name,
    with_settings,
)
from corrflow.server.runs import runs_app
from corrflow.server.schema_cli import schema_command

# Planning, accounting, data, noise and the run are imported inside the commands that use them: at
# module level they would load Flower, the PLD library and numba into every `corrflow --help`.

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="corrflow: federated learning with differential privacy through correlated noise.",
)


@app.callback()
def _root() -> None:
    """corrflow: federated learning with differential privacy through correlated noise."""


def _emit(obj: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, default=_jsonable, sort_keys=True))
    else:
        for key, value in obj.items():
            print(f"{key:>24}: {value}")


def _jsonable(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def _load_factorization(path: Path, flag: str):
    """A user-given factorization file; one that cannot be read is a bad argument (exit 2) naming
    the flag."""

    try:
        return Factorization.load(path)
    except (IntegrityError, InvalidArgumentError) as exc:
        raise InvalidArgumentError(
            flag, f"a factorization file written by `corrflow factorize` ({exc})"
        ) from None


def _fail(exc: Exception, files: dict | None = None) -> None:
    """Print ``exc`` (naming the flag; a data file's error led by its flag among ``files``, the
    command's settings) and exit 2 for bad input, else 1."""
    if (
        isinstance(exc, InvalidArgumentError)
        and exc.field.replace("_", "-").replace("-", "").isalnum()
        and exc.field.islower()
    ):  # a setting's name (not a path, not a positional NAME): the flag
        exc = _as_flag(exc)
    typer.echo(f"error: {file_error_message(exc, files or {})}", err=True)
    raise typer.Exit(code=2 if isinstance(exc, (InvalidArgumentError, DataFormatError)) else 1)


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
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
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
    from corrflow.planning.resources import check_fits, estimate
    from corrflow.planning.run import build_factorization

    try:
        if describe is not None:
            _emit(_load_factorization(describe, "--describe").summary(), as_json)
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
        with Progress(f"factorize {cfg.kind}", quiet=quiet) as cb:
            fac = build_factorization(
                cfg, stamps=stamps, gamma=gamma, search_gamma=search_gamma, tol=tol, callback=cb
            )
        summary = fac.summary()
        if out is not None:
            summary["path"] = str(fac.save(out))
        _emit(summary, as_json)
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)


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
        "--momentum and --cooldown-fraction (--workload prefix is --momentum 0 --cooldown-fraction "
        "0)",
        err=True,
    )


app.command()(with_settings(factorize, "factorize"))


def account(
    factorization: Annotated[Path, typer.Option(help="a factorization .npz file")],
    sampling: Annotated[
        str | None,
        typer.Option(
            help="the sampling the accountant assumes when no participation has it: "
            "balls-in-bins (deprecated for the others: --participation; none is fixed-epoch)"
        ),
    ] = None,
    items_per_user: Annotated[
        int, typer.Option(help="k_u: items per user, for multi-attribution")
    ] = 1,
    dataset_size: Annotated[
        int | None, typer.Option(help="N (examples or users), for amplified sampling")
    ] = None,
    expected_batch_size: Annotated[
        float | None, typer.Option(help="B, for amplified sampling")
    ] = None,
    mc_samples: Annotated[
        int | None,
        typer.Option(
            help="Monte Carlo: size of the first batch of samples per "
            "direction, at least 2 (default: what the target δ needs; smaller "
            "batches only feed the estimate); with --target-epsilon: "
            "samples per candidate σ (default 100000). Unlike a run's --mc-samples "
            "(simulate, audit: at least 1000), a one-off: the result reports the δ its "
            "samples verify"
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            help="Monte Carlo seed (the result does not depend on it beyond the stated confidence)"
        ),
    ] = 0,
    verify_target: Annotated[
        bool,
        typer.Option(
            help="with --target-epsilon and Monte Carlo: draw the samples per "
            "candidate σ that verify the target δ (ε for a σ always "
            "verifies the target δ)"
        ),
    ] = False,
    max_samples: Annotated[
        int | None,
        typer.Option(
            help="Monte Carlo: budget of samples per direction, all batches "
            "together; when spent before a verification passes, the "
            "sampling's other verified bound is used and both are named; "
            "default 240000000; attempts are sized from the estimate)"
        ),
    ] = None,
    time_limit: Annotated[
        float | None,
        typer.Option(
            help="Monte Carlo: abort after this many seconds (nothing is released, exit 1)"
        ),
    ] = None,
    mmcc_grid: Annotated[
        float | None,
        typer.Option(
            help="MMCC: grid Δ2 the entries of C are rounded up to "
            "(default: the largest entry / 256)"
        ),
    ] = None,
    delta_split: Annotated[
        float, typer.Option(help="MMCC: share of δ spent on the tail bounds")
    ] = 0.5,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    **settings,
) -> None:
    """ε for a noise multiplier, or the smallest grid σ that meets a target ε. The (epsilon, delta)
    printed is a pair the accountant guarantees; with no --accountant, the tightest verified bound
    of those that apply (all listed). When Monte Carlo cannot verify --delta within its sample
    budget, the sampler's other verified bound is released and both numbers are named."""
    from corrflow.accounting import SamplingSpec
    from corrflow.accounting import account as run_account
    from corrflow.accounting.noise_scale import describe as describe_noise

    try:
        values = validated_fields(cli_values(settings), "cli")
        noise_multiplier = values.get("noise_multiplier")
        target_epsilon = values.get("target_epsilon")
        delta = values["delta"]
        if (noise_multiplier is None) == (target_epsilon is None):
            raise InvalidArgumentError(
                "--noise-multiplier", "exactly one of --noise-multiplier and --target-epsilon"
            )
        fac = _load_factorization(factorization, "--factorization")
        spec = SamplingSpec(
            _account_sampling(values["participation"], sampling),
            dataset_size,
            expected_batch_size,
            items_per_user,
            accountant=values.get("accountant"),
        )
        res = run_account(
            fac,
            delta=delta,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            sampling=spec,
            mc_samples=mc_samples,
            seed=seed,
            verify_target=verify_target,
            **({} if max_samples is None else {"max_samples": max_samples}),
            time_limit=time_limit,
            mmcc_grid=mmcc_grid,
            delta_split=delta_split,
            progress=True,
        )
        if not res["guarantee"]:
            needed = res["accountant"].get("samples_needed_for_target_delta")
            print(
                f"warning: the samples drawn verify (ε = {res['epsilon']:.4g}, δ = "
                f"{res['delta']:.3g}), not "
                f"δ = {delta:g}"
                + (
                    f"; --verify-target draws the {needed} samples per candidate σ the target needs"
                    if needed
                    else ""
                ),
                file=sys.stderr,
            )
        _describe_bounds(res)
        if not as_json:  # one line for people; --json keeps the numbers
            res = {**res, "noise_std_per_round": describe_noise(res.get("noise_std_per_round"))}
        _emit(res, as_json)
    except InvalidArgumentError as exc:
        _fail(_account_flag(exc))
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)


app.command()(with_settings(account, "account"))


def _account_sampling(participation: str, sampling: str | None) -> str:
    """The sampling ``account`` assumes: the participation's (simulate's vocabulary), or
    ``--sampling``, kept for balls-in-bins (no run samples that way) and, deprecated, the rest."""

    if sampling is None:
        return str(SAMPLING_OF[Participation(participation)])
    if sampling not in tuple(Sampling):
        raise InvalidArgumentError("--sampling", "balls-in-bins", sampling)
    if participation != Participation.FIXED_EPOCH:
        raise InvalidArgumentError(
            "--sampling",
            "no --sampling with --participation (the participation names it)",
            sampling,
        )
    if sampling != Sampling.BALLS_IN_BINS:
        same = {str(v): str(k) for k, v in SAMPLING_OF.items()}[sampling]
        typer.echo(
            f"warning: --sampling {sampling} is deprecated: use --participation {same}", err=True
        )
    return sampling


#: Library fields an accountant may name that `account` has no flag for: the flag that sets them.
_ACCOUNT_FIELDS = {
    "sampling_probability": "--expected-batch-size",
    "participation_rate": "--expected-batch-size",
    "min_sep": "--factorization",
    "cycle": "--factorization",
    "band": "--factorization",
    "k_u": "--items-per-user",
    "warm": "--sampling",
    "scheme": "--sampling",
    "epsilon": "--delta",
    "sensitivity": "--factorization",
}


def _account_flag(exc: InvalidArgumentError) -> InvalidArgumentError:
    """The error naming one of `account`'s own flags (never one it does not have)."""
    field = exc.field
    if field in _ACCOUNT_FIELDS:
        return InvalidArgumentError(
            _ACCOUNT_FIELDS[field], f"{exc.expected} ({field.replace('_', ' ')})", exc.got
        )
    import inspect

    named = _as_flag(exc)
    flags = {"--" + name.replace("_", "-") for name in inspect.signature(account).parameters} | {
        "--json",
        *(surface_name(name, "cli") for name in COMMAND_SETTINGS["account"]),
    }
    if named.field not in flags:  # a field of the factorization file or the sampling it implies
        return InvalidArgumentError("--factorization", f"{named.expected} ({field})", named.got)
    return named


def _describe_bounds(res: dict) -> None:
    """Which bound was used and the others with their values, on stderr."""
    acc = res["accountant"]
    for b in acc.get("bounds", []):
        mark = (
            "used"
            if b["accountant"] == acc.get("selected")
            else ("verified" if b["verified"] else "NOT verified (estimate)")
        )
        print(
            f"bound {b['accountant']:>12}: ε = {b['epsilon']:.4g} at δ = {b['delta']:.3g}, σ = "
            f"{b['noise_multiplier']:.4g} — {mark}",
            file=sys.stderr,
        )
    for s in acc.get("skipped", []):
        print(f"bound {s['accountant']:>12}: not computed ({s['reason']})", file=sys.stderr)


def _byte_size(text: str | None, flag: str) -> float:
    """Bytes from '8e9', '8GB', '512MiB', ... (decimal and binary suffixes); None: no budget."""
    import math
    import re

    if text is None:
        return math.inf
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise InvalidArgumentError(flag, "a size in bytes such as 8e9, 8GB or 512MiB", text)
    try:
        value = float(m.group(1))
    except ValueError:
        raise InvalidArgumentError(
            flag, "a size in bytes such as 8e9, 8GB or 512MiB", text
        ) from None
    unit = (m.group(2) or "").lower()
    scale = {
        "": 1,
        "k": 1e3,
        "m": 1e6,
        "g": 1e9,
        "t": 1e12,
        "ki": 2**10,
        "mi": 2**20,
        "gi": 2**30,
        "ti": 2**40,
    }
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(flag, "a size ≥ 0", text)
    return value * scale[unit]


def plan(
    population: Annotated[int, typer.Option(help="P: users in the population")],
    cohort_size: Annotated[
        int, typer.Option(help="B: users per round (b = ⌊P/B⌋ rounds between a user's turns)")
    ],
    memory_budget: Annotated[
        str | None,
        typer.Option(help="bytes the noise state may take (8e9, 8GB, 512MiB; default: no limit)"),
    ] = None,
    noise_time_budget: Annotated[
        float | None, typer.Option(help="seconds of noise generation per round (default: no limit)")
    ] = None,
    model_params: Annotated[
        int, typer.Option(help="d: model parameters (noise memory and time scale with it)")
    ] = 1_000_000,
    kinds: Annotated[
        str,
        typer.Option(
            help=f"comma-separated factorization kinds to consider (from: {', '.join(KINDS)})"
        ),
    ] = "dpsgd,toeplitz,bifr,dense",
    accountants: Annotated[
        str | None,
        typer.Option(
            help=f"comma-separated accountants: {', '.join(a.value for a in Accountant)} "
            "(default: the cheap ones; the plan lists what it skipped)"
        ),
    ] = None,
    time_budget: Annotated[
        float | None,
        typer.Option(
            help="wall-clock seconds after which the plan aborts with "
            "exit 1 and writes no recipe (default: no limit; the "
            "recipe never depends on it)"
        ),
    ] = None,
    dense_iterations: Annotated[
        int | None,
        typer.Option(
            help="iteration budget of the dense optimizer (default: "
            "⌈1e12/n³⌉, at most 10000: the same on any machine)"
        ),
    ] = None,
    kappa: Annotated[
        float | None,
        typer.Option(
            help="κ of your task (server lr × loss curvature per round) for the planner's score, "
            "the closed-loop error of the final model; default: measured on --proxy-data, else "
            "the default 0.1 (assumed, and said so)"
        ),
    ] = None,
    proxy_data: Annotated[
        Path | None,
        typer.Option(
            help="PUBLIC data in a format --data reads, to measure κ by a short non-private run "
            "(seconds to minutes; the time is printed). It is not accounted: never give the "
            "private training data"
        ),
    ] = None,
    proxy_vocab: Annotated[
        Path | None, typer.Option(help="the vocabulary of --proxy-data (corrflow data vocab)")
    ] = None,
    out: Annotated[
        Path,
        typer.Option(help="output directory: recipe.json, factorization.npz, plan.json, plots"),
    ] = Path("corrflow_plan"),
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="cache of factorizations and calibrations (default: "
            "$CORRFLOW_HOME/cache, else OUT/cache)"
        ),
    ] = None,
    plots: Annotated[bool, typer.Option(help="write the PNG plots")] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print plan.json as one JSON object")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bars")] = False,
    **settings,
) -> None:
    """Choose the mechanism for a training run: build and calibrate every candidate, rank them
    within the memory and noise-time budgets by the closed-loop error of the final model (the noise
    left when training pulls the model back by κ per round; κ from --kappa, measured on
    --proxy-data, or assumed), print why the pick wins and the plain-RMSE ranking beside it, and
    write the recommended recipe (OUT/recipe.json, for `corrflow simulate --plan`), its
    factorization, plan.json and plots. Exit 1 when no candidate fits. The workload is the server
    optimizer's, as in simulate (--momentum: the --client's default)."""
    from corrflow.planning.cache import PlanCache, default_cache_dir
    from corrflow.planning.candidates import PlanRequest, make_plan, write_plan
    from corrflow.planning.score import Damping

    try:
        cfg = config_from_cli(settings)
        if kappa is not None:
            Damping(kappa, "declared")  # refuses a negative or non-finite κ, naming --kappa
        if proxy_data is not None and cfg.client not in ("nextword", "keras"):
            raise InvalidArgumentError(
                "--client",
                "a client that trains on text files (nextword or keras) with --proxy-data",
                cfg.client,
            )
        if proxy_data is not None and not proxy_data.is_file():
            raise InvalidArgumentError(
                "--proxy-data",
                "an existing public dataset file (a format --data reads)",
                str(proxy_data),
            )
        if proxy_data is not None and (proxy_vocab is None or not proxy_vocab.is_file()):
            raise InvalidArgumentError(
                "--proxy-vocab", "the vocabulary file of --proxy-data", str(proxy_vocab)
            )
        if proxy_data is None and proxy_vocab is not None:
            raise InvalidArgumentError("--proxy-data", "a dataset file with --proxy-vocab", None)
        if kappa is not None and proxy_data is not None:
            raise InvalidArgumentError(
                "--kappa", "either --kappa or --proxy-data (one source of κ)", kappa
            )
        req = PlanRequest(
            rounds=cfg.num_rounds,
            population=population,
            cohort_size=cohort_size,
            target_epsilon=cfg.target_epsilon,
            delta=cfg.delta,
            memory_budget=_byte_size(memory_budget, "--memory-budget"),
            noise_time_budget=float("inf") if noise_time_budget is None else noise_time_budget,
            model_params=model_params,
            kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()),
            accountants=None
            if accountants is None
            else tuple(a.strip() for a in accountants.split(",") if a.strip()),
            momentum=cfg.momentum,
            cooldown_fraction=cfg.cooldown_fraction,
            time_budget=time_budget,
            dense_iterations=dense_iterations,
        )
    except InvalidArgumentError as exc:
        flag = exc.field if exc.field.startswith("--") else "--" + exc.field.replace("_", "-")
        _fail(InvalidArgumentError(flag, exc.expected, exc.got))
    try:
        from corrflow.server.proxy import damping_for

        if proxy_data is not None and not quiet:
            typer.echo("plan: measuring κ on the proxy data (a non-private run) …", err=True)
        req = dataclasses.replace(
            req,
            damping=damping_for(
                cfg,
                population,
                cohort_size,
                kappa=kappa,
                proxy_data=str(proxy_data or ""),
                proxy_vocab=str(proxy_vocab or ""),
            ),
        )
    except (CorrflowError, DataFormatError) as exc:
        _fail(exc)
    try:
        from corrflow.planning.resources import check_fits, estimate

        # the cheapest candidate (Toeplitz, one band) must fit before anything is written
        check_fits(
            estimate(0, cfg.num_rounds, "toeplitz", 1, model_params),
            {"users": "--population", "factorization": "--rounds", "noise": "--model-params"},
        )
        writable_directory(out, "--out")
        if cache_dir is not None:
            writable_directory(cache_dir, "--cache-dir")
        cache = PlanCache(cache_dir or default_cache_dir(out))
        result = make_plan(req, cache, quiet=quiet)
        doc = write_plan(result, out, plots=plots, cache=cache, quiet=quiet)
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)
    if as_json:
        _emit(doc, True)
    else:
        typer.echo(_plan_table(doc, out))
    if doc["recommended"] is None:
        typer.echo(
            "error: no candidate fits the memory and noise-time budgets (plan.json lists every "
            "candidate "
            "and what it exceeds)",
            err=True,
        )
        raise typer.Exit(code=1)


app.command()(with_settings(plan, "plan"))


def _plan_table(doc: dict, out: Path, top: int = 10) -> str:
    part, score = doc["participation"], doc["score"]
    closed = score["kappa"] is not None
    lines = [
        f"participation  b = {part['min_sep']}, k = {part['epochs']} "
        f"({'fixed-epoch' if part['fixed_epoch'] else 'min-sep'}); rule of thumb ε√n/k = "
        f"{part['rule_of_thumb_bands']:.1f} bands",
        f"score          {score['name']}"
        + (f" at {score['kappa_described']}" if closed else "")
        + f": {score['formula']}",
        f"{'rank':>4} {'candidate':<32} {'b':>5} {'σ':>8} {'score':>10} {'RMSE':>10} "
        f"{'RMSE #':>6} {'max err':>10} "
        f"{'×DP-SGD':>8} {'noise MB':>10} "
        f"{'noise s/rd':>10} {'build s':>8}",
    ]
    for c in doc["candidates"][:top]:
        label = (
            c["kind"]
            + (f"[{c['bands']}]" if c["bands"] is not None else "")
            + f" / {c['accountant']}"
        )
        ratio = "" if c["rmse_ratio_vs_dpsgd"] is None else f"{c['rmse_ratio_vs_dpsgd']:.3f}"
        lines.append(
            f"{c['rank'] or '-':>4} {label:<32} {c['min_sep']:>5} {c['noise_multiplier']:>8.4g} "
            f"{c['score']:>10.4g} {c['rmse']:>10.4g} {c['rmse_rank'] or '-':>6} "
            f"{c['max_error']:>10.4g} {ratio:>8} {c['noise_state_bytes'] / 1e6:>10.1f} "
            f"{c['noise_seconds_per_round']:>10.3g} {c['build_seconds']:>8.1f}"
        )
    if len(doc["candidates"]) > top:
        lines.append(
            f"{'':>4} … {len(doc['candidates']) - top} more candidate(s) in {out / 'plan.json'}"
        )
    for s in doc["skipped"]:
        what = s.get("kind") or s.get("accountant")
        lines.append(f"skipped        {what}: {s['reason']}")
    rec = doc["recommended"]
    if rec is not None:
        lines.append(
            f"recommended    {rec['kind']}"
            + (f" with {rec['bands']} bands" if rec["bands"] else "")
            + f", {rec['participation']} participation, accountant {rec['accountant']}, σ = "
            f"{rec['noise_multiplier']:.4g} (ε = {rec['epsilon']:.4g}, δ = {rec['delta']:g})"
        )
        lines += _why_lines(score)
        lines.append(
            f"plan           {out / 'recipe.json'} (corrflow simulate --plan); "
            f"{out / 'plan.json'}; "
            f"{doc['seconds']:.1f} s"
        )
    return "\n".join(lines)


def _why_lines(score: dict) -> list[str]:
    """Why the recommendation wins: its score against the runner-up's, what the score assumes, and
    the plain-RMSE ranking beside it."""
    best, runner = score["recommended"], score["runner_up"]

    def named(e: dict) -> str:  # the sampler's separation tells two same-kind candidates apart
        return f"{e['candidate']} at b = {e['min_sep']}"

    if runner is None:
        why = f"why            {named(best)} is the only mechanism within the budgets"
    else:
        why = (
            f"why            {named(best)}: {score['name']} {best['score']:.4g} against the "
            f"runner-up {named(runner)}'s {runner['score']:.4g} ({score['margin']:.1%} more "
            "noise in the final model)"
        )
    lines = [why]
    lines += [f"assumes        {a}" for a in score["assumes"]]
    lines += [f"WARNING        {w}" for w in score.get("warnings") or ()]
    if score["kappa"] is not None:
        lines.append(
            "plain RMSE     ranks "
            + ", ".join(
                f"{i}. {e['candidate']} ({e['rmse']:.4g})"
                for i, e in enumerate(score["rmse_ranking"], start=1)
            )
            + f"; the pick is #{best['rmse_rank']} by RMSE"
        )
    return lines


def simulate(
    ctx: typer.Context,
    backend: Annotated[
        str,
        typer.Option(
            help="flower (Flower's simulation engine, Ray), inprocess, or cohort (a round's "
            "clients trained together in process; numpy and nextword tasks)"
        ),
    ] = "flower",
    fresh: Annotated[
        bool,
        typer.Option(
            help="start a new run: move the previous run in --out aside (never "
            "deleted) instead of resuming it"
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            help="show Flower's, Ray's and TensorFlow's own output (else it goes to OUT/engine.log)"
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the privacy report as one JSON object")
    ] = False,
    plan: Annotated[
        Path | None,
        typer.Option(
            help="a recipe written by `corrflow plan` (OUT/recipe.json): its "
            "mechanism, participation, accountant, σ and population (--users); flags that "
            "differ are refused"
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="a `corrflow compare` preset (quick, tiny, large, stackoverflow) for the task and "
            "schedule: users, rounds, epochs, ε, δ, client and optimizer; flags you type override "
            "it"
        ),
    ] = None,
    **settings,
) -> None:
    """Run a federated simulation with correlated noise and print its privacy report. Rerunning the
    same command resumes from the checkpoint in --out. Exit codes: 0 done, 1 stopped before the
    planned rounds (the report says why) or refused, 2 bad arguments, 3 finished but did not learn
    (held-out loss not below the initial model's; the report's `learning` has the verdict), 130
    interrupted (state and report are complete; rerun to continue)."""
    try:
        if backend not in values(Backend):
            raise InvalidArgumentError("--backend", " or ".join(values(Backend)), backend)
        if preset is not None and settings.get(param_name("mode")) == "cross-silo":
            raise InvalidArgumentError(
                "--preset",
                "no preset with --mode cross-silo (the manifest fixes the population)",
                preset,
            )
        _apply_preset(preset, settings, given_on_command_line(ctx), plan)
        cfg = _simulate_config(ctx, settings, plan, fresh)
    except InvalidArgumentError as exc:
        _fail(exc)
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc, settings)
    out = Path(cfg.state_dir)
    if fresh or not (cfg.checkpoint_dir / "CURRENT").exists():  # before --out is locked
        try:
            _check_first_round(cfg)
        except InvalidArgumentError as exc:
            _fail(exc)
    with _refusal_leaves(out):
        complete = _check_resume(cfg, out, fresh)
        _run_simulation(cfg, out, backend, fresh, verbose, as_json, complete)


@contextlib.contextmanager
def _refusal_leaves(out: Path):
    """A refusal (exit 2) leaves --out as it found it: the lock, .gitignore and engine.log a start
    wrote are removed, and the directory if the start created it (nothing once a round was
    checkpointed or journaled)."""
    from corrflow.server.simulation import new_files_undo

    undo = new_files_undo(out)
    try:
        yield
    except typer.Exit as exc:
        if exc.exit_code == 2:
            undo()
        raise


def _check_first_round(cfg) -> None:
    """Refuse (naming the flags) a fixed σ whose first round alone would already spend more than
    --target-epsilon, the budget guard's limit: known before anything is written. The same ε the
    in-run guard computes (`RunAccounting.budget_exceeded` for round 1 of a fresh run), here only
    where the plan alone fixes it and cheaply: fixed-epoch participation (unamplified, no Monte
    Carlo) of simulated cross-device users with no attribution or dataset file (the guard in the
    run covers the rest). Only with both flags given; the factorization is built here and again
    by the run."""
    if (
        cfg.noise_multiplier is None
        or cfg.target_epsilon is None
        or cfg.participation != "fixed-epoch"
        or cfg.mode != "cross-device"
        or cfg.attribution_path
        or cfg.data_path
    ):
        return
    from corrflow.accounting.policy import RunAccounting
    from corrflow.planning.run import build_factorization, build_planner, plan_privacy

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


def _simulate_config(ctx: typer.Context, settings: dict, plan: Path | None, fresh: bool):
    """The run's settings from the flags (and the plan, which fixes the mechanism: flags that differ
    are refused); errors name the flag."""

    out = writable_directory(settings[param_name("state_dir")], "--out")
    if settings.get(param_name("release_registry")):
        writable_file(settings[param_name("release_registry")], "--release-registry")
    overrides: dict = {"state_dir": str(run_directory(out))}
    if (
        settings.get(param_name("mode")) == "cross-silo"
    ):  # one simulated node per silo of the manifest
        from corrflow.data.partition import load_manifest

        manifest = settings.get(param_name("manifest_path"))
        if not manifest:
            raise InvalidArgumentError("--manifest", "a partition manifest with --mode cross-silo")
        try:
            overrides["num_users"] = int(load_manifest(manifest)["num_partitions"])
        except DataFormatError as exc:
            raise InvalidArgumentError(
                "--manifest", "a partition manifest written by `corrflow data partition`", str(exc)
            ) from None
    if settings.get(param_name("data_path")):
        overrides.update(_data_defaults(settings, given_on_command_line(ctx)))
    if plan is None:
        return _checked_data(_fits(config_from_cli(settings, **overrides)))
    from corrflow.planning.recipe import (
        install_factorization,
        load_recipe,
        load_recipe_factorization,
    )

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
        recipe, fac_path, cfg, replace=fresh or not (cfg.checkpoint_dir / "CURRENT").exists()
    )
    return cfg


def _data_defaults(settings: dict, typed: set[str]) -> dict:
    """Defaults of a run on a dataset file (--data): every training partition (--users), and for
    arXiv the author as the privacy unit — multi-attribution participation with k_u = 2 papers per
    author (004 §7.3) — unless the flags say otherwise."""
    from corrflow.data.federated import data_format, train_clients_count

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


def _checked_data(cfg):
    """A run on a dataset file: --users within the file's training partitions, the vocabulary's
    share of the budget leaves some for training; an attribution file that can be read (exit 2
    naming the flag, before --out is touched)."""
    if cfg.attribution_path:
        from corrflow.planning.run import load_graph

        try:
            load_graph(cfg.attribution_path)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError("--attribution", exc.expected, exc.got) from None
        except DataFormatError as exc:
            raise InvalidArgumentError("--attribution", str(exc)) from None
    if cfg.data_path:
        from corrflow.planning.run import training_budget
        from corrflow.server.simulation import check_data_population

        check_data_population(cfg, "--users")
        try:
            training_budget(cfg)
        except InvalidArgumentError as exc:
            raise _as_flag(exc) from None
    return cfg


def _fits(cfg):
    """The run's configuration, refused (naming the flag) when its estimated memory exceeds what is
    available."""
    from corrflow.planning.resources import check_fits, estimate

    check_fits(
        estimate(cfg.num_users, cfg.num_rounds, cfg.kind, cfg.bands or cfg.b, cfg.model_dim),
        {"users": "--users", "factorization": "--rounds", "noise": "--bands"},
    )
    return cfg


def _check_resume(cfg, out: Path, fresh: bool) -> bool:
    """Refuse a directory holding another run (exit 2, naming what differs) or one that disagrees
    with its journal (exit 1); say whether the run resumes or is already complete. Returns whether
    it is complete."""
    from corrflow.run.resume import preflight, settings_conflict

    try:
        if not fresh and (diff := settings_conflict(cfg.checkpoint_dir, cfg.run_settings())):
            raise InvalidArgumentError(
                "--out",
                f"the directory of a run with the same settings, or --fresh to move "
                f"that run aside and start anew; {out} holds a run with other settings",
                diff,
            )
        resume = None if fresh else preflight(out)
    except CorrflowError as exc:
        _fail(exc)
    if resume is None or resume.checkpoint is None:
        return False
    done = len(resume.journal)
    typer.echo(
        f"resuming: {done} of {cfg.num_rounds} rounds already released"
        if done < cfg.num_rounds
        else (
            f"already complete: all {cfg.num_rounds} rounds were released; nothing to train "
            "(--fresh starts a new "
            "run)"
        ),
        err=True,
    )
    return done >= cfg.num_rounds


def _run_simulation(
    cfg, out: Path, backend: str, fresh: bool, verbose: bool, as_json: bool, complete: bool
) -> None:
    """Train (unless complete), print the summary or the report, and exit with the code the run
    earned."""
    from corrflow.planning.learnability import held_out_summary
    from corrflow.server.simulation import RunInterruptedError, RunStoppedEarlyError
    from corrflow.server.simulation import simulate as run_sim

    try:
        stopped = None
        try:
            report = (
                json.loads((out / "privacy_report.json").read_text())
                if complete
                else run_sim(cfg, backend=backend, fresh=fresh, verbose=verbose)
            )
        except RunStoppedEarlyError as exc:
            report, stopped = exc.report, exc
        held_out = held_out_summary(json.loads((out / "metrics.json").read_text()))
        if as_json:
            _emit({**report, "held_out": held_out}, True)
        else:
            typer.echo(_summary(report, out, held_out))
        if stopped is not None:
            typer.echo(
                f"error: the run stopped after {report['rounds_completed']} of {cfg.num_rounds} "
                "rounds: "
                f"{stopped}",
                err=True,
            )
            raise typer.Exit(code=1)
        if report.get("learning", {}).get("learned") is False:
            raise typer.Exit(
                code=3
            )  # the session logged the verdict; the summary's held-out line repeats it
    except RunInterruptedError as exc:
        typer.echo(
            f"interrupted: {exc}. State and report in {out} are complete; rerun the same command "
            "to "
            "continue.",
            err=True,
        )
        raise typer.Exit(code=130) from None
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc, cfg.model_dump())
    except (
        OSError
    ) as exc:  # a full disk, a vanished mount: the last checkpoint and journal are consistent
        typer.echo(
            f"error: could not write the run's files in {out}: {exc.strerror or exc} "
            f"({exc.filename or out})."
            " Everything released so far is checkpointed and journaled; fix the cause and rerun to "
            "resume.",
            err=True,
        )
        raise typer.Exit(code=1) from None


app.command()(with_settings(simulate, "simulate"))


#: compare's preset fields → the settings they fill for ``audit --preset`` (flags typed on the
# command line win).
_PRESET_SETTINGS = {
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


def _apply_preset(preset: str | None, settings: dict, typed: set[str], plan: Path | None) -> None:
    """Fill ``settings`` (the command's flag values) with the `corrflow compare` preset's task and
    schedule (`_PRESET_SETTINGS`; flags typed on the command line win, and a typed
    --noise-multiplier keeps the preset's ε out); refused (naming --preset) when unknown or with
    --plan, whose recipe fixes the mechanism and population."""
    if preset is None:
        return
    from corrflow.server.compare import PRESETS

    if preset not in PRESETS:
        raise InvalidArgumentError("--preset", f"one of {', '.join(PRESETS)}", preset)
    if plan is not None:
        raise InvalidArgumentError(
            "--preset", "no preset with --plan (the plan fixes the mechanism)", preset
        )
    chosen = PRESETS[preset]
    for field, name in _PRESET_SETTINGS.items():
        if name not in typed and not (name == "target_epsilon" and "noise_multiplier" in typed):
            settings[param_name(name)] = getattr(chosen, field)


def audit(
    ctx: typer.Context,
    canaries: Annotated[
        int,
        typer.Option(
            help="candidate canary users; each is inserted by a fair coin (about "
            "half), the rest are the held-out null"
        ),
    ] = 200,
    preset: Annotated[
        str | None,
        typer.Option(
            help="a `corrflow compare` preset (quick, tiny, large, stackoverflow) for the task and "
            "schedule; flags you type override it"
        ),
    ] = None,
    audit_seed: Annotated[
        int | None,
        typer.Option(help="seed of the canaries' directions and coins (default: fresh; printed)"),
    ] = None,
    plot: Annotated[bool, typer.Option(help="write OUT/audit.png (score histograms)")] = True,
    verbose: Annotated[
        bool, typer.Option(help="show Flower's own output (else it goes to OUT/engine.log)")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the audit as one JSON object")
    ] = False,
    plan: Annotated[
        Path | None,
        typer.Option(
            help="a recipe written by `corrflow plan` (OUT/recipe.json), as for `corrflow simulate`"
        ),
    ] = None,
    **settings,
) -> None:
    """Empirical privacy audit: train once, in process, with canary users added to the population
    (scheduled, clipped, noised and accounted like real users; each returns a fixed random direction
    scaled to the clip norm), then report the run's claimed ε, the one-shot estimate ε̂ (Andrew et
    al., arXiv 2302.03098) and a 95% lower bound ε_lo (Steinke, Nasr, Jagielski, arXiv 2305.08846)
    from the released models. Always a new run in --out (default corrflow_audit; an earlier run
    there is moved aside). Exit codes: 0 consistent (nothing shown above the claim), 1 the run
    failed, 2 bad arguments, 4 VIOLATION (ε_lo exceeds the claimed ε at 95% confidence), 5 SUSPECT
    (ε_lo does not exceed the claim, but the whole 95% bootstrap interval of ε̂ lies above it — its
    lower end exceeds the claimed ε: rerun with more canaries).
    When the largest ε_lo this many canaries can show is below the claim, a note says so and how
    many would lift it."""

    try:
        typed = given_on_command_line(ctx)
        _apply_preset(preset, settings, typed, plan)
        if "state_dir" not in typed:
            settings[param_name("state_dir")] = Path("corrflow_audit")
        from corrflow.strategies.canaries import MIN_CANARIES

        if canaries < MIN_CANARIES:
            raise InvalidArgumentError(
                "--canaries", f"at least {MIN_CANARIES} candidate canaries", canaries
            )
        if settings.get(param_name("mode")) not in (None, "cross-device"):
            raise InvalidArgumentError(
                "--mode",
                "cross-device (a canary is a simulated SuperNode)",
                settings.get(param_name("mode")),
            )
        cfg = _simulate_config(ctx, settings, plan, fresh=True)
        _check_first_round(cfg)
        from corrflow.planning.resources import check_fits, estimate

        # every candidate canary is a simulated SuperNode with its own draws: its memory counts too
        check_fits(
            estimate(
                cfg.num_users + canaries,
                cfg.num_rounds,
                cfg.kind,
                cfg.bands or cfg.b,
                cfg.model_dim,
            ),
            {
                "users": "--canaries" if canaries > cfg.num_users else "--users",
                "factorization": "--rounds",
                "noise": "--bands",
            },
        )
    except InvalidArgumentError as exc:
        _fail(_as_flag(exc))
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc, settings)
    with _refusal_leaves(Path(cfg.state_dir)):
        _run_audit(cfg, canaries, audit_seed, plot, verbose, as_json)


def _run_audit(
    cfg, canaries: int, audit_seed: int | None, plot: bool, verbose: bool, as_json: bool
) -> None:
    from corrflow.server.audit import run_audit
    from corrflow.server.simulation import RunInterruptedError

    try:
        result = run_audit(cfg, canaries, audit_seed, verbose=verbose, plot=plot)
    except RunInterruptedError as exc:
        typer.echo(f"interrupted: {exc}; no audit was computed", err=True)
        raise typer.Exit(code=130) from None
    except InvalidArgumentError as exc:
        _fail(_as_flag(exc))
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc, cfg.model_dump())
    if as_json:
        _emit(result, True)
    else:
        typer.echo(_audit_summary(result))
    typer.echo(f"audit: {result['verdict']}", err=True)
    if result["run"]["stopped_reason"]:
        typer.echo(
            f"note: the run stopped early ({result['run']['stopped_reason']}); the audit covers "
            "the "
            f"{result['run']['rounds_completed']} rounds released",
            err=True,
        )
    claimed = result["epsilon_claimed"]
    ceiling = result["canaries"]["lower_bound_ceiling"]
    if claimed is not None and ceiling <= claimed:
        from corrflow.accounting.audit import candidates_for_ceiling

        need = candidates_for_ceiling(claimed, result["delta"])
        typer.echo(
            f"note: with {result['canaries']['candidates']} candidates ε_lo can be at most "
            f"{ceiling:.3g}, below the claimed ε = {claimed:.3g}: this audit cannot prove a "
            "violation, only estimate one; "
            + (
                f"about {need} candidates (--canaries {need}) would lift the ceiling above "
                "the claim"
                if need is not None
                else f"no number of candidates up to a million lifts the ceiling above it at δ = "
                f"{result['delta']:g} (the bound's δ term grows with the count)"
            ),
            err=True,
        )
    if claimed is not None and result["epsilon_lower"] > claimed:
        raise typer.Exit(code=4)
    if result["verdict"].startswith("SUSPECT"):
        raise typer.Exit(code=AUDIT_SUSPECT_EXIT)


def _audit_summary(r: dict) -> str:
    st, c = r["statistics"], r["canaries"]
    lb = st["lower_bound"]
    lo, hi = r["epsilon_estimate_interval"]
    return "\n".join(
        [
            f"claimed     ε = {r['epsilon_claimed']:.4g} at δ = {r['delta']:g} "
            f"({r['run']['kind']}, "
            f"{r['run']['participation']}, σ = {r['run']['noise_multiplier']:.4g}, accountant "
            f"{r['run']['accountant']})",
            f"estimate    ε̂ = {r['epsilon_estimate']:.4g} (95% bootstrap interval {lo:.3g} – "
            f"{hi:.3g}); all-iterates "
            f"whitened scores: inserted mean {st['whitened']['mean']:.3g} ± "
            f"{st['whitened']['std']:.3g}, held-out "
            f"{st['whitened']['null_mean']:.3g} ± {st['whitened']['null_std']:.3g}",
            f"lower bnd   ε_lo = {r['epsilon_lower']:.4g} at {r['confidence']:.0%} confidence "
            f"({lb['correct']} of {lb['guesses_in'] + lb['guesses_out']} guesses correct; at most "
            f"{c['lower_bound_ceiling']:.3g} with {c['candidates']} candidates)",
            f"final model ε̂ = {st['final_model']['epsilon']:.4g} (cosine with θ_T − θ_0, Andrew "
            "et al.)",
            f"canaries    {c['inserted']} inserted, {c['held_out']} held out, audit seed "
            f"{c['audit_seed']}; "
            f"{c['population_share']:.1%} of the population",
            f"verdict     {r['verdict']}",
            f"files       {r['run']['dir']}/audit.json"
            + (f", {r['plot']}" if r.get("plot") else ""),
        ]
    )


def _note_report_behind_journal(report: dict, run_dir: Path) -> bool:
    """Say so when the release journal records more rounds than the report covers (and return
    True): the report is complete every ``report_every`` rounds, and a server killed in between
    leaves it behind until the run resumes."""
    journal = run_dir / JOURNAL
    if not journal.is_file():
        return False
    with open(journal, "rb") as f:
        released = sum(1 for line in f if line.endswith(b"\n"))
    covered = int(report.get("rounds_completed", 0))
    if released > covered:
        typer.echo(
            f"note: the release journal records {released} released rounds, this report covers "
            f"{covered}: the server stopped between two of its complete reports (every "
            f"{report.get('report_every', 1)} rounds); rerun the run's command to resume it — it "
            "completes the report first",
            err=True,
        )
    return released > covered


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="a run's directory (simulate's --out)")],
    plot: Annotated[
        bool, typer.Option(help="write DIR/run.png (held-out loss and ε spent per round)")
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the privacy report as one JSON object")
    ] = False,
) -> None:
    """Re-print a run's summary, the one `corrflow simulate` printed, from its files (read only,
    nothing trained), and write its loss/ε-per-round plot. Exit 2 when DIR holds no run."""
    from corrflow.planning.learnability import held_out_summary
    from corrflow.planning.plots import write_run_plot

    try:
        paths = {name: run_dir / name for name in ("privacy_report.json", "metrics.json")}
        missing = [name for name, p in paths.items() if not p.is_file()]
        if missing:
            raise InvalidArgumentError(
                "DIR", f"a run directory holding {' and '.join(missing)}", str(run_dir)
            )
        try:
            report = json.loads(paths["privacy_report.json"].read_text())
            metrics = json.loads(paths["metrics.json"].read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataFormatError(run_dir, None, f"a run's JSON files ({exc})") from None
        held_out = held_out_summary(metrics)
        if as_json:
            _emit({**report, "held_out": held_out}, True)
        else:
            typer.echo(_summary(report, run_dir, held_out))
        behind = _note_report_behind_journal(report, run_dir)
        if not behind and report.get("rounds_completed", 0) < report.get("mechanism", {}).get(
            "rounds", 0
        ):
            typer.echo(
                f"note: the run released {report['rounds_completed']} of "
                f"{report['mechanism']['rounds']} rounds"
                + (
                    f"; it stopped: {report['stopped_reason']}"
                    if report.get("stopped_reason")
                    else ""
                ),
                err=True,
            )
        if plot:
            typer.echo(f"plot: {write_run_plot(metrics, report, run_dir / 'run.png')}", err=True)
    except CorrflowError as exc:
        _fail(exc)
    except OSError as exc:
        typer.echo(f"error: {run_dir}: {exc.strerror or exc}", err=True)
        raise typer.Exit(code=1) from None


#: ``corrflow audit``'s exit code when the whole interval of the estimate lies above the claim
# but the lower bound does not prove it.
AUDIT_SUSPECT_EXIT = 5

app.command()(with_settings(audit, "audit"))


def _as_flag(exc: InvalidArgumentError) -> InvalidArgumentError:
    """The same error naming the command-line flag rather than the library's field or run-config
    key."""

    if exc.field.startswith("--"):
        return exc
    named = renamed(exc, "cli")
    return (
        named
        if named.field.startswith("--")
        else InvalidArgumentError("--" + exc.field.replace("_", "-"), exc.expected, exc.got)
    )


def _loss(value: float | None) -> str:
    """A held-out loss for the summary: a non-finite one (None in the metrics) shows as such."""
    return "non-finite" if value is None else f"{value:.4f}"


def _summary(report: dict, out: Path, held_out: dict) -> str:
    """The run in a few lines: held-out progress and the privacy report (whole:
    OUT/privacy_report.json)."""
    from corrflow.accounting.noise_scale import describe as describe_noise
    from corrflow.planning.run import selection_line

    mech, planned, realized = report["mechanism"], report["planned"], report["realized"]
    part = planned["participation"]
    eps = realized["epsilon"]
    acc = (
        f", accuracy {held_out['initial_test_accuracy']:.4f} → "
        f"{held_out['final_test_accuracy']:.4f}"
        if "final_test_accuracy" in held_out
        else ""
    )
    failed = (
        " — did not learn (exit 3)" if report.get("learning", {}).get("learned") is False else ""
    )
    drift = held_out.get("drift_above_best")
    if drift is not None and drift > report.get("learning", {}).get("drift_tolerance", 0.1):
        at = (
            "the initial model"
            if held_out["best_round"] < 0
            else f"round {held_out['best_round'] + 1}"
        )
        failed += (
            f" — drifted: {drift:.0%} above the best loss {held_out['best_test_loss']:.4f} ({at})"
        )
    change = (
        f" ({-held_out['loss_improvement']:+.1%})"
        if math.isfinite(held_out.get("loss_improvement", math.nan))
        else ""
    )
    bands = (
        "" if mech["bands"] is None else f", bands={mech['bands']}"
    )  # None: a dense (unbanded) encoder
    lines = [
        f"held-out    loss {_loss(held_out['initial_test_loss'])} → "
        f"{_loss(held_out['final_test_loss'])}{change}{acc} "
        f"over {held_out['rounds_evaluated']} rounds{failed}",
        f"mechanism   {mech['kind']} ({mech['participation']}, k={mech['epochs']}, "
        f"b={mech['min_sep']}{bands}), "
        f"{mech['rounds']} rounds; {part['kind']} ({part['mode']}) participation, expected "
        f"cohort {part['expected_cohort']:g}, k_u = {part['items_per_user']}",
        f"privacy     ε = {'n/a (non-private)' if eps is None else f'{eps:.4f}'} realised (planned "
        f"{'n/a' if planned['epsilon'] is None else format(planned['epsilon'], '.4f')}), "
        f"δ = {report['delta']:g}, σ = {report['noise_multiplier']:.4g}, clip "
        f"{report['clip_norm']:g}, accountant {report['accountant']['name']}, sampling "
        f"{report['accountant'].get('sampling', 'none')}",
        *(
            [f"noise       {describe_noise(report['noise_std_per_round'])}"]
            if report.get("noise_std_per_round")
            else []
        ),
        *(
            [f"accounting  {selection_line(report['accountant'])}"]
            if "bounds" in report["accountant"]
            else []
        ),
        _users_line(realized, out),
        *regime_lines(report),
        *_secure_aggregation_lines(report),
        *_vocabulary_lines(report),
        *(f"note        {note}" for note in mech.get("notes", [])),
        f"rounds      {report['rounds_completed']} completed"
        + (f"; stopped: {report['stopped_reason']}" if report.get("stopped_reason") else ""),
        f"report      {out / 'privacy_report.json'}",
    ]
    return "\n".join(lines)


def _secure_aggregation_lines(report: dict) -> list[str]:
    """The trust model of a ``--secagg`` run, in two summary lines."""
    sa = report.get("secure_aggregation")
    if not sa:
        return []
    return [
        f"secagg      SecAgg+: the server saw {sa['server_saw'].split(';')[0]}; threshold "
        f"{sa['reconstruction_threshold']} of {sa['neighbours']} neighbours",
        "trust       honest-but-curious server (no consistency round); it holds each noiseless "
        "sum — DP protects the released models; clients must run the clipping "
        "(privacy_report.json: secure_aggregation)",
    ]


def _vocabulary_lines(report: dict) -> list[str]:
    """The vocabulary's provenance and the total (ε, δ) with it, for a run on a dataset file."""
    vocab, total = report.get("vocabulary"), report.get("total")
    if vocab is None:
        return []
    spent = (
        f" (ε = {vocab['epsilon']:g}, δ = {vocab['delta']:g})" if vocab["source"] == "dp" else ""
    )
    lines = [f"vocabulary  {vocab['words']} words, {vocab['source']}{spent}: {vocab['note']}"]
    if total and vocab["source"] == "dp":
        eps = "n/a" if total["epsilon"] is None else f"{total['epsilon']:.4f}"
        lines.append(
            f"total       ε = {eps}, δ = {total['delta']:g} (vocabulary + training, basic "
            "composition)"
        )
    return lines


def _users_line(realized: dict, out: Path) -> str:
    users = realized["participation"]
    if "users" not in users:  # an amplified run: nothing public depends on the secret cohorts
        return (
            "users       secret cohorts (amplified ε): who trained, and the per-round reply "
            "counts, are in "
            f"{out / users['operator_only']} and {out / 'operator'} (owner-only); policy "
            f"{users['policy']}"
        )
    count = users["max_participations"]
    gap = (
        "no user trained twice" if users["min_gap"] is None else f"smallest gap {users['min_gap']}"
    )
    return (
        f"users       {len(users['users'])}, at most {count} round{'' if count == 1 else 's'} "
        f"each, {gap}; "
        f"{realized['rejections']} rejection(s), {len(users['overrides'])} override(s), "
        f"policy {users['policy']}"
    )


noise_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Correlated-noise audits.")
app.add_typer(noise_app, name="noise")
app.add_typer(data_app, name="data")
app.add_typer(runs_app, name="runs")
app.command("compare")(with_settings(compare_command, "compare"))
app.command("schema")(schema_command)


@noise_app.command("sample")
def noise_sample(
    factorization: Annotated[Path, typer.Option(help="a factorization .npz file")],
    dim: Annotated[int, typer.Option(help="D: coordinates per round")],
    seed: Annotated[
        str, typer.Option(help="audit seed: hex key of the PRNG's key length, or any text/integer")
    ],
    out: Annotated[Path, typer.Option(help="output .npy file (float32, rounds × dim)")],
    start: Annotated[
        int, typer.Option(help="first round R (the state before it is regenerated from the seed)")
    ] = 0,
    rounds: Annotated[
        int | None, typer.Option(help="number of rounds N (default: to the end)")
    ] = None,
    prng: Annotated[str, typer.Option(help="philox or chacha")] = "philox",
    mode: Annotated[str | None, typer.Option(help="override the generation mode")] = None,
    chunk_size: Annotated[
        int, typer.Option(help="coordinates per PRNG chunk (must match the server's)")
    ] = 1 << 20,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Write rows R..R+N−1 of the unit-σ noise stream, exactly as the server computes them for that
    key."""
    import numpy as np

    from corrflow.noise import CorrelatedNoise, key_from_seed

    try:
        fac = _load_factorization(factorization, "--factorization")
        if dim < 1:
            raise InvalidArgumentError("--dim", "a positive integer", dim)
        if not 0 <= start < fac.rounds:
            raise InvalidArgumentError("--start", f"a round in [0, {fac.rounds})", start)
        count = fac.rounds - start if rounds is None else rounds
        if not 1 <= count <= fac.rounds - start:
            raise InvalidArgumentError(
                "--rounds",
                f"between 1 and {fac.rounds - start} (the factorization has {fac.rounds} rounds)",
                rounds,
            )
        gen = CorrelatedNoise(
            fac,
            [(dim,)],
            1.0,
            key=key_from_seed(seed, prng),
            prng=prng,
            mode=mode,
            chunk_size=chunk_size,
        )
        gen.skip_to(start)
        rows = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(count, dim))
        for i in range(count):
            rows[i] = gen.next(start + i)[0]
        rows.flush()
        _emit(
            {
                "path": str(out),
                "rounds": count,
                "start": start,
                "dim": dim,
                "mode": gen.mode,
                "prng": prng,
                "factorization_sha256": fac.sha256(),
            },
            as_json,
        )
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)


def main() -> None:
    try:
        app()
    except InvalidArgumentError as exc:  # raised before a command could catch it
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
