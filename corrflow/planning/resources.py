"""Memory a requested run needs, estimated before anything starts, so that an impossible size is
refused with its estimate instead of failing minutes later with a MemoryError.

The estimate is deliberately coarse and errs high: the server keeps a few KiB per simulated user
(node maps, planner, ledger, one message in flight), and the factorization's n×n matrices (C, C⁻¹
and B = A C⁻¹, float64) unless the kind is banded or Toeplitz and the engine works in O(n·bands);
the noise state adds (bands − 1)·d float32 values. A run above the memory available is refused."""

from __future__ import annotations

import os
from dataclasses import dataclass

from corrflow.errors import InvalidArgumentError

#: Server memory per simulated user (measured ~3 KiB in the in-process engine; doubled for
# headroom).
BYTES_PER_USER = 8 * 1024
#: Kinds whose encoder and engine work in O(n·bands) memory; the others keep n×n float64 matrices.
BANDED_KINDS = ("dpsgd", "toeplitz", "banded", "bifr", "bisr", "bsr")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs, by part (see `estimate`).

    Attributes:
        users: the server's per-user state (node maps, planner, ledger, a message in flight).
        factorization: the encoder/decoder matrices and the noise engine's own arrays.
        noise: the streaming noise state, (bands − 1)·d float32 values.
    """

    users: int
    factorization: int
    noise: int

    @property
    def total(self) -> int:
        """The sum of the three parts, in bytes."""
        return self.users + self.factorization + self.noise


def estimate(users: int, rounds: int, kind: str, bands: int, model_params: int) -> MemoryEstimate:
    """Bytes the server needs for a run, estimated high (module docstring).

    Args:
        users: simulated users.
        rounds: n, the factorization's size.
        kind: the factorization kind; `BANDED_KINDS` work in O(n·bands), the others keep three n × n
            float64 matrices.
        bands: the band count (0: the default, n; clipped to [1, n]).
        model_params: d, the model's parameters.

    Returns:
        The estimate, by part.
    """
    p = max(1, min(bands or rounds, rounds))
    fac = 8 * rounds * (4 * p + 16) if kind in BANDED_KINDS else 3 * 8 * rounds * rounds
    return MemoryEstimate(BYTES_PER_USER * users, fac, 4 * max(p - 1, 1) * model_params)


def available_memory() -> int | None:
    """The memory available to a new run.

    Returns:
        Bytes: ``MemAvailable`` from ``/proc/meminfo`` (Linux), else the free physical pages; None
        when neither can be read.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(need: MemoryEstimate, names: dict[str, str]) -> None:
    """Refuse a run whose estimate exceeds 90% of the memory available (no check when that cannot be
    read).

    Args:
        need: the run's `MemoryEstimate`.
        names: part (``"users"``, ``"factorization"``, ``"noise"``) → the flag or setting behind it,
            named in the error.

    Raises:
        InvalidArgumentError: naming the setting behind the largest part, with the estimate and what
            is available.
    """
    have = available_memory()
    if have is None or need.total <= 0.9 * have:
        return
    parts = {"users": need.users, "factorization": need.factorization, "noise": need.noise}
    worst = max(parts, key=parts.get)
    raise InvalidArgumentError(
        names[worst],
        f"a size whose run fits in memory: it needs ≈ {need.total / 2**30:.1f} "
        f"GiB ({', '.join(f'{k} {v / 2**30:.1f}' for k, v in parts.items())} GiB), "
        f"{have / 2**30:.1f} GiB are available",
    )


def check_disk(need: int, directory: str | os.PathLike, flag: str) -> None:
    """Refuse a file of ≈ ``need`` bytes that would not fit in the free space under ``directory``
    (its nearest existing parent).

    Raises:
        InvalidArgumentError: naming ``flag``, with the estimate and the free space.
    """
    import shutil
    from pathlib import Path

    p = Path(directory).expanduser().resolve()
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if need > free:
        raise InvalidArgumentError(
            flag,
            f"a size that fits on disk: it needs ≈ {need / 2**30:.3g} GiB, "
            f"{free / 2**30:.1f} GiB are free under {p}",
        )
