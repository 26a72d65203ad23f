"""``corrflow noise``: audits of the correlated-noise stream."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from corrflow.cli.common import AsJson, emit, fail, load_factorization
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError
from corrflow.noise import CorrelatedNoise, key_from_seed
from corrflow.noise.keys import VERSION as KEY_VERSION
from corrflow.noise.keys import VERSIONS as KEY_VERSIONS

noise_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Correlated-noise audits.")


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
    key_version: Annotated[
        int,
        typer.Option(
            help="the key's derivation version: a key segment's `derivation` in the run's state "
            "(1 where absent: keys made before version 2)"
        ),
    ] = KEY_VERSION,
    as_json: AsJson = False,
) -> None:
    """Write rows R..R+N−1 of the unit-σ noise stream, exactly as the server computes them for that
    key."""
    try:
        if key_version not in KEY_VERSIONS:
            raise InvalidArgumentError("--key-version", f"one of {KEY_VERSIONS}", key_version)
        fac = load_factorization(factorization, "--factorization")
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
            key_version=key_version,
            prng=prng,
            mode=mode,
            chunk_size=chunk_size,
        )
        gen.skip_to(start)
        rows = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(count, dim))
        for i in range(count):
            rows[i] = gen.next(start + i)[0]
        rows.flush()
        emit(
            {
                "path": str(out),
                "rounds": count,
                "start": start,
                "dim": dim,
                "mode": gen.mode,
                "prng": prng,
                "key_version": key_version,
                "factorization_sha256": fac.sha256(),
            },
            as_json,
        )
    except (CorrflowError, IntegrityError) as exc:
        fail(exc)


noise_app.command("sample")(noise_sample)
