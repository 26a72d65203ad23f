"""Memory a requested run needs, estimated before anything starts, so that an impossible size is
refused with its estimate instead of failing minutes later with a MemoryError.

The estimate is deliberately coarse and errs high: the server keeps a few KiB per simulated user
(node maps, planner, ledger, one message in flight), and the factorization's n×n matrices (C, C⁻¹
and B = A C⁻¹, float64) unless the kind is banded or Toeplitz and the engine works in O(n·bands);
the noise state adds (bands − 1)·d float32 values. A run above the memory available is refused:
the smallest of the machine's available memory, the room left under the process's own
address-space limit (RLIMIT_AS, as `ulimit -v` sets it) and the room left in its cgroup (a
container's or a systemd unit's memory limit), each named in the refusal."""

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
        noise_floor: the noise state at one band of state (d float32 values): what the model size
            alone needs, whatever the bands.
    """

    users: int
    factorization: int
    noise: int
    noise_floor: int = 0

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
    return MemoryEstimate(
        BYTES_PER_USER * users, fac, 4 * max(p - 1, 1) * model_params, 4 * model_params
    )


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo_available() -> int | None:
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


def _address_space_room() -> int | None:
    """RLIMIT_AS's soft limit less the address space this process already maps (VmSize)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    used = int(line.split()[1]) * 1024
    except OSError:
        pass
    return max(soft - used, 0)


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """The least room (limit − usage) over this process's memory cgroup and its ancestors: v2's
    memory.max/memory.current, or v1's memory.limit_in_bytes/memory.usage_in_bytes."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 (unified)
            base, limit, usage = root, "memory.max", "memory.current"
            if os.path.isdir(os.path.join(root, "unified")):
                base = os.path.join(root, "unified")
        elif "memory" in controllers.split(","):  # v1
            base, limit, usage = (
                os.path.join(root, "memory"),
                "memory.limit_in_bytes",
                ("memory.usage_in_bytes"),
            )
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            cap, used = _read_int(os.path.join(d, limit)), _read_int(os.path.join(d, usage))
            if cap is not None and cap < 2**62:  # v1 reports "no limit" as a huge number
                rooms.append(max(cap - (used or 0), 0))
    return min(rooms) if rooms else None


def memory_limit() -> tuple[int, str] | None:
    """The memory a new run may still use, and what sets it (module docstring).

    Returns:
        ``(bytes, source)``: the smallest of the available memory (``MemAvailable``), the room
        under RLIMIT_AS and the room in the process's cgroup; None when none can be read.
    """
    found = [
        (v, what)
        for v, what in (
            (_meminfo_available(), "available on this machine"),
            (_address_space_room(), "left under this process's address-space limit (RLIMIT_AS)"),
            (_cgroup_room(), "left under this process's cgroup memory limit"),
        )
        if v is not None
    ]
    return min(found) if found else None


def available_memory() -> int | None:
    """The memory available to a new run (`memory_limit`'s bytes).

    Returns:
        Bytes, or None when no limit can be read.
    """
    limit = memory_limit()
    return None if limit is None else limit[0]


def check_fits(need: MemoryEstimate, names: dict[str, str | tuple[str, str]]) -> None:
    """Refuse a run whose estimate exceeds 90% of the memory it may use (`memory_limit`; no check
    when that cannot be read).

    Args:
        need: the run's `MemoryEstimate`.
        names: part (``"users"``, ``"factorization"``, ``"noise"``) → the flag or setting behind
            it, named in the error. The noise part, (bands − 1)·d values, may name two: (the bands'
            flag, the model size's flag); the model size's is named when even one band of noise
            state would not fit.

    Raises:
        InvalidArgumentError: naming the setting behind the largest part, with the estimate and
            the limit that refused it.
    """
    limit = memory_limit()
    if limit is None or need.total <= 0.9 * limit[0]:
        return
    have, source = limit
    parts = {"users": need.users, "factorization": need.factorization, "noise": need.noise}
    worst = max(parts, key=parts.get)
    flag = names[worst]
    if isinstance(flag, tuple):
        bands_flag, size_flag = flag
        others = need.users + need.factorization
        flag = size_flag if need.noise_floor + others > 0.9 * have else bands_flag
    raise InvalidArgumentError(
        flag,
        f"a size whose run fits in memory: it needs ≈ {need.total / 2**30:.1f} "
        f"GiB ({', '.join(f'{k} {v / 2**30:.1f}' for k, v in parts.items())} GiB), "
        f"{have / 2**30:.1f} GiB are {source}",
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
