"""The ``corrflow`` command (DESIGN.md "CLI"): one subcommand per job; ``--json`` prints exactly one JSON object
as the last stdout line; progress goes to stderr; bad arguments exit with code 2 and name the argument."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from corrflow.errors import CorrflowError, DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.server.compare_cli import compare_command
from corrflow.server.data_cli import data_app

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="corrflow: federated learning with differential privacy through correlated noise.")


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


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=2 if isinstance(exc, (InvalidArgumentError, DataFormatError)) else 1)


@app.command()
def factorize(
    kind: Annotated[str | None, typer.Option(help="dpsgd, tree, dense, banded, toeplitz, bisr, bifr, bsr, "
                                                   "lambda-cgd or fft")] = None,
    rounds: Annotated[int | None, typer.Option(help="number of rounds n")] = None,
    epochs: Annotated[int, typer.Option(help="k: the most participations of one user")] = 1,
    min_sep: Annotated[int | None, typer.Option(help="b: fewest rounds between two participations "
                                                     "(default rounds/epochs, fixed-epoch)")] = None,
    participation: Annotated[str | None, typer.Option(help="fixed-epoch or min-sep (default: inferred)")] = None,
    bands: Annotated[int | None, typer.Option(help="bands of C (banded, toeplitz, bsr) or of C⁻¹ (bisr, bifr)")]
    = None,
    workload: Annotated[str, typer.Option(help="prefix or momentum")] = "prefix",
    momentum: Annotated[float, typer.Option(help="momentum β of the momentum workload")] = 0.95,
    cooldown_fraction: Annotated[float, typer.Option(help="fraction of rounds with linear learning-rate cooldown"
                                                          " (momentum workload)")] = 0.25,
    stamps: Annotated[int, typer.Option(help="repeat a rounds/stamps mechanism along the diagonal")] = 1,
    gamma: Annotated[float | None, typer.Option(help="γ for bifr/bsr/lambda-cgd (default: searched / 1/2)")]
    = None,
    search_gamma: Annotated[bool, typer.Option(help="bsr: search γ (the γ-BFR family)")] = False,
    taper: Annotated[int | None, typer.Option(help="toeplitz: lower min-sep b₀ for the 001 App. H taper (min-sep "
                                                   "uncertain in [b₀, bands])")] = None,
    tol: Annotated[float, typer.Option(help="dense: relative duality gap to stop at")] = 5e-4,
    out: Annotated[Path | None, typer.Option(help="write the factorization to this .npz file")] = None,
    describe: Annotated[Path | None, typer.Option(help="describe a saved factorization instead")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Build a correlated-noise factorization (or describe a saved one) and print its errors."""
    from corrflow.factorization.base import Factorization
    from corrflow.factorization.build import factorize as build
    from corrflow.factorization.build import participation_for
    from corrflow.factorization.workloads import Workload
    from corrflow.progress import Progress

    try:
        if describe is not None:
            _emit(Factorization.load(describe).summary(), as_json)
            return
        if kind is None:
            raise InvalidArgumentError("--kind", "a factorization kind (or --describe FILE)")
        if rounds is None:
            raise InvalidArgumentError("--rounds", "the number of rounds")
        if workload == "momentum":
            wl = Workload.sgd_momentum(momentum, cooldown_fraction)
        elif workload == "prefix":
            wl = Workload.prefix()
        else:
            raise InvalidArgumentError("--workload", "prefix or momentum", workload)
        part = participation_for(rounds, epochs, min_sep, participation)
        with Progress(f"factorize {kind}", quiet=quiet) as cb:
            fac = build(kind, part, wl, bands=bands, stamps=stamps, gamma=gamma, search_gamma=search_gamma,
                        taper=taper, tol=tol, callback=cb)
        summary = fac.summary()
        if out is not None:
            summary["path"] = str(fac.save(out))
        _emit(summary, as_json)
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)


@app.command()
def account(
    factorization: Annotated[Path, typer.Option(help="a factorization .npz file")],
    delta: Annotated[float, typer.Option(help="δ")],
    noise_multiplier: Annotated[float | None, typer.Option(help="σ: compute ε")] = None,
    target_epsilon: Annotated[float | None, typer.Option(help="ε: calibrate σ")] = None,
    sampling: Annotated[str, typer.Option(help="none, cyclic-poisson, bminsep, balls-in-bins or "
                                               "multi-attribution")] = "none",
    items_per_user: Annotated[int, typer.Option(help="k_u: items per user, for multi-attribution")] = 1,
    dataset_size: Annotated[int | None, typer.Option(help="N (examples or users), for amplified sampling")] = None,
    expected_batch_size: Annotated[float | None, typer.Option(help="B, for amplified sampling")] = None,
    mc_samples: Annotated[int, typer.Option(help="Monte Carlo samples per direction (and per candidate σ)")]
    = 100_000,
    seed: Annotated[int, typer.Option(help="Monte Carlo seed")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """ε for a noise multiplier, or the smallest grid σ that meets a target ε."""
    from corrflow.accounting import SamplingSpec
    from corrflow.accounting import account as run_account
    from corrflow.factorization.base import Factorization

    try:
        if (noise_multiplier is None) == (target_epsilon is None):
            raise InvalidArgumentError("--noise-multiplier", "exactly one of --noise-multiplier and "
                                       "--target-epsilon")
        fac = Factorization.load(factorization)
        spec = SamplingSpec(sampling, dataset_size, expected_batch_size, items_per_user)
        _emit(run_account(fac, delta=delta, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                          sampling=spec, mc_samples=mc_samples, seed=seed), as_json)
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)


@app.command()
def simulate(
    users: Annotated[int, typer.Option(help="simulated users (SuperNodes)")] = 50,
    rounds: Annotated[int, typer.Option(help="rounds n")] = 20,
    epochs: Annotated[int, typer.Option(help="participations per user k (fixed-epoch, b = n/k)")] = 2,
    kind: Annotated[str, typer.Option(help="factorization kind")] = "toeplitz",
    target_epsilon: Annotated[float, typer.Option(help="ε to calibrate σ for (0: use --noise-multiplier)")] = 8.0,
    noise_multiplier: Annotated[float, typer.Option(help="σ (overrides --target-epsilon when > 0)")] = 0.0,
    delta: Annotated[float, typer.Option(help="δ")] = 1e-5,
    clip_norm: Annotated[float | None, typer.Option(help="ℓ2 clip of each user's update (default: the client's)")]
    = None,
    client: Annotated[str, typer.Option(help="client task: numpy (regression), nextword (numpy bigram model) or "
                                             "keras (next-word LSTM)")]
    = "numpy",
    out: Annotated[Path, typer.Option(help="output directory (state, privacy_report.json, metrics.json)")]
    = Path("corrflow_run"),
    backend: Annotated[str, typer.Option(help="flower (Flower's simulation engine, Ray) or inprocess")] = "flower",
    participation: Annotated[str, typer.Option(help="fixed-epoch, bminsep or multi-attribution (004)")]
    = "fixed-epoch",
    min_sep: Annotated[int, typer.Option(help="b (0: rounds/epochs)")] = 0,
    participation_rate: Annotated[float, typer.Option(help="p0 per item and round for samplers (0: 1/(2b))")] = 0.0,
    policy: Annotated[str, typer.Option(help="when a user's realised gap < min-sep: reject or accept-and-account")]
    = "reject",
    accountant: Annotated[str, typer.Option(help="unamplified or monte-carlo (bminsep)")] = "unamplified",
    mode: Annotated[str, typer.Option(help="cross-device or cross-silo (needs --manifest)")] = "cross-device",
    attribution: Annotated[Path | None, typer.Option(help="items → users: CSV/JSON lines, or arXiv metadata")]
    = None,
    manifest: Annotated[Path | None, typer.Option(help="cross-silo: partition manifest (corrflow data partition)")]
    = None,
    max_items_per_user: Annotated[int, typer.Option(help="k_u: per-user contribution bound (0: none)")] = 0,
    taper: Annotated[int, typer.Option(help="toeplitz: b₀ of the 001 App. H taper (0: none)")] = 0,
    server_lr: Annotated[float | None, typer.Option(help="server learning rate η (default: the client's)")] = None,
    momentum: Annotated[float | None, typer.Option(help="server momentum β; the factorization is built for this "
                                                        "workload (default: the client's)")] = None,
    local_lr: Annotated[float | None, typer.Option(help="clients' learning rate (default: the client's)")] = None,
    local_steps: Annotated[int | None, typer.Option(help="clients' local epochs (default: the client's)")] = None,
    seed: Annotated[int, typer.Option(help="seeds the data, model initialisation and participation order (never "
                                           "the noise, whose key is always fresh)")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the privacy report as one JSON object")] = False,
) -> None:
    """Run a federated simulation with correlated noise and print its privacy report."""
    from corrflow.clients.tasks import training_defaults
    from corrflow.strategies.config import StrategyConfig

    try:
        if client not in ("numpy", "nextword", "keras"):
            raise InvalidArgumentError("--client", "numpy, nextword or keras", client)
        training = training_defaults(client, server_lr=server_lr, momentum=momentum, local_lr=local_lr,
                                     local_steps=local_steps, clip_norm=clip_norm)
        if backend not in ("flower", "inprocess"):
            raise InvalidArgumentError("--backend", "flower or inprocess", backend)
        if mode == "cross-silo":  # one simulated node per silo of the manifest
            from corrflow.data.partition import load_manifest

            if manifest is None:
                raise InvalidArgumentError("--manifest", "a partition manifest with --mode cross-silo")
            users = int(load_manifest(manifest)["num_partitions"])
        cfg = StrategyConfig(num_users=users, num_rounds=rounds, epochs=epochs, kind=kind,
                             participation=participation, min_sep=min_sep, participation_rate=participation_rate,
                             policy=policy, accountant=accountant, mode=mode,
                             attribution_path=str(attribution or ""), manifest_path=str(manifest or ""),
                             max_items_per_user=max_items_per_user, taper=taper,
                             target_epsilon=0.0 if noise_multiplier > 0 else target_epsilon,
                             noise_multiplier=noise_multiplier, delta=delta, client=client,
                             seed=seed, schedule_seed=seed, **training, state_dir=str(out / "state"))
        from corrflow.server.metrics import summary as metrics_summary
        from corrflow.server.simulation import simulate as run_sim

        report = run_sim(cfg, out, backend=backend)
        held_out = metrics_summary(json.loads((out / "metrics.json").read_text()))
        if as_json:
            _emit({**report, "held_out": held_out}, True)
        else:
            mech, planned, realized = report["mechanism"], report["planned"], report["realized"]
            _emit({"mechanism": f"{mech['kind']} ({mech['participation']}, k={mech['epochs']}, b={mech['min_sep']}"
                                f", bands={mech['bands']}), {mech['rounds']} rounds",
                   "participation": f"{planned['participation']['kind']} ({planned['participation']['mode']}), "
                                    f"expected cohort {planned['participation']['expected_cohort']:g}, "
                                    f"k_u = {planned['participation']['items_per_user']}",
                   "accountant": report["accountant"]["name"],
                   "noise_multiplier": report["noise_multiplier"], "clip_norm": report["clip_norm"],
                   "delta": report["delta"], "target_epsilon": report["target_epsilon"],
                   "epsilon_planned": planned["epsilon"], "epsilon_realized": realized["epsilon"],
                   "sensitivity_realized": realized["sensitivity"],
                   "users": len(realized["participation"]["users"]),
                   "max_participations": realized["participation"]["max_participations"],
                   "min_gap": realized["participation"]["min_gap"], "rejections": realized["rejections"],
                   "policy": realized["participation"]["policy"],
                   "overrides": len(realized["participation"]["overrides"]),
                   "rounds_completed": report["rounds_completed"], **held_out,
                   "report": str(out / "privacy_report.json")}, False)
    except (CorrflowError, IntegrityError) as exc:
        _fail(exc)


noise_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Correlated-noise audits.")
app.add_typer(noise_app, name="noise")
app.add_typer(data_app, name="data")
app.command("compare")(compare_command)


@noise_app.command("sample")
def noise_sample(
    factorization: Annotated[Path, typer.Option(help="a factorization .npz file")],
    dim: Annotated[int, typer.Option(help="D: coordinates per round")],
    seed: Annotated[str, typer.Option(help="audit seed: hex key of the PRNG's key length, or any text/integer")],
    out: Annotated[Path, typer.Option(help="output .npy file (float32, rounds × dim)")],
    start: Annotated[int, typer.Option(help="first round R (the state before it is regenerated from the seed)")]
    = 0,
    rounds: Annotated[int | None, typer.Option(help="number of rounds N (default: to the end)")] = None,
    prng: Annotated[str, typer.Option(help="philox or chacha")] = "philox",
    mode: Annotated[str | None, typer.Option(help="override the generation mode")] = None,
    chunk_size: Annotated[int, typer.Option(help="coordinates per PRNG chunk (must match the server's)")]
    = 1 << 20,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Write rows R..R+N−1 of the unit-σ noise stream, exactly as the server computes them for that key."""
    import numpy as np

    from corrflow.factorization.base import Factorization
    from corrflow.noise import CorrelatedNoise, key_from_seed

    try:
        fac = Factorization.load(factorization)
        if dim < 1:
            raise InvalidArgumentError("--dim", "a positive integer", dim)
        if not 0 <= start < fac.rounds:
            raise InvalidArgumentError("--start", f"a round in [0, {fac.rounds})", start)
        count = fac.rounds - start if rounds is None else rounds
        if not 1 <= count <= fac.rounds - start:
            raise InvalidArgumentError("--rounds", f"between 1 and {fac.rounds - start} (the factorization has "
                                       f"{fac.rounds} rounds)", rounds)
        gen = CorrelatedNoise(fac, [(dim,)], 1.0, key=key_from_seed(seed, prng), prng=prng, mode=mode,
                              chunk_size=chunk_size)
        gen.skip_to(start)
        rows = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(count, dim))
        for i in range(count):
            rows[i] = gen.next(start + i)[0]
        rows.flush()
        _emit({"path": str(out), "rounds": count, "start": start, "dim": dim, "mode": gen.mode, "prng": prng,
               "factorization_sha256": fac.sha256()}, as_json)
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
