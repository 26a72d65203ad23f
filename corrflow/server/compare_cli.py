"""The ``corrflow compare`` command (registered by `corrflow.server.cli`)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from corrflow.config import validated_fields
from corrflow.errors import CorrflowError, DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.factorization.registry import KINDS
from corrflow.paths import writable_directory
from corrflow.server.options import cli_values, file_error_message

# The comparison and the clients are imported inside the command: at module level they would load
# Flower, the PLD library and numba into every `corrflow --help`.

# The settings' and the presets' names for the settings compare's flags set.
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
    "vocab-path": "--vocab",
    "kappa": "--kappa",
    "proxy-data": "--proxy-data",
}


def _data_users(data: Path, vocab: Path | None, users: int | None) -> int:
    """--users for a comparison on a dataset file: default every training partition; more is
    refused."""
    from corrflow.data.federated import train_clients_count

    if not data.is_file():
        raise InvalidArgumentError(
            "--data",
            "an existing dataset file (TFF StackOverflow SQLite or arXiv JSON lines)",
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


def compare_command(
    preset: Annotated[
        str,
        typer.Option(
            help="quick (ε = 8, 1000 users, cohort 100, 40 rounds, 3 seeds), large (ε = 8, "
            "δ = 1e-6, 50000 users, cohort 500, 100 rounds, k = 1, 2 seeds: the papers' "
            "cohort/population ratio), stackoverflow (000's schedule: 2,052 rounds, k = 6, "
            "δ = 1e-6, cohort 44, 15048 users, 1 seed) or tiny (the test suite's)"
        ),
    ] = "quick",
    kinds: Annotated[
        str,
        typer.Option(
            help="correlated-noise kinds, comma-separated (toeplitz = banded Toeplitz;"
            " dense, bifr, banded, …); nonprivate, dpsgd, dpsgd-poisson and plan "
            "always run"
        ),
    ] = "toeplitz",
    amplified: Annotated[
        bool,
        typer.Option(
            "--amplified",
            help="also run each kind under the cyclic Poisson "
            "sampler its registry entry allows, with its own separation b < "
            "users/cohort chosen by the planner, accounted with amplification",
        ),
    ] = False,
    seeds: Annotated[int | None, typer.Option(help="seeds 0..S−1 (default: the preset's)")] = None,
    epsilons: Annotated[
        str | None,
        typer.Option(
            help="a sweep: every arm at each ε, comma-separated (e.g. "
            "1,2,4,8,16); writes accuracy_vs_epsilon.png and "
            "loss_vs_epsilon.png"
        ),
    ] = None,
    epsilon: Annotated[
        float | None,
        typer.Option(hidden=True, help="deprecated: --target-epsilon E (the same as --epsilons E)"),
    ] = None,
    out: Annotated[
        Path,
        typer.Option(
            help="output directory (comparison.json, curves_eps<ε>.csv, PNG plots, "
            "runs/, eps<ε>/ with each ε's runs and recipes, cache/)"
        ),
    ] = Path("corrflow_compare"),
    backend: Annotated[
        str,
        typer.Option(
            help="inprocess (deterministic, no Ray), flower, or cohort (a round's clients "
            "trained together in process)"
        ),
    ] = "inprocess",
    kappa: Annotated[
        float | None,
        typer.Option(
            help="κ for the plan arm's score (server lr × curvature per round); default: measured "
            "on --proxy-data, on the synthetic generator with another seed (presets), else "
            "assumed 0.1"
        ),
    ] = None,
    proxy_data: Annotated[
        Path | None,
        typer.Option(
            help="PUBLIC data (a format --data reads) on which the plan arm's κ is measured by a "
            "short non-private run; not accounted: never the private --data"
        ),
    ] = None,
    proxy_vocab: Annotated[Path | None, typer.Option(help="the vocabulary of --proxy-data")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    **settings,
) -> None:
    """Train non-private, DP-SGD (fixed-epoch and Poisson-sampled), correlated-noise and planned
    arms at the same (ε, δ), for each ε of a sweep, and compare held-out accuracy. Exit 1 when an
    arm's run did not verify its ε at the target δ or stopped before its planned rounds (the table
    says which and why), 2 bad arguments, 130 interrupted. Rerunning the same command continues an
    interrupted comparison: finished arms are kept (unless the arm is now planned otherwise: then
    it retrains, its old result set aside), unfinished ones restart afresh (their earlier run moved
    aside); other settings are refused, naming what differs. --target-epsilon E is
    --epsilons E."""
    from corrflow.clients.tasks import training_defaults
    from corrflow.planning.score import Damping
    from corrflow.server.compare import (
        PRESETS,
        compare,
        json_summary,
        parse_epsilons,
        plan_request,
        settings_differences,
        stderr_progress,
        table,
        with_overrides,
    )
    from corrflow.server.simulation import RunInterruptedError, quiet_native_logs

    files = dict(settings)  # the flags' values, for naming a data file's flag in an error
    try:
        if preset not in PRESETS:
            raise InvalidArgumentError("--preset", f"one of {', '.join(PRESETS)}", preset)
        if backend not in ("inprocess", "flower", "cohort"):
            raise InvalidArgumentError("--backend", "inprocess, flower or cohort", backend)
        values = validated_fields(cli_values(settings), "cli")
        if epsilon is not None:
            typer.echo("warning: --epsilon is deprecated: use --target-epsilon", err=True)
            if "target_epsilon" in values:
                raise InvalidArgumentError(
                    "--epsilon", "either --target-epsilon or (deprecated) --epsilon", epsilon
                )
            values.update(validated_fields({"target_epsilon": epsilon}, "cli"))
        epsilon = values.get("target_epsilon")
        client = values.get("client")
        users = values.get("num_users")
        data = Path(values["data_path"]) if values.get("data_path") else None
        vocab = Path(values["vocab_path"]) if values.get("vocab_path") else None
        if seeds is not None and seeds < 1:
            raise InvalidArgumentError("--seeds", "a positive integer", seeds)
        kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
        correlated = [k for k in KINDS if k != "dpsgd"]
        bad = [k for k in kind_list if k not in correlated]
        if bad or not kind_list:
            raise InvalidArgumentError(
                "--kinds",
                f"correlated-noise kinds from {', '.join(correlated)} (nonprivate, "
                "dpsgd, dpsgd-poisson and plan always run)",
                ",".join(bad) or kinds,
            )
        if epsilons is not None and epsilon is not None:
            raise InvalidArgumentError(
                "--target-epsilon",
                "either --target-epsilon E or --epsilons E1,E2,… (--target-epsilon E means "
                "--epsilons E)",
                f"--target-epsilon {epsilon:g} --epsilons {epsilons}",
            )
        sweep = (
            parse_epsilons(epsilons)
            if epsilons is not None
            else (epsilon,)
            if epsilon is not None
            else None
        )
        writable_directory(out, "--out")
        if data is not None:
            users = _data_users(data, vocab, users)
        if kappa is not None and not (math.isfinite(kappa) and kappa >= 0):
            raise InvalidArgumentError("--kappa", "a finite number ≥ 0", kappa)
        if proxy_data is not None:
            if not proxy_data.is_file():
                raise InvalidArgumentError(
                    "--proxy-data",
                    "an existing public dataset file (a format --data reads)",
                    str(proxy_data),
                )
            if proxy_vocab is None or not proxy_vocab.is_file():
                raise InvalidArgumentError(
                    "--proxy-vocab", "the vocabulary file of --proxy-data", str(proxy_vocab)
                )
            if kappa is not None:
                raise InvalidArgumentError(
                    "--kappa", "either --kappa or --proxy-data (one source of κ)", kappa
                )
            if data is not None and proxy_data.resolve() == data.resolve():
                raise InvalidArgumentError(
                    "--proxy-data",
                    "public data other than the private --data (κ measured on --data would "
                    "spend privacy that no accountant counts)",
                    str(proxy_data),
                )
        elif proxy_vocab is not None:
            raise InvalidArgumentError("--proxy-data", "a dataset file with --proxy-vocab", None)
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
        if (
            client is not None and client != PRESETS[preset].client
        ):  # that client's optimizer settings
            chosen = with_overrides(chosen, **training_defaults(client))
        if kappa is not None:  # a κ the preset's optimizer converges at, before any write
            plan_request(chosen, chosen.epsilon, damping=Damping(kappa, "declared"))
        settings = {
            "preset": asdict(chosen),
            "kinds": kind_list,
            "epsilons": list(sweep or (chosen.epsilon,)),
            "amplified": amplified,
            "backend": backend,
        }
        if (out / "comparison.json").exists() or (out / "runs").exists():
            diff = settings_differences(out, settings)
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
                f"continuing the comparison in {out}: finished arms are kept, unfinished ones "
                "restart afresh",
                err=True,
            )
        quiet_native_logs()
        logging.getLogger("corrflow").setLevel(
            logging.ERROR
        )  # the non-private arm's warning is expected here
        try:
            result = compare(
                chosen,
                kind_list,
                out,
                backend=backend,
                progress=stderr_progress,
                epsilons=sweep,
                amplified=amplified,
                settings=settings,
            )
        except (RunInterruptedError, KeyboardInterrupt):
            typer.echo(
                f"interrupted: the finished arms are kept in {out}; rerun the same command to "
                "continue (unfinished arms restart afresh)",
                err=True,
            )
            raise typer.Exit(code=130) from None
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
            raise typer.Exit(code=1)
        if result["stopped"]:
            raise typer.Exit(code=1)
    except (CorrflowError, IntegrityError) as exc:
        if (
            isinstance(exc, InvalidArgumentError) and exc.field in _FLAGS
        ):  # an arm's setting, named as typed
            exc = InvalidArgumentError(_FLAGS[exc.field], exc.expected, exc.got)
        typer.echo(f"error: {file_error_message(exc, files)}", err=True)
        raise typer.Exit(
            code=2 if isinstance(exc, (InvalidArgumentError, DataFormatError)) else 1
        ) from exc
