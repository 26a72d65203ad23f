"""``corrflow account``: ε for a noise multiplier, or the smallest grid σ that meets a target ε."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Annotated

import typer

from corrflow.accounting import SamplingSpec
from corrflow.accounting import account as run_account
from corrflow.accounting.noise_scale import (
    both_conventions,
    per_participation_noise_multiplier,
    resolve_noise_multiplier,
)
from corrflow.accounting.noise_scale import describe as describe_noise
from corrflow.choices import SAMPLING_OF, Participation, Sampling
from corrflow.cli.common import (
    AsJson,
    PerParticipation,
    as_flag,
    emit,
    fail,
    load_factorization,
)
from corrflow.cli.options import COMMAND_SETTINGS, cli_values
from corrflow.config import surface_name, validated_fields
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError

FactorizationFile = Annotated[Path, typer.Option(help="a factorization .npz file")]
SamplingFlag = Annotated[
    str | None,
    typer.Option(
        help="the sampling the accountant assumes when no participation has it: "
        "balls-in-bins (deprecated for the others: --participation; none is fixed-epoch)"
    ),
]
ItemsPerUser = Annotated[int, typer.Option(help="k_u: items per user, for multi-attribution")]
DatasetSize = Annotated[
    int | None, typer.Option(help="N (examples or users), for amplified sampling")
]
ExpectedBatchSize = Annotated[float | None, typer.Option(help="B, for amplified sampling")]
McSamples = Annotated[
    int | None,
    typer.Option(
        help="Monte Carlo: size of the first batch of samples per direction, at least 2 "
        "(default: what the target δ needs; smaller batches only feed the estimate); with "
        "--target-epsilon: samples per candidate σ (default 100000). Unlike a run's --mc-samples "
        "(simulate, audit: at least 1000), a one-off: the result reports the δ its samples verify"
    ),
]
Seed = Annotated[
    int,
    typer.Option(
        help="Monte Carlo seed (the result does not depend on it beyond the stated confidence)"
    ),
]
VerifyTarget = Annotated[
    bool,
    typer.Option(
        help="with --target-epsilon and Monte Carlo: draw the samples per candidate σ that verify "
        "the target δ (ε for a σ always verifies the target δ)"
    ),
]
MaxSamples = Annotated[
    int | None,
    typer.Option(
        help="Monte Carlo: budget of samples per direction, all batches together; when spent "
        "before a verification passes, the sampling's other verified bound is used and both are "
        "named; default 240000000; attempts are sized from the estimate)"
    ),
]
TimeLimit = Annotated[
    float | None,
    typer.Option(help="Monte Carlo: abort after this many seconds (nothing is released, exit 1)"),
]
MmccGrid = Annotated[
    float | None,
    typer.Option(
        help="MMCC: grid Δ2 the entries of C are rounded up to (default: the largest entry / 256)"
    ),
]
DeltaSplit = Annotated[float, typer.Option(help="MMCC: share of δ spent on the tail bounds")]


def account(
    factorization: FactorizationFile,
    sampling: SamplingFlag = None,
    items_per_user: ItemsPerUser = 1,
    dataset_size: DatasetSize = None,
    expected_batch_size: ExpectedBatchSize = None,
    mc_samples: McSamples = None,
    seed: Seed = 0,
    verify_target: VerifyTarget = False,
    max_samples: MaxSamples = None,
    time_limit: TimeLimit = None,
    mmcc_grid: MmccGrid = None,
    delta_split: DeltaSplit = 0.5,
    noise_multiplier_per_participation: PerParticipation = None,
    as_json: AsJson = False,
    **settings,
) -> None:
    """ε for a noise multiplier, or the smallest grid σ that meets a target ε. The (epsilon, delta)
    printed is a pair the accountant guarantees; with no --accountant, the tightest verified bound
    of those that apply (all listed). When Monte Carlo cannot verify --delta within its sample
    budget, the sampler's other verified bound is released and both numbers are named."""
    try:
        values = validated_fields(cli_values(settings), "cli")
        fac = load_factorization(factorization, "--factorization")
        noise_multiplier = resolve_noise_multiplier(
            fac, values.get("noise_multiplier"), noise_multiplier_per_participation
        )
        target_epsilon = values.get("target_epsilon")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise InvalidArgumentError(
                "--noise-multiplier",
                "exactly one of --noise-multiplier (or --noise-multiplier-per-participation) and "
                "--target-epsilon",
            )
        spec = SamplingSpec(
            _account_sampling(values["participation"], sampling),
            dataset_size,
            expected_batch_size,
            items_per_user,
            accountant=values.get("accountant"),
        )
        res = run_account(
            fac,
            delta=values["delta"],
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
        _warn_unverified(res, values["delta"])
        _describe_bounds(res)
        sigma = res["noise_multiplier"]
        res["noise_multiplier_per_participation"] = per_participation_noise_multiplier(fac, sigma)
        if not as_json:  # one line for people; --json keeps the numbers
            res = {
                **res,
                "noise_std_per_round": describe_noise(res.get("noise_std_per_round")),
                "σ": both_conventions(fac, sigma),
            }
        emit(res, as_json)
    except InvalidArgumentError as exc:
        fail(_account_flag(exc))
    except (CorrflowError, IntegrityError) as exc:
        fail(exc)


def _warn_unverified(res: dict, delta: float) -> None:
    """Say on stderr when the samples drawn verify another δ than the target."""
    if res["guarantee"]:
        return
    needed = res["accountant"].get("samples_needed_for_target_delta")
    hint = (
        f"; --verify-target draws the {needed} samples per candidate σ the target needs"
        if needed
        else ""
    )
    print(
        f"warning: the samples drawn verify (ε = {res['epsilon']:.4g}, δ = {res['delta']:.3g}), "
        f"not δ = {delta:g}{hint}",
        file=sys.stderr,
    )


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
    named = as_flag(exc)
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
        if b["accountant"] == acc.get("selected"):
            mark = "used"
        else:
            mark = "verified" if b["verified"] else "NOT verified (estimate)"
        print(
            f"bound {b['accountant']:>12}: ε = {b['epsilon']:.4g} at δ = {b['delta']:.3g}, σ = "
            f"{b['noise_multiplier']:.4g} — {mark}",
            file=sys.stderr,
        )
    for s in acc.get("skipped", []):
        print(f"bound {s['accountant']:>12}: not computed ({s['reason']})", file=sys.stderr)
