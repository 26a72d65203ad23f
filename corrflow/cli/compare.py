"""``corrflow compare``: train non-private, DP-SGD, correlated-noise and planned arms at the same
(ε, δ) and compare their held-out accuracy.

The comparison itself (`corrflow.server.compare`) trains with Flower's messages and so loads Flower:
it is imported inside the steps that use it, so that `corrflow --help` does not load it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from corrflow.cli.common import AsJson, check_proxy_files
from corrflow.cli.options import cli_values, file_error_message
from corrflow.clients.tasks import training_defaults
from corrflow.config import validated_fields
from corrflow.data.federated import train_clients_count
from corrflow.errors import CorrflowError, DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.factorization.registry import KINDS
from corrflow.paths import writable_directory
from corrflow.planning.score import Damping
from corrflow.server.arm_pool import check_jobs

#: The settings' and the presets' names for the settings compare's flags set.
_FLAGS = {
    "num-rounds": "--rounds",
    "num-users": "--users",
    "target-epsilon": "--epsilons",
    "epochs": "--epochs",
    "delta": "--delta",
    "seeds": "--seeds",
    "kinds": "--kinds",
    "client": "--client",
    "epsilons": "--epsilons",
    "users": "--users",
    "cohort-size": "--users",
    "population": "--users",
    "rounds": "--rounds",
    "data-path": "--data",
    "data": "--data",
    "vocab-path": "--vocab",
    "kappa": "--kappa",
    "proxy-data": "--proxy-data",
    "jobs": "--jobs",
}

PresetName = Annotated[
    str,
    typer.Option(
        "--preset",
        help="quick (ε = 8, 1000 users, cohort 100, 40 rounds, 3 seeds), large (ε = 8, δ = 1e-6, "
        "50000 users, cohort 500, 100 rounds, k = 1, 2 seeds: the papers' cohort/population "
        "ratio), stackoverflow (000's schedule: 2,052 rounds, k = 6, δ = 1e-6, cohort 44, 15048 "
        "users, 1 seed) or tiny (the test suite's)",
    ),
]
Kinds = Annotated[
    str,
    typer.Option(
        help="correlated-noise kinds, comma-separated (toeplitz = banded Toeplitz; dense, bifr, "
        "banded, …); nonprivate, dpsgd, dpsgd-poisson and plan always run"
    ),
]
Amplified = Annotated[
    bool,
    typer.Option(
        "--amplified",
        help="also run each kind under the cyclic Poisson sampler its registry entry allows, with "
        "its own separation b < users/cohort chosen by the planner, accounted with amplification",
    ),
]
Seeds = Annotated[int | None, typer.Option(help="seeds 0..S−1 (default: the preset's)")]
Epsilons = Annotated[
    str | None,
    typer.Option(
        help="ε each private arm's σ is calibrated for; several, comma-separated (e.g. "
        "1,2,4,8,16), sweep every arm over them and write accuracy_vs_epsilon.png and "
        "loss_vs_epsilon.png (default: the preset's ε)"
    ),
]
Out = Annotated[
    Path,
    typer.Option(
        help="output directory (comparison.json, curves_eps<ε>.csv, PNG plots, runs/, eps<ε>/ "
        "with each ε's runs and recipes, cache/)"
    ),
]
Backend = Annotated[
    str,
    typer.Option(
        help="inprocess (deterministic, no Ray), flower, or cohort (a round's clients trained "
        "together in process)"
    ),
]
Kappa = Annotated[
    float | None,
    typer.Option(
        help="κ for the plan arm's score (server lr × curvature per round); default: measured on "
        "--proxy-data, on the synthetic generator with another seed (presets), else assumed 0.1"
    ),
]
ProxyData = Annotated[
    Path | None,
    typer.Option(
        help="PUBLIC data (a format --data reads) on which the plan arm's κ is measured by a short "
        "non-private run; not accounted: never the private --data"
    ),
]
ProxyVocab = Annotated[Path | None, typer.Option(help="the vocabulary of --proxy-data")]
Jobs = Annotated[
    int,
    typer.Option(
        help="arms trained at once, each in its own process (results as with 1; about one core "
        "each; 1 with --backend flower)"
    ),
]


def compare_command(
    preset: PresetName = "quick",
    kinds: Kinds = "toeplitz",
    amplified: Amplified = False,
    seeds: Seeds = None,
    epsilons: Epsilons = None,
    out: Out = Path("corrflow_compare"),
    backend: Backend = "inprocess",
    kappa: Kappa = None,
    proxy_data: ProxyData = None,
    proxy_vocab: ProxyVocab = None,
    jobs: Jobs = 1,
    as_json: AsJson = False,
    **settings,
) -> None:
    """Train non-private, DP-SGD (fixed-epoch and Poisson-sampled), correlated-noise and planned
    arms at the same (ε, δ), for each ε of --epsilons, and compare held-out accuracy. Exit 1 when
    an arm's run did not verify its ε at the target δ or stopped before its planned rounds (the
    table says which and why), 2 bad arguments, 130 interrupted. Rerunning the same command
    continues an interrupted comparison: finished arms are kept (unless the arm is now planned
    otherwise: then it retrains, its old result set aside), unfinished ones restart afresh (their
    earlier run moved aside); other settings are refused, naming what differs."""
    files = dict(settings)  # the flags' values, for naming a data file's flag in an error
    try:
        kind_list = _kind_list(kinds)
        values = validated_fields(cli_values(settings), "cli")
        sweep = _sweep(epsilons)
        check_jobs(jobs, backend)
        chosen = _chosen_preset(preset, backend, seeds, values, kappa, proxy_data, proxy_vocab, out)
        record = {
            "preset": asdict(chosen),
            "kinds": kind_list,
            "epsilons": list(sweep or (chosen.epsilon,)),
            "amplified": amplified,
            "backend": backend,
        }
        _check_continuation(out, record)
        result = _run_comparison(chosen, kind_list, out, sweep, record, jobs)
        _print_result(result, out, as_json)
    except (CorrflowError, IntegrityError) as exc:
        # an arm's setting, named as typed
        if isinstance(exc, InvalidArgumentError) and exc.field in _FLAGS:
            exc = InvalidArgumentError(_FLAGS[exc.field], exc.expected, exc.got)
        typer.echo(f"error: {file_error_message(exc, files)}", err=True)
        raise typer.Exit(
            code=2 if isinstance(exc, (InvalidArgumentError, DataFormatError)) else 1
        ) from exc


def _kind_list(kinds: str) -> list[str]:
    """The correlated-noise kinds of --kinds (the baselines always run)."""
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    correlated = [k for k in KINDS if k != "dpsgd"]
    bad = [k for k in kind_list if k not in correlated]
    if bad or not kind_list:
        raise InvalidArgumentError(
            "--kinds",
            f"correlated-noise kinds from {', '.join(correlated)} (nonprivate, dpsgd, "
            "dpsgd-poisson and plan always run)",
            ",".join(bad) or kinds,
        )
    return kind_list


def _sweep(epsilons: str | None) -> tuple[float, ...] | None:
    """The ε of --epsilons, sorted and without repeats (None: the preset's)."""
    from corrflow.server.compare import parse_epsilons

    return None if epsilons is None else parse_epsilons(epsilons)


def _chosen_preset(
    preset: str,
    backend: str,
    seeds: int | None,
    values: dict,
    kappa: float | None,
    proxy_data: Path | None,
    proxy_vocab: Path | None,
    out: Path,
):
    """The preset with the flags' overrides (and the client's optimizer when --client changes it);
    every flag checked before anything is written."""
    from corrflow.server.compare import PRESETS, plan_request, with_overrides

    if preset not in PRESETS:
        raise InvalidArgumentError("--preset", f"one of {', '.join(PRESETS)}", preset)
    if backend not in ("inprocess", "flower", "cohort"):
        raise InvalidArgumentError("--backend", "inprocess, flower or cohort", backend)
    if seeds is not None and seeds < 1:
        raise InvalidArgumentError("--seeds", "a positive integer", seeds)
    client, users = values.get("client"), values.get("num_users")
    data = Path(values["data_path"]) if values.get("data_path") else None
    vocab = Path(values["vocab_path"]) if values.get("vocab_path") else None
    writable_directory(out, "--out")
    if data is not None:
        users = _data_users(data, vocab, users)
    _check_kappa_source(kappa, proxy_data, proxy_vocab, data)
    chosen = with_overrides(
        PRESETS[preset],
        seeds=seeds,
        delta=values.get("delta"),
        rounds=values.get("num_rounds"),
        users=users,
        epochs=values.get("epochs"),
        client=client,
        data_path=None if data is None else str(data),
        vocab_path=None if vocab is None else str(vocab),
        kappa=kappa,
        eval_every=values.get("eval_every"),
        proxy_data=None if proxy_data is None else str(proxy_data),
        proxy_vocab=None if proxy_vocab is None else str(proxy_vocab),
    )
    if client is not None and client != PRESETS[preset].client:  # that client's optimizer
        chosen = with_overrides(chosen, **training_defaults(client))
    if kappa is not None:  # a κ the preset's optimizer converges at, before any write
        plan_request(chosen, chosen.epsilon, damping=Damping(kappa, "declared"))
    return chosen


def _data_users(data: Path, vocab: Path | None, users: int | None) -> int:
    """--users for a comparison on a dataset file: default every training partition; more is
    refused."""
    if not data.is_file():
        raise InvalidArgumentError(
            "--data",
            "an existing dataset file (TFF StackOverflow SQLite)",
            str(data),
        )
    if vocab is None or not vocab.is_file():
        raise InvalidArgumentError(
            "--vocab", "a vocabulary file (corrflow data vocab) with --data", vocab
        )
    count = train_clients_count(str(data))
    if users is not None and users > count:
        raise InvalidArgumentError(
            "--users", f"at most the {count} training partitions of {data}", users
        )
    return count if users is None else users


def _check_kappa_source(
    kappa: float | None, proxy_data: Path | None, proxy_vocab: Path | None, data: Path | None
) -> None:
    """At most one source of κ; a proxy dataset with its vocabulary, never the private --data."""
    if kappa is not None and not (math.isfinite(kappa) and kappa >= 0):
        raise InvalidArgumentError("--kappa", "a finite number ≥ 0", kappa)
    if proxy_data is None:
        if proxy_vocab is not None:
            raise InvalidArgumentError("--proxy-data", "a dataset file with --proxy-vocab", None)
        return
    check_proxy_files(proxy_data, proxy_vocab, kappa)
    if data is not None and proxy_data.resolve() == data.resolve():
        raise InvalidArgumentError(
            "--proxy-data",
            "public data other than the private --data (κ measured on --data would spend privacy "
            "that no accountant counts)",
            str(proxy_data),
        )


def _check_continuation(out: Path, record: dict) -> None:
    """A comparison already in --out continues only with the same settings (naming what
    differs)."""
    from corrflow.server.compare import settings_differences

    if not ((out / "comparison.json").exists() or (out / "runs").exists()):
        return
    diff = settings_differences(out, record)
    if diff is None:
        raise InvalidArgumentError(
            "--out", "a new or empty directory (it holds a previous comparison)", str(out)
        )
    if diff:
        raise InvalidArgumentError(
            "--out",
            "the settings of the comparison it holds, to continue it (or a new --out)",
            "; ".join(diff),
        )
    typer.echo(
        f"continuing the comparison in {out}: finished arms are kept, unfinished ones restart "
        "afresh",
        err=True,
    )


def _run_comparison(
    chosen,
    kind_list: list[str],
    out: Path,
    sweep: tuple[float, ...] | None,
    record: dict,
    jobs: int = 1,
) -> dict:
    """Train every arm, ``jobs`` at once (exit 130 when interrupted: the finished arms are
    kept)."""
    from corrflow.server.compare import compare, stderr_progress
    from corrflow.server.simulation import RunInterruptedError, quiet_native_logs

    quiet_native_logs()
    # the non-private arm's warning is expected here
    logging.getLogger("corrflow").setLevel(logging.ERROR)
    try:
        return compare(
            chosen,
            kind_list,
            out,
            backend=record["backend"],
            progress=stderr_progress,
            epsilons=sweep,
            amplified=record["amplified"],
            settings=record,
            jobs=jobs,
        )
    except (RunInterruptedError, KeyboardInterrupt):
        typer.echo(
            f"interrupted: the finished arms are kept in {out}; rerun the same command to "
            "continue (unfinished arms restart afresh)",
            err=True,
        )
        raise typer.Exit(code=130) from None


def _print_result(result: dict, out: Path, as_json: bool) -> None:
    """The table (and the JSON summary), then exit 1 naming the arms that stopped or did not
    verify their ε."""
    from corrflow.server.compare import json_summary, table

    text = table(result)
    if as_json:
        typer.echo(text, err=True)
        print(json.dumps(json_summary(result), sort_keys=True))
    else:
        typer.echo(text)
        typer.echo(f"plots: {', '.join(result['plots'])}; details: {out / 'comparison.json'}")
    if result["stopped"]:
        typer.echo(
            "error: these arms' runs stopped before their planned rounds: "
            f"{'; '.join(result['stopped'])}",
            err=True,
        )
    if result["unverified"]:
        typer.echo(
            "error: these arms' runs did not verify their ε at the target δ: "
            f"{', '.join(result['unverified'])} (see their privacy_report.json)",
            err=True,
        )
    if result["stopped"] or result["unverified"]:
        raise typer.Exit(code=1)
