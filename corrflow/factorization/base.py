"""The `Factorization` object: workload, encoder (sensitivity 1), participation, metadata;
one .npz file.

File format (docs "Conventions", Files): a NumPy ``.npz`` (no pickles) whose arrays define the
encoder and whose ``__meta__`` entry holds JSON metadata, including ``arrays_sha256`` — a SHA-256
over every array's name, dtype, shape and bytes. Loading recomputes the hash and checks shapes; a
mismatch is an `IntegrityError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.factorization.encoders import Encoder, encoder_from_arrays
from corrflow.factorization.metrics import ErrorReport, error_report
from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import Sensitivity
from corrflow.factorization.workloads import Workload
from corrflow.fileio import atomic_file

FORMAT = "corrflow.factorization/1"


@dataclass(frozen=True)
class Factorization:
    """A normalised factorization A = B·C of a workload: ``encoder`` C has sensitivity 1 under
    ``participation``.

    The decoder is B = A C⁻¹ (never stored); the error of the mechanism is sens²·‖B‖²_F (000 Eq. 4,
    arXiv 2211.06530) and the noise the server adds in round t is σ·clip·(C⁻¹Z)_t.

    Attributes:
        kind: the registry kind that built it (``dpsgd``, ``toeplitz``, ``dense``, …).
        workload: the workload A (n × n, lower-triangular; streamed, never stored).
        participation: the (k, b) pattern the sensitivity is computed for.
        encoder: C, n × n lower-triangular, in one of the structured forms (Toeplitz, banded,
            banded-inverse, BLT, dense), scaled so that its sensitivity is 1.
        sensitivity: the sensitivity after normalisation (value 1) and whether it is exact or an
            upper bound.
        raw_sensitivity: the sensitivity before normalisation (informative only).
        metadata: the construction's parameters (γ, stamps, solver statistics, dual lower bound, …).
    """

    kind: str
    workload: Workload
    participation: Participation
    encoder: Encoder
    sensitivity: Sensitivity
    raw_sensitivity: float = 1.0
    metadata: dict = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        return self.encoder.n

    @property
    def bands(self) -> int | None:
        return self.encoder.bands

    def per_query_error(self) -> np.ndarray:
        """Squared row norms of the decoder B = A C⁻¹: the per-iterate noise variance at unit σ and
        sensitivity 1.

        Returns:
            float64 array of shape (n,); its sum is ‖B‖²_F, the total squared error of 000 Eq. 4.
        """
        return self.encoder.per_query_error(self.workload)

    def errors(self) -> ErrorReport:
        """The mechanism's errors at unit σ (000 Eq. 4).

        Returns:
            `ErrorReport` with the total squared error sens²·‖B‖²_F, RMSE = √(total/n) and max error
            sens·maxᵢ‖Bᵢ‖.
        """
        return error_report(self.per_query_error(), self.sensitivity.value)

    def summary(self) -> dict:
        """The JSON summary printed by ``corrflow factorize --json``.

        Returns:
            A JSON-serialisable dict: kind, rounds, epochs, min_sep, participation, bands,
            structure, workload, the errors, the sensitivity (value, exact, method),
            raw_sensitivity, lower_bound, sha256 and the metadata.
        """
        err = self.errors()
        out = {
            "kind": self.kind,
            "rounds": self.rounds,
            "epochs": self.participation.epochs,
            "min_sep": self.participation.min_sep,
            "participation": self.participation.kind,
            "bands": self.bands,
            "structure": self.encoder.structure,
            "workload": self.workload.to_dict(),
            **err.to_dict(),
            "sensitivity": self.sensitivity.value,
            "sensitivity_exact": self.sensitivity.exact,
            "sensitivity_method": self.sensitivity.method,
            "raw_sensitivity": self.raw_sensitivity,
            "lower_bound": self.metadata.get("lower_bound"),
            "sha256": self.sha256(),
        }
        out.update({k: v for k, v in self.metadata.items() if k not in out})
        return out

    def _arrays(self) -> dict[str, np.ndarray]:
        return {
            f"encoder.{k}": np.ascontiguousarray(v, dtype=np.float64)
            for k, v in self.encoder.arrays().items()
        }

    def sha256(self) -> str:
        """The factorization's identity, checked on load and recorded in privacy reports and
        recipes.

        Returns:
            SHA-256 (64 hex digits) of the encoder's arrays, computed once per object: a
            factorization is never changed after it is built (another one is a new object, e.g. from
            ``dataclasses.replace``), and a run records the hash with every checkpoint.
        """
        # Set through __dict__: the dataclass is frozen, and the cache is no field (equality,
        # repr and replace ignore it; a pickled copy carries it, still true of the same arrays).
        digest = self.__dict__.get("_sha256")
        if digest is None:
            digest = arrays_sha256(self._arrays())
            self.__dict__["_sha256"] = digest
        return digest

    def _meta(self) -> dict:
        return {
            "format": FORMAT,
            "kind": self.kind,
            "structure": self.encoder.structure,
            "encoder_params": self.encoder.params(),
            "rounds": self.rounds,
            "workload": self.workload.to_dict(),
            "participation": self.participation.to_dict(),
            "sensitivity": self.sensitivity.to_dict(),
            "raw_sensitivity": self.raw_sensitivity,
            "metadata": self.metadata,
            "arrays_sha256": self.sha256(),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file + rename) to exactly ``path``.

        Args:
            path: the file to write: an ``.npz`` archive (no pickles) whatever its suffix, with the
                JSON metadata and the SHA-256 of the arrays inside.

        Returns:
            ``path`` as a `Path`.
        """
        path = Path(path)
        payload = self._arrays()
        payload["__meta__"] = np.array(json.dumps(self._meta(), sort_keys=True))
        with atomic_file(path, "wb", suffix=".npz") as f:
            np.savez(f, **payload)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Factorization:
        """Load and verify a file written by `save`.

        Args:
            path: a factorization ``.npz`` file.

        Returns:
            The factorization, after checking its format, the SHA-256 of its arrays and their
            shapes.

        Raises:
            InvalidArgumentError: ``path`` does not exist.
            IntegrityError: the file is not a corrflow factorization, or was corrupted or edited.
        """
        path = Path(path)
        if not path.is_file():
            raise InvalidArgumentError("factorization", "an existing factorization file", str(path))
        try:
            with np.load(path, allow_pickle=False) as data:
                if not hasattr(data, "files"):
                    raise ValueError("a single array, not an archive")
                arrays = {k: np.array(data[k]) for k in data.files}
        # zip/npy decoding errors of many kinds; numpy's own advice (pickles) is wrong here
        except Exception as exc:
            reason = "not an .npz archive" if "pickle" in str(exc) else str(exc)
            raise IntegrityError(f"{path}: not a readable factorization file ({reason})") from None
        if "__meta__" not in arrays:
            raise IntegrityError(f"{path}: no __meta__ entry; not a corrflow factorization file")
        try:
            meta = json.loads(str(arrays.pop("__meta__")))
        except json.JSONDecodeError as exc:
            raise IntegrityError(f"{path}: metadata is not valid JSON ({exc})") from exc
        if meta.get("format") != FORMAT:
            raise IntegrityError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        digest = arrays_sha256(arrays)
        if digest != meta.get("arrays_sha256"):
            raise IntegrityError(
                f"{path}: array hash {digest[:16]}… does not match the recorded "
                f"{str(meta.get('arrays_sha256'))[:16]}…; the file is corrupted or was edited"
            )
        enc_arrays = {
            k.removeprefix("encoder."): v for k, v in arrays.items() if k.startswith("encoder.")
        }
        try:
            encoder = encoder_from_arrays(
                meta["structure"], enc_arrays, meta.get("encoder_params", {})
            )
        except (KeyError, InvalidArgumentError) as exc:
            raise IntegrityError(
                f"{path}: encoder arrays do not form a valid encoder ({exc})"
            ) from exc
        if encoder.n != meta["rounds"]:
            raise IntegrityError(
                f"{path}: encoder has {encoder.n} rounds, metadata says {meta['rounds']}"
            )
        participation = Participation.from_dict(meta["participation"])
        if participation.rounds != encoder.n:
            raise IntegrityError(
                f"{path}: participation covers {participation.rounds} rounds, encoder {encoder.n}"
            )
        return cls(
            kind=meta["kind"],
            workload=Workload.from_dict(meta["workload"]),
            participation=participation,
            encoder=encoder,
            sensitivity=Sensitivity(**meta["sensitivity"]),
            raw_sensitivity=float(meta.get("raw_sensitivity", 1.0)),
            metadata=meta.get("metadata", {}),
        )


def arrays_sha256(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over sorted (name, dtype, shape, little-endian bytes) of every array."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        h.update(name.encode())
        h.update(str(a.dtype.str).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def normalized(
    kind: str,
    workload: Workload,
    participation: Participation,
    encoder: Encoder,
    metadata: dict | None = None,
) -> Factorization:
    """Scale ``encoder`` so its sensitivity under ``participation`` is 1 and wrap it (docs
    "Conventions")."""
    sens = encoder.sensitivity(participation)
    if not (np.isfinite(sens.value) and sens.value > 0):
        raise InvalidArgumentError("encoder", "a finite, positive sensitivity", sens.value)
    enc = encoder.scaled(1.0 / sens.value)
    return Factorization(
        kind,
        workload,
        participation,
        enc,
        Sensitivity(1.0, sens.exact, sens.method),
        raw_sensitivity=sens.value,
        metadata=dict(metadata or {}),
    )
