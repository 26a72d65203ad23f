"""The ``corrflow compare`` command (registered by :mod:`corrflow.server.cli`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from corrflow.errors import CorrflowError, DataFormatError, IntegrityError, InvalidArgumentError

# StrategyConfig's names for the settings compare's flags set.
_FLAGS = {"num-rounds": "--rounds", "num-users": "--users", "target-epsilon": "--epsilon", "epochs": "--epochs",
          "delta": "--delta", "seeds": "--seeds", "kinds": "--kinds", "client": "--client", "data-path": "--data",
          "vocab-path": "--vocab"}


def _data_users(data: Path, vocab: Path | None, users: int | None) -> int:
    """--users for a comparison on a dataset file: default every training partition; more is refused."""
    from corrflow.data.federated import train_clients_count

    if not data.is_file():
        raise InvalidArgumentError("--data", "an existing dataset file (TFF StackOverflow SQLite or arXiv JSON lines)",
                                   str(data))
    if vocab is None or not vocab.is_file():
        raise InvalidArgumentError("--vocab", "a vocabulary file (corrflow data vocab) with --data", vocab)
    count = train_clients_count(str(data))
    if users is not None and users > count:
        raise InvalidArgumentError("--users", f"at most the {count} training partitions of {data}", users)
    return count if users is None else users


def compare_command(
    preset: Annotated[str, typer.Option(help="quick (ε = 8, 1000 users, cohort 100, 40 rounds, 3 seeds) or tiny "
                                             "(the test suite's)")] = "quick",
    kinds: Annotated[str, typer.Option(help="correlated-noise kinds, comma-separated (toeplitz = banded Toeplitz;"
                                            " dense, bifr, banded, …); nonprivate and dpsgd always run")]
    = "toeplitz",
    seeds: Annotated[int | None, typer.Option(help="seeds 0..S−1 (default: the preset's)")] = None,
    epsilon: Annotated[float | None, typer.Option(help="ε of every private arm (default: the preset's)")] = None,
    delta: Annotated[float | None, typer.Option(help="δ (default: the preset's)")] = None,
    rounds: Annotated[int | None, typer.Option(help="rounds n (default: the preset's)")] = None,
    users: Annotated[int | None, typer.Option(help="users (default: the preset's)")] = None,
    epochs: Annotated[int | None, typer.Option(help="participations per user k (default: the preset's)")] = None,
    client: Annotated[str | None, typer.Option(help="nextword (numpy), keras or numpy (default: nextword)")]
    = None,
    data: Annotated[Path | None, typer.Option(help="train on a real-format dataset file (TFF StackOverflow SQLite or "
                                                   "arXiv JSON lines; default --users: all its train clients)")]
    = None,
    vocab: Annotated[Path | None, typer.Option(help="the dataset's vocabulary (corrflow data vocab); needed with "
                                                    "--data")] = None,
    out: Annotated[Path, typer.Option(help="output directory (comparison.json, curves.csv, PNG plots, runs/)")]
    = Path("corrflow_compare"),
    backend: Annotated[str, typer.Option(help="inprocess (deterministic, no Ray) or flower")] = "inprocess",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Train non-private, DP-SGD and correlated-noise arms at the same (ε, δ) and compare held-out accuracy."""
    from corrflow.clients.tasks import training_defaults
    from corrflow.factorization.registry import KINDS
    from corrflow.paths import writable_directory
    from corrflow.server.compare import PRESETS, compare, json_summary, stderr_progress, table, with_overrides
    from corrflow.server.simulation import quiet_native_logs

    try:
        if preset not in PRESETS:
            raise InvalidArgumentError("--preset", f"one of {', '.join(PRESETS)}", preset)
        if backend not in ("inprocess", "flower"):
            raise InvalidArgumentError("--backend", "inprocess or flower", backend)
        if client is not None and client not in ("nextword", "keras", "numpy"):
            raise InvalidArgumentError("--client", "nextword, keras or numpy", client)
        if seeds is not None and seeds < 1:
            raise InvalidArgumentError("--seeds", "a positive integer", seeds)
        kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
        correlated = [k for k in KINDS if k != "dpsgd"]
        bad = [k for k in kind_list if k not in correlated]
        if bad or not kind_list:
            raise InvalidArgumentError("--kinds", f"correlated-noise kinds from {', '.join(correlated)} (nonprivate "
                                                  "and dpsgd always run)", ",".join(bad) or kinds)
        writable_directory(out, "--out")
        if (out / "comparison.json").exists() or (out / "runs").exists():
            raise InvalidArgumentError("--out", "a new or empty directory (it holds a previous comparison)", str(out))
        if data is not None:
            users = _data_users(data, vocab, users)
        chosen = with_overrides(PRESETS[preset], seeds=seeds, epsilon=epsilon, delta=delta, rounds=rounds,
                                users=users, epochs=epochs, client=client,
                                data_path=None if data is None else str(data),
                                vocab_path=None if vocab is None else str(vocab))
        if client is not None and client != PRESETS[preset].client:   # that client's optimizer settings
            chosen = with_overrides(chosen, **training_defaults(client))
        quiet_native_logs()
        logging.getLogger("corrflow").setLevel(logging.ERROR)  # the non-private arm's warning is expected here
        result = compare(chosen, kind_list, out, backend=backend, progress=stderr_progress)
        text = table(result)
        if as_json:
            typer.echo(text, err=True)
            print(json.dumps(json_summary(result), sort_keys=True))
        else:
            typer.echo(text)
            typer.echo(f"plots: {', '.join(result['plots'])}; details: {out / 'comparison.json'}")
    except (CorrflowError, IntegrityError) as exc:
        if isinstance(exc, InvalidArgumentError) and exc.field in _FLAGS:   # an arm's setting, named as typed
            exc = InvalidArgumentError(_FLAGS[exc.field], exc.expected, exc.got)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2 if isinstance(exc, (InvalidArgumentError, DataFormatError)) else 1) from exc
