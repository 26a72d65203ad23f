"""``corrflow plan``: choose the mechanism for a training run and write its recipe."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Annotated

import typer

from corrflow.choices import Accountant
from corrflow.cli.common import check_proxy_files, emit, fail
from corrflow.cli.options import Verbosity, cli_values
from corrflow.config import RunConfig, validated, validated_fields
from corrflow.errors import CorrflowError, DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.factorization.registry import KINDS
from corrflow.paths import writable_directory
from corrflow.planning.cache import PlanCache, default_cache_dir
from corrflow.planning.candidates import PlanRequest, make_plan, write_plan
from corrflow.planning.resources import check_fits, estimate
from corrflow.planning.score import Damping

Cohort = Annotated[
    int, typer.Option(help="B: users per round (b = ⌊P/B⌋ rounds between a user's turns)")
]
MemoryBudget = Annotated[
    str | None,
    typer.Option(help="bytes the noise state may take (8e9, 8GB, 512MiB; default: no limit)"),
]
NoiseTimeBudget = Annotated[
    float | None, typer.Option(help="seconds of noise generation per round (default: no limit)")
]
Kinds = Annotated[
    str,
    typer.Option(
        help=f"comma-separated factorization kinds to consider (from: {', '.join(KINDS)})"
    ),
]
Accountants = Annotated[
    str | None,
    typer.Option(
        help=f"comma-separated accountants: {', '.join(a.value for a in Accountant)} "
        "(default: the cheap ones; the plan lists what it skipped)"
    ),
]
TimeBudget = Annotated[
    float | None,
    typer.Option(
        help="wall-clock seconds after which the plan aborts with exit 1 and writes no recipe, "
        "at most 604800 (a week; default: no limit; the recipe never depends on it)"
    ),
]
DenseIterations = Annotated[
    int | None,
    typer.Option(
        help="iteration budget of the dense optimizer (default: ⌈1e12/n³⌉, at most 10000: the "
        "same on any machine)"
    ),
]
Kappa = Annotated[
    float | None,
    typer.Option(
        help="κ of your task (server lr × loss curvature per round) for the planner's score, the "
        "closed-loop error of the final model; default: measured on --proxy-data, else the "
        "default 0.1 (assumed, and said so)"
    ),
]
ProxyData = Annotated[
    Path | None,
    typer.Option(
        help="PUBLIC data in a format --data reads, to measure κ by a short non-private run "
        "(seconds to minutes; the time is printed). It is not accounted: never give the private "
        "training data"
    ),
]
ProxyVocab = Annotated[
    Path | None, typer.Option(help="the vocabulary of --proxy-data (corrflow data vocab)")
]
ProxyBackend = Annotated[
    str,
    typer.Option(
        help="the engine of κ's proxy run: inprocess (a ClientApp message per user) or cohort (a "
        "round's users trained together; numpy and nextword clients)"
    ),
]
Out = Annotated[
    Path, typer.Option(help="output directory: recipe.json, factorization.npz, plan.json, plots")
]
CacheDir = Annotated[
    Path | None,
    typer.Option(
        help="cache of factorizations and calibrations (default: $CORRFLOW_HOME/cache, else "
        "OUT/cache)"
    ),
]

#: The planner's names for what the flags set (its errors name these).
_PLAN_FLAGS = {"population": "--users", "cohort-size": "--cohort", "model-params": "--model-dim"}


def plan(
    cohort: Cohort,
    memory_budget: MemoryBudget = None,
    noise_time_budget: NoiseTimeBudget = None,
    kinds: Kinds = "dpsgd,toeplitz,bifr,dense",
    accountants: Accountants = None,
    time_budget: TimeBudget = None,
    dense_iterations: DenseIterations = None,
    kappa: Kappa = None,
    proxy_data: ProxyData = None,
    proxy_vocab: ProxyVocab = None,
    backend: ProxyBackend = "inprocess",
    out: Out = Path("corrflow_plan"),
    cache_dir: CacheDir = None,
    plots: Annotated[bool, typer.Option(help="write the PNG plots")] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print plan.json as one JSON object")
    ] = False,
    verbose: Verbosity = None,
    **settings,
) -> None:
    """Choose the mechanism for a training run: build and calibrate every candidate, rank them
    within the memory and noise-time budgets by the closed-loop error of the final model (the noise
    left when training pulls the model back by κ per round; κ from --kappa, measured on
    --proxy-data, or assumed), print why the pick wins and the plain-RMSE ranking beside it, and
    write the recommended recipe (OUT/recipe.json, for `corrflow simulate --plan`), its
    factorization, plan.json and plots. Exit 1 when no candidate fits. The workload is the server
    optimizer's, as in simulate (--momentum: the --client's default)."""
    quiet = verbose is False
    try:
        cfg, users, model_dim = _plan_settings(settings)
        _check_kappa_source(cfg, kappa, proxy_data, proxy_vocab)
        _check_backend(cfg, backend)
        req = PlanRequest(
            rounds=cfg.num_rounds,
            population=users,
            cohort_size=cohort,
            target_epsilon=cfg.target_epsilon,
            delta=cfg.delta,
            memory_budget=byte_size(memory_budget, "--memory-budget"),
            noise_time_budget=math.inf if noise_time_budget is None else noise_time_budget,
            model_params=model_dim,
            kinds=_listed(kinds),
            accountants=None if accountants is None else _listed(accountants),
            momentum=cfg.momentum,
            cooldown_fraction=cfg.cooldown_fraction,
            time_budget=time_budget,
            dense_iterations=dense_iterations,
        )
    except InvalidArgumentError as exc:
        field = _PLAN_FLAGS.get(exc.field, exc.field)
        flag = field if field.startswith("--") else "--" + field.replace("_", "-")
        fail(InvalidArgumentError(flag, exc.expected, exc.got))
    req = _with_damping(req, cfg, kappa, (proxy_data, proxy_vocab, backend), quiet)
    doc = _write_plan(req, cfg, model_dim, out, cache_dir, plots, quiet)
    if as_json:
        emit(doc, True)
    else:
        typer.echo(plan_table(doc, out))
    if doc["recommended"] is None:
        typer.echo(
            "error: no candidate fits the memory and noise-time budgets (plan.json lists every "
            "candidate and what it exceeds)",
            err=True,
        )
        raise typer.Exit(code=1)


def _listed(text: str) -> tuple[str, ...]:
    """The items of a comma-separated flag value."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _plan_settings(settings: dict) -> tuple[RunConfig, int, int]:
    """The run settings the plan shares with simulate, and --users and --model-dim (checked on
    their own: the plan's population is not a simulated one, and the model is not the numpy
    client's)."""
    values = cli_values(settings)
    own = validated_fields(
        {"num_users": values.pop("num_users"), "model_dim": values.pop("model_dim")}, "cli"
    )
    return validated(values, "cli"), own["num_users"], own["model_dim"]


def _check_kappa_source(
    cfg: RunConfig, kappa: float | None, proxy_data: Path | None, proxy_vocab: Path | None
) -> None:
    """Refuse (naming the flag) a κ source that cannot be used: at most one of --kappa and
    --proxy-data, a proxy dataset with its vocabulary, and a client that trains on text files."""
    if kappa is not None:
        Damping(kappa, "declared")  # refuses a negative or non-finite κ, naming --kappa
    if proxy_data is None:
        if proxy_vocab is not None:
            raise InvalidArgumentError("--proxy-data", "a dataset file with --proxy-vocab", None)
        return
    if cfg.client not in ("nextword", "keras"):
        raise InvalidArgumentError(
            "--client",
            "a client that trains on text files (nextword or keras) with --proxy-data",
            cfg.client,
        )
    check_proxy_files(proxy_data, proxy_vocab, kappa)


def _check_backend(cfg: RunConfig, backend: str) -> None:
    """An engine the proxy run can train the --client on."""
    # The proxy run's module loads Flower: only when a plan runs.
    from corrflow.server.proxy import check_proxy_backend

    check_proxy_backend(cfg.client, backend)


def _with_damping(
    req: PlanRequest,
    cfg: RunConfig,
    kappa: float | None,
    proxy: tuple[Path | None, Path | None, str],
    quiet: bool,
) -> PlanRequest:
    """The request with the planner's κ: declared, measured on the proxy data (``proxy``: the
    file, its vocabulary and the engine), or assumed."""
    # Flower's in-process engine measures κ on the proxy data: imported only when a plan runs.
    from corrflow.server.proxy import damping_for

    proxy_data, proxy_vocab, backend = proxy
    try:
        if proxy_data is not None and not quiet:
            typer.echo("plan: measuring κ on the proxy data (a non-private run) …", err=True)
        damping = damping_for(
            cfg,
            req.population,
            req.cohort_size,
            kappa=kappa,
            proxy_data=str(proxy_data or ""),
            proxy_vocab=str(proxy_vocab or ""),
            backend=backend,
        )
        return dataclasses.replace(req, damping=damping)  # refuses a κ training diverges at
    except (CorrflowError, DataFormatError) as exc:
        fail(exc)


def _write_plan(
    req: PlanRequest,
    cfg: RunConfig,
    model_dim: int,
    out: Path,
    cache_dir: Path | None,
    plots: bool,
    quiet: bool,
) -> dict:
    """Rank the candidates and write the plan's files; returns plan.json's content."""
    try:
        # the cheapest candidate (Toeplitz, one band) must fit before anything is written
        check_fits(
            estimate(0, cfg.num_rounds, "toeplitz", 1, model_dim),
            {"users": "--users", "factorization": "--rounds", "noise": "--model-dim"},
        )
        writable_directory(out, "--out")
        if cache_dir is not None:
            writable_directory(cache_dir, "--cache-dir")
        cache = PlanCache(cache_dir or default_cache_dir(out))
        result = make_plan(req, cache, quiet=quiet)
        return write_plan(result, out, plots=plots, cache=cache, quiet=quiet)
    except (CorrflowError, IntegrityError) as exc:
        fail(exc)


def byte_size(text: str | None, flag: str) -> float:
    """Bytes from '8e9', '8GB', '512MiB', ... (decimal and binary suffixes).

    Args:
        text: the flag's value; None means no budget.
        flag: the flag, named in the error.

    Returns:
        The size in bytes (infinite for None).

    Raises:
        InvalidArgumentError: not a size ≥ 0.
    """
    if text is None:
        return math.inf
    expected = "a size in bytes such as 8e9, 8GB or 512MiB"
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not m:
        raise InvalidArgumentError(flag, expected, text)
    try:
        value = float(m.group(1))
    except ValueError:
        raise InvalidArgumentError(flag, expected, text) from None
    unit = (m.group(2) or "").lower()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    scale |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(flag, "a size ≥ 0", text)
    return value * scale[unit]


def plan_table(doc: dict, out: Path, top: int = 10) -> str:
    """The plan for people.

    Args:
        doc: plan.json's content.
        out: the plan's directory.
        top: the candidates listed (the rest are counted).

    Returns:
        The candidates ranked, what was skipped, the pick and why, as aligned text.
    """
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
        f"{'RMSE #':>6} {'max err':>10} {'×DP-SGD':>8} {'noise MB':>10} {'noise s/rd':>10} "
        f"{'build s':>8}",
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
        lines += _sigma_lines(rec, out)
        lines += _why_lines(score)
        lines.append(
            f"plan           {out / 'recipe.json'} (corrflow simulate --plan); "
            f"{out / 'plan.json'}; {doc['seconds']:.1f} s"
        )
    pngs = [str(out / f) for f in (doc.get("files") or {}).values() if str(f).endswith(".png")]
    if pngs:
        lines.append(f"plots          {', '.join(pngs)}")
    return "\n".join(lines)


def _sigma_lines(rec: dict, out: Path) -> list[str]:
    """The recommended σ in both conventions, through the factorization the plan wrote."""
    from corrflow.accounting.noise_scale import both_conventions
    from corrflow.factorization.base import Factorization

    try:
        fac = Factorization.load(out / "factorization.npz")
    except (OSError, CorrflowError, IntegrityError, ValueError):
        return []
    if fac.sha256() != rec.get("factorization_sha256", fac.sha256()):
        return []
    return [f"σ              {both_conventions(fac, rec['noise_multiplier'])}"]


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
