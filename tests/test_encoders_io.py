import json
import zipfile

import numpy as np
import pytest

from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.factorization.base import Factorization
from corrflow.factorization.baselines import stamp_encoder
from corrflow.factorization.build import KINDS, factorize, participation_for
from corrflow.factorization.closed_forms import bifr_encoder
from corrflow.factorization.encoders import (
    BandedEncoder,
    DenseEncoder,
    InverseToeplitzEncoder,
    ToeplitzEncoder,
)
from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import brute_force_sensitivity
from corrflow.factorization.workloads import Workload

WORKLOADS = [Workload.prefix(), Workload("momentum", 0.9), Workload.sgd_momentum(0.95, 0.25)]


def _encoders(n, rng):
    return [
        DenseEncoder(np.tril(rng.uniform(0.1, 1, (n, n))) + np.eye(n)),
        BandedEncoder(rng.uniform(0.2, 1, (n, 3))),
        ToeplitzEncoder([0.7, 0.45, 0.3, 0.2], n),
        ToeplitzEncoder([0.7, 0.45, 0.3, 0.2], n, column_normalize=True),
        bifr_encoder(Workload.prefix(), n, 4, 0.6),
    ]


def test_structured_paths_equal_dense(rng):
    n = 16
    for enc in _encoders(n, rng):
        C = enc.matrix()
        z = rng.standard_normal((n, 5))
        np.testing.assert_allclose(enc.solve(z), np.linalg.solve(C, z), rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(enc.column_norms(), np.linalg.norm(C, axis=0), rtol=1e-12)
        for w in WORKLOADS:
            dense = np.sum((w.matrix(n) @ np.linalg.inv(C)) ** 2, axis=1)
            np.testing.assert_allclose(enc.per_query_error(w), dense, rtol=1e-9)
        for part in (
            Participation.fixed_epoch(16, 4),
            Participation.min_separation(16, 3, 4),
            Participation.min_separation(16, 5),
        ):
            s = enc.sensitivity(part)
            brute = brute_force_sensitivity(C, part)
            assert s.value >= brute * (1 - 1e-10)
            if s.exact:
                assert s.value == pytest.approx(brute, rel=1e-10)


def test_column_normalised_toeplitz_has_unit_columns():
    enc = ToeplitzEncoder([0.7, 0.45, 0.3, 0.2], 12, column_normalize=True).scaled(
        1 / np.linalg.norm([0.7, 0.45, 0.3, 0.2])
    )
    np.testing.assert_allclose(np.linalg.norm(enc.matrix(), axis=0), 1.0)
    s = enc.sensitivity(Participation.min_separation(12, 4, 3))
    assert s.exact and s.value == pytest.approx(np.sqrt(3))


def test_stamping_structure(rng):
    enc = ToeplitzEncoder([0.7, 0.45, 0.3], 5)
    st = stamp_encoder(enc, 3)
    assert isinstance(st, BandedEncoder)
    np.testing.assert_allclose(st.matrix(), np.kron(np.eye(3), enc.matrix()))
    d = DenseEncoder(np.tril(rng.uniform(0.1, 1, (4, 4))) + np.eye(4))
    np.testing.assert_allclose(stamp_encoder(d, 2).matrix(), np.kron(np.eye(2), d.matrix()))


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DenseEncoder(np.triu(np.ones((3, 3)))), "encoder"),  # not lower-triangular
        (lambda: DenseEncoder(np.diag([1.0, 0.0, 1.0])), "encoder"),  # singular
        (lambda: DenseEncoder(np.array([[1.0, 0], [np.nan, 1.0]])), "encoder"),
        (lambda: DenseEncoder(np.ones((2, 3))), "encoder"),
        (lambda: ToeplitzEncoder([1.0, 0.5, 0.2], 2), "bands"),  # bands > n
        (lambda: InverseToeplitzEncoder([0.0, 1.0], 4), "encoder"),
        (lambda: factorize("banded", Participation.fixed_epoch(8, 1), bands=9), "bands"),
        (lambda: factorize("nope", Participation.fixed_epoch(8, 1)), "kind"),
        (lambda: factorize("dense", Participation.min_separation(8, 2)), "participation"),
        (lambda: participation_for(10, 3), "epochs"),
    ],
)
def test_bad_input(make, field):
    with pytest.raises(InvalidArgumentError) as e:
        make()
    assert e.value.field == field


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_normalised_and_roundtrips(kind, tmp_path):
    part = participation_for(32, 4)
    wl = (
        Workload.sgd_momentum(0.9, 0.25)
        if kind in ("dense", "toeplitz", "bifr")
        else Workload.prefix()
    )
    fac = factorize(kind, part, wl)
    C = fac.encoder.matrix()
    assert brute_force_sensitivity(C, part) <= 1 + 1e-9
    if fac.sensitivity.exact and np.all(C.T @ C >= -1e-12):
        assert brute_force_sensitivity(C, part) == pytest.approx(1.0, rel=1e-9)
    path = fac.save(tmp_path / kind)
    back = Factorization.load(path)
    assert back.sha256() == fac.sha256()
    assert back.summary()["total_squared_error"] == pytest.approx(
        fac.summary()["total_squared_error"], rel=1e-12
    )
    assert back.workload == fac.workload and back.participation == fac.participation
    dense_total = np.sum((wl.matrix(32) @ np.linalg.inv(C)) ** 2)
    assert fac.errors().total_squared_error == pytest.approx(dense_total, rel=1e-9)


def test_stamped_dense_matches_paper_structure():
    fac = factorize("dense", participation_for(24, 4), stamps=2)
    C = fac.encoder.matrix()
    assert np.allclose(C[12:, :12], 0)
    assert brute_force_sensitivity(C, fac.participation) == pytest.approx(1.0, rel=1e-9)


def test_corrupted_files(tmp_path):
    fac = factorize("toeplitz", participation_for(16, 2))
    path = fac.save(tmp_path / "f.npz")
    # Edited array: hash mismatch.
    with np.load(path) as d:
        arrays = {k: d[k] for k in d.files}
    arrays["encoder.coef"] = arrays["encoder.coef"] * 1.01
    np.savez(tmp_path / "edited.npz", **arrays)
    with pytest.raises(IntegrityError, match="hash"):
        Factorization.load(tmp_path / "edited.npz")
    # Wrong shape recorded: rounds mismatch.
    with np.load(path) as d:
        arrays = {k: d[k] for k in d.files}
    meta = json.loads(str(arrays["__meta__"]))
    meta["rounds"] = 17
    arrays["__meta__"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "shape.npz", **arrays)
    with pytest.raises(IntegrityError, match="rounds"):
        Factorization.load(tmp_path / "shape.npz")
    # Truncated / not a zip.
    (tmp_path / "junk.npz").write_bytes(path.read_bytes()[:100])
    with pytest.raises(IntegrityError):
        Factorization.load(tmp_path / "junk.npz")
    assert zipfile.is_zipfile(path)
    with pytest.raises(InvalidArgumentError):
        Factorization.load(tmp_path / "missing.npz")
