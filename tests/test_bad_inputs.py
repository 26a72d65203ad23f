"""Every bad input below (malformed data, vocabulary and attribution files, out-of-range numbers,
unwritable outputs) is refused before anything runs: exit 2, the flag or file named, no traceback,
nothing written to --out. Each case runs the real CLI in-process (typer's runner)."""

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corrflow.server.cli import app

BIG = str(10**12)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    so, ax, vocab = d / "so.sqlite", d / "ax.jsonl", d / "v.txt"
    for kind, path in (("stackoverflow", so), ("arxiv", ax)):
        assert (
            invoke("data", "generate", kind, "--users", "60", "--out", path, "--quiet").exit_code
            == 0
        )
    assert (
        invoke("data", "vocab", so, "--no-privacy", "--size", "300", "--out", vocab).exit_code == 0
    )
    bad_vocab, bad_jsonl = d / "bad_v.txt", d / "bad.jsonl"
    bad_vocab.write_bytes(vocab.read_bytes() + b"caf\xe9\n")
    bad_jsonl.write_bytes(ax.read_bytes() + b'{"id": "x\xff"}\n')
    bad_csv = d / "bad_attr.csv"
    bad_csv.write_bytes(b"\xff\xfei\x00t\x00e\x00m\x00")  # UTF-16, not UTF-8
    empty_vocab = d / "empty_v.txt"
    empty_vocab.write_text("#corrflow-vocab oov_buckets=1 source=non-private\n")
    empty_data = d / "empty.sqlite"
    empty_data.write_bytes(so.read_bytes())
    with sqlite3.connect(empty_data) as db:
        db.execute("DELETE FROM examples")
    garbage = d / "garbage.sqlite"
    garbage.write_bytes(b"not a dataset\n")
    no_heldout = d / "no_heldout.sqlite"  # training examples only: nothing to evaluate on
    no_heldout.write_bytes(so.read_bytes())
    with sqlite3.connect(no_heldout) as db:
        db.execute("DELETE FROM examples WHERE split_name != 'train'")
    fac = d / "fac.npz"
    assert invoke("factorize", "--kind", "toeplitz", "--rounds", "8", "--out", fac).exit_code == 0
    return {
        "fac": fac,
        "so": so,
        "vocab": vocab,
        "bad_vocab": bad_vocab,
        "bad_jsonl": bad_jsonl,
        "bad_csv": bad_csv,
        "empty_vocab": empty_vocab,
        "empty_data": empty_data,
        "garbage": garbage,
        "no_heldout": no_heldout,
    }


# (id, argv with OUT for the output directory and {name} for a fixture file, what the error names:
# a string or a tuple of strings)
PLAN = "plan --users 100 --cohort 10 --rounds 4 --delta 1e-5 --target-epsilon 8 --no-plots"
CASES = [
    ("plan-cohort-huge", f"{PLAN} --cohort {10**30} --out OUT", ("--cohort:", "[1, 1e+10]")),
    ("plan-time-budget", f"{PLAN} --time-budget 1e308 --out OUT", ("--time-budget", "604800")),
    (
        "plan-proxy-no-heldout",
        f"{PLAN} --client nextword --proxy-data {{no_heldout}} --proxy-vocab {{vocab}} --out OUT",
        ("--proxy-data:", "'heldout' split"),
    ),
    (
        "plan-proxy-vocab-empty",
        f"{PLAN} --client nextword --proxy-data {{so}} --proxy-vocab {{empty_vocab}} --out OUT",
        ("--proxy-vocab:", "at least one word"),
    ),
    ("sim-model-dim-huge", f"simulate --rounds 4 --model-dim {BIG} --out OUT", "--model-dim:"),
    (
        "vocab-no-examples",
        "data vocab {empty_data} --no-privacy --out OUT/v.txt",
        ("empty.sqlite: expected training examples",),
    ),
    (
        "account-both-sigmas",
        "account --factorization {fac} --noise-multiplier 1 --noise-multiplier-per-participation 2",
        "--noise-multiplier-per-participation: expected at most one",
    ),
    (
        "sim-per-participation-negative",
        "simulate --rounds 4 --noise-multiplier-per-participation -1 --out OUT",
        "--noise-multiplier-per-participation",
    ),
    (
        "sim-vocab-utf8",
        "simulate --backend inprocess --client nextword --rounds 4 --data {so} "
        "--vocab {bad_vocab} --out OUT",
        ("--vocab: ", "bad_v.txt:302: expected UTF-8"),
    ),
    (
        "sim-jsonl-utf8",
        "simulate --backend inprocess --client nextword --rounds 4 --data "
        "{bad_jsonl} --vocab {vocab} --out OUT",
        ("--data: ", "bad.jsonl:46: expected UTF-8"),
    ),
    (
        "cmp-vocab-utf8",
        "compare --rounds 4 --data {so} --vocab {bad_vocab} --out OUT",
        ("--vocab: ", "bad_v.txt:302: expected UTF-8"),
    ),
    (
        "cmp-jsonl-utf8",
        "compare --rounds 4 --data {bad_jsonl} --vocab {vocab} --out OUT",
        ("--data: ", "bad.jsonl:46: expected UTF-8"),
    ),
    (
        "sim-attribution-utf8",
        "simulate --users 20 --rounds 4 --participation multi-attribution "
        "--attribution {bad_csv} --out OUT",
        ("--attribution", "bad_attr.csv:1: UTF-8"),
    ),
    ("vocab-epsilon", "data vocab {so} --epsilon 1e308 --out OUT/v.txt", "--epsilon"),
    ("vocab-out-proc", "data vocab {so} --no-privacy --out /proc/corrflow-v.txt", "--out"),
    ("vocab-split-test", "data vocab {so} --no-privacy --split test --out OUT/v.txt", "--split"),
    (
        "sim-target-epsilon",
        "simulate --rounds 4 --target-epsilon 1e308 --out OUT",
        "--target-epsilon",
    ),
    (
        "account-target-epsilon",
        "account --factorization {fac} --delta 1e-5 --target-epsilon 1e308",
        "--target-epsilon",
    ),
    (
        "plan-target-epsilon",
        "plan --users 100 --cohort 10 --rounds 4 --delta 1e-5 --target-epsilon 1e308 --out OUT",
        "--target-epsilon",
    ),
    ("audit-canaries", f"audit --canaries {BIG} --out OUT", "--canaries"),
    (
        "plan-rounds",
        "plan --users 100 --cohort 10 --rounds 1000000000 --delta 1e-5 "
        "--target-epsilon 8 --out OUT",
        "--rounds",
    ),
    ("sim-local-steps", f"simulate --rounds 4 --local-steps {10**30} --out OUT", "--local-steps"),
    ("cmp-users", "compare --rounds 4 --users 1000000000 --out OUT", "--users"),
    ("generate-users", f"data generate stackoverflow --users {BIG} --out OUT/x.sqlite", "--users"),
    (
        "plan-population",
        f"plan --users {10**30} --cohort 10 --rounds 4 --delta 1e-5 --target-epsilon 8 --out OUT",
        "--users",
    ),
    (
        "cmp-no-examples",
        "compare --rounds 4 --data {empty_data} --vocab {vocab} --out OUT",
        "empty.sqlite",
    ),
    (
        "sim-empty-vocab",
        "simulate --backend inprocess --client nextword --rounds 4 --data {so} "
        "--vocab {empty_vocab} --out OUT",
        "empty_v.txt",
    ),
    (
        "cmp-empty-vocab",
        "compare --rounds 4 --data {so} --vocab {empty_vocab} --out OUT",
        "empty_v.txt",
    ),
    (
        "sim-noise-multiplier",
        "simulate --rounds 4 --noise-multiplier 1e308 --out OUT",
        "--noise-multiplier",
    ),
    (
        "sim-first-round-over-budget",  # σ = 1: round 1 of a dense 4-round run spends ε = 4.377
        "simulate --rounds 4 --users 20 --noise-multiplier 1 --target-epsilon 4 --out OUT",
        ("--noise-multiplier/--target-epsilon", "ε = 4.3772"),
    ),
    (
        "audit-first-round-over-budget",
        "audit --rounds 4 --users 20 --noise-multiplier 1 --target-epsilon 4 --out OUT",
        ("--noise-multiplier/--target-epsilon", "ε = 4.3772"),
    ),
    (
        "sim-bands-blt",
        "simulate --backend inprocess --rounds 4 --kind blt --bands 3 --out OUT",
        "--bands",
    ),
    ("audit-bands-blt", "audit --rounds 4 --kind blt --bands 3 --out OUT", "--bands"),
    (
        "sim-target-epsilon-tiny",
        "simulate --rounds 4 --target-epsilon 1e-300 --out OUT",
        (
            "--target-epsilon",
            "[1e-06, 1000]",
        ),
    ),
    (
        "account-target-epsilon-tiny",
        "account --factorization {fac} --delta 1e-5 --target-epsilon 1e-9",
        ("--target-epsilon", "[1e-06, 1000]"),
    ),
    (
        "sim-noise-workers-over-blocks",  # refused after the factorization was built: removed
        "simulate --backend inprocess --rounds 4 --users 10 --noise-workers 2 --out OUT",
        "--noise-workers",
    ),
    ("cmp-data-garbage", "compare --rounds 4 --data {garbage} --vocab {vocab} --out OUT", "--data"),
    (
        "cmp-data-missing",
        "compare --rounds 4 --data OUT/none.sqlite --vocab {vocab} --out OUT",
        "--data",
    ),
    ("sim-server-lr", "simulate --rounds 4 --server-lr 1e308 --out OUT", "--server-lr"),
    ("sim-local-lr", "simulate --rounds 4 --local-lr 1e308 --out OUT", "--local-lr"),
]


@pytest.mark.parametrize("argv,named", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_refused(files, tmp_path, argv, named):
    out = tmp_path / "out"
    args = [
        str(out) if a == "OUT" else a.replace("OUT/", f"{out}/").format(**files)
        for a in argv.split()
    ]
    res = invoke(*args)
    text = res.output
    assert res.exit_code == 2, text
    for name in named if isinstance(named, tuple) else (named,):
        assert name in text, text
    assert "Traceback" not in text
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_refused_simulate_leaves_an_existing_out_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    res = invoke("simulate", "--rounds", "4", "--server-lr", "1e308", "--out", out)
    assert res.exit_code == 2
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def test_limits_name_the_estimate(tmp_path):
    """A size above the machine is refused with the estimate and what is available."""
    res = invoke("compare", "--rounds", "4", "--users", "1000000000", "--out", tmp_path / "o")
    text = res.output
    assert "GiB" in text and "available" in text
    assert Path(tmp_path / "o").exists() is False


def test_memory_check_uses_the_processs_own_address_space_limit():
    """Under `ulimit -v 8 GiB` the memory a run may use is the room under RLIMIT_AS, not the
    machine's free memory; a model size whose one band of noise state alone exceeds it is blamed on
    the model size, a larger band count on the bands."""
    import subprocess
    import sys

    code = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.RLIM_INFINITY))
from corrflow.errors import InvalidArgumentError
from corrflow.planning.resources import check_fits, estimate, memory_limit
have, source = memory_limit()
assert have < 8 * 2**30 and "RLIMIT_AS" in source, (have, source)
names = {"users": "--users", "factorization": "--rounds", "noise": ("--bands", "--model-dim")}
for d, bands, flag in ((2_000_000_000, 4, "--model-dim"), (200_000_000, 64, "--bands")):
    try:
        check_fits(estimate(10, 64, "toeplitz", bands, d), names)
    except InvalidArgumentError as exc:
        assert exc.field == flag and "RLIMIT_AS" in str(exc), (flag, str(exc))
    else:
        raise AssertionError(f"d = {d} fits under 8 GiB")
check_fits(estimate(10, 64, "toeplitz", 4, 1000), names)
print("ok")
"""
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("peer", ["closed port", "grpc, not ray"])
def test_an_unreachable_ray_address_is_refused_first_within_seconds(tmp_path, peer):
    """--ray-address is checked before any data, factorization or registry work: a closed port,
    or a gRPC server that is not a Ray head (as a proxy that accepts every connection is), is
    refused with exit 2 naming the flag, in well under 15 s, with nothing written."""
    import time
    from concurrent import futures

    import grpc
    from process_support import free_ports

    server = None
    if peer == "closed port":
        address = f"127.0.0.1:{free_ports(1)[0]}"
    else:
        server = grpc.server(futures.ThreadPoolExecutor(1))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
    out = tmp_path / "out"
    try:
        start = time.monotonic()
        res = invoke(
            "simulate", "--rounds", "4", "--users", "10", "--model-dim", "140000",
            "--noise-workers", "2", "--ray-address", address,
            "--release-registry", tmp_path / "registry.sqlite", "--out", out,
        )  # fmt: skip
        took = time.monotonic() - start
    finally:
        if server is not None:
            server.stop(None)
    assert res.exit_code == 2 and "--ray-address" in res.output, res.output
    assert "Traceback" not in res.output and took < 15, took
    assert not out.exists() and not (tmp_path / "registry.sqlite").exists()


def _copy_run(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("state", ".corrflow.lock*"))
    return dest


@pytest.mark.parametrize(
    ("name", "text", "named"),
    [
        ("privacy_report.json", "[]", "privacy_report.json: expected a privacy report"),
        ("privacy_report.json", "{}", "privacy_report.json: expected a privacy report with"),
        ("metrics.json", "{}", "metrics.json: expected a list of per-round metric objects"),
    ],
)
def test_report_on_files_that_are_not_a_runs_exits_2(finished_run_copy, name, text, named):
    run = finished_run_copy
    (run / name).write_text(text)
    before = sorted(p.name for p in run.iterdir())
    res = invoke("report", run)
    assert res.exit_code == 2 and named in res.output, res.output
    assert "Traceback" not in res.output
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written (no run.png)


def test_report_on_a_compare_folder_lists_its_runs(finished_run, tmp_path):
    folder = tmp_path / "cmp"
    (folder / "runs").mkdir(parents=True)
    (folder / "eps8" / "runs").mkdir(parents=True)
    (folder / "comparison.json").write_text("{}")
    arms = [
        _copy_run(finished_run, folder / "runs" / "nonprivate-seed0"),
        _copy_run(finished_run, folder / "eps8" / "runs" / "toeplitz-seed0"),
    ]
    res = invoke("report", folder)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "holds 2 runs" in text, res.output
    assert all(str(a) in text for a in arms) and "Traceback" not in res.output


def test_report_on_a_run_it_cannot_write_skips_the_plot_with_a_note(finished_run_copy, tmp_path):
    """A read-only run (here: run.png cannot be created, as on a read-only mount; the suite may run
    as root, which ignores permission bits) prints its whole summary, then says why no plot."""
    run = finished_run_copy
    (run / "run.png").mkdir()  # writing the PNG fails like a read-only directory would
    res = invoke("report", run)
    assert res.exit_code == 0, res.output
    assert "privacy     ε = " in res.output and "note: run.png not written" in res.output
    assert "Traceback" not in res.output and not any((run / "run.png").iterdir())


def test_account_takes_table_3s_per_participation_noise_multiplier(tmp_path):
    """000 Table 3's DP-SGD (Poisson, q = 1000/342,477, 2,052 steps, z = 0.491, δ = 1e-6; the paper
    says ε = 8.824): given as the papers' per-participation noise multiplier, account prints
    ε ≈ 8.75 (today's PLD) and σ in both conventions."""
    fac = tmp_path / "dpsgd.npz"
    res = invoke(
        "factorize", "--kind", "dpsgd", "--rounds", "2052", "--epochs", "2052", "--min-sep", "1",
        "--out", fac,
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    res = invoke(
        "account", "--factorization", fac, "--participation", "poisson", "--dataset-size",
        "342477", "--expected-batch-size", "1000", "--delta", "1e-6",
        "--noise-multiplier-per-participation", "0.491", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["epsilon"] == pytest.approx(8.75, abs=0.01)
    assert out["noise_multiplier"] == pytest.approx(0.491 / 2052**0.5, rel=1e-9)
    assert out["noise_multiplier_per_participation"] == pytest.approx(0.491, rel=1e-9)
    res = invoke(
        "account", "--factorization", fac, "--participation", "poisson", "--dataset-size",
        "342477", "--expected-batch-size", "1000", "--delta", "1e-6",
        "--noise-multiplier-per-participation", "0.491",
    )  # fmt: skip
    text = " ".join(res.output.split())
    assert (
        "σ (corrflow, sensitivity-1 C) = 0.0108391; per participation (the papers' noise " in text
    )
    assert "multiplier) = 0.491" in text
