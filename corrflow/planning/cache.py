"""A directory cache for ``corrflow plan``: factorizations keyed by every build parameter, and
calibrations keyed by the factorization's hash, the accountant, its sampling and the target — so a
repeated plan is instant.

Keys are SHA-256 digests of canonical JSON; factorizations are the verified ``.npz`` files of
`Factorization` (a corrupted entry is rebuilt, never trusted);
calibrations are small JSON files written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from corrflow.errors import IntegrityError
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_json

CACHE_FORMAT = 2  # 2: exact Gaussian curve and Brent-calibrated σ (1: PLD grid search)


def default_cache_dir(out: Path | None) -> Path:
    """Where ``corrflow plan`` caches factorizations and calibrations.

    Args:
        out: the plan's output directory, or None (the current directory).

    Returns:
        ``$CORRFLOW_HOME/cache`` when that variable is set, else ``out/cache``.
    """
    home = os.environ.get("CORRFLOW_HOME")
    if home:
        return Path(home).expanduser() / "cache"
    return (out or Path(".")) / "cache"


def cache_key(params: dict) -> str:
    """The cache key of a set of build or calibration parameters.

    Args:
        params: JSON-serialisable parameters (values that are not are written with ``str``).

    Returns:
        The SHA-256 hex digest of the canonical (sorted-key) JSON of ``params`` and the cache
        format.
    """
    return hashlib.sha256(
        json.dumps({"format": CACHE_FORMAT, **params}, sort_keys=True, default=str).encode()
    ).hexdigest()


class PlanCache:
    """Factorizations under ``fac-<key>.npz``, calibrations under ``cal-<key>.json``; counts hits
    and misses.

    Args:
        root: the cache directory (created when missing).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def factorization(
        self, params: dict, build: Callable[[], Factorization]
    ) -> tuple[Factorization, bool]:
        """The cached factorization for ``params``, or a fresh ``build()`` stored under that key.

        A stored file that fails its integrity check is deleted and rebuilt, never used.

        Args:
            params: every parameter the factorization depends on (kind, rounds, epochs, min-sep,
                bands, workload, γ, taper, stamps, tolerance, ...).
            build: builds the factorization on a miss.

        Returns:
            (factorization, cached): ``cached`` is True when it was read from the cache.
        """
        path = self.root / f"fac-{cache_key(params)}.npz"
        if path.exists():
            try:
                fac = Factorization.load(path)
                self.hits += 1
                return fac, True
            except IntegrityError:
                path.unlink(missing_ok=True)  # rebuilt below
        fac = build()
        fac.save(path)
        self.misses += 1
        return fac, False

    def calibration(
        self, params: dict, compute: Callable[[], dict], valid: Callable[[dict], bool] | None = None
    ) -> tuple[dict, bool]:
        """The cached ``compute()`` for ``params``.

        A stored entry is used only when its params match and its result passes ``valid`` (an edited
        or corrupted file is recomputed, never printed); a fresh result is written atomically.

        Args:
            params: every input of the calibration (factorization hash, accountant, sampling,
                target, ...).
            compute: computes the JSON-serialisable result on a miss.
            valid: an optional check of a stored result.

        Returns:
            (result, cached): ``cached`` is True when it was read from the cache.
        """
        path = self.root / f"cal-{cache_key(params)}.json"
        if path.exists():
            try:
                out = json.loads(path.read_text(encoding="utf-8"))
                if out.get("params") == json.loads(
                    json.dumps(params, sort_keys=True, default=str)
                ) and (valid is None or valid(out["result"])):
                    self.hits += 1
                    return out["result"], True
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                pass
        result = compute()
        write_json(path, {"params": params, "result": result}, sort_keys=True, default=str)
        self.misses += 1
        return result, False
