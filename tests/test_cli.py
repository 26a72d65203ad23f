import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from corrflow.server.cli import app

REQUIRED = {
    "kind",
    "rounds",
    "epochs",
    "min_sep",
    "bands",
    "total_squared_error",
    "rmse",
    "max_error",
    "sensitivity",
    "sensitivity_exact",
    "lower_bound",
    "seconds",
}


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_factorize_json_and_describe(tmp_path):
    out = tmp_path / "f.npz"
    r = run(
        "factorize",
        "--kind",
        "dense",
        "--rounds",
        "6",
        "--epochs",
        "3",
        "--momentum",  # the prefix-sum workload of 000's tables (default: simulate's momentum)
        "0",
        "--cooldown-fraction",
        "0",
        "--json",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    assert REQUIRED <= set(obj)
    assert round(obj["total_squared_error"] ** 0.5, 3) == 6.461  # 000 Table 6
    assert obj["sensitivity_exact"] is True and obj["lower_bound"] <= obj["total_squared_error"] * (
        1 + 1e-9
    )
    r2 = run("factorize", "--describe", str(out), "--json")
    assert r2.returncode == 0, r2.stderr
    obj2 = json.loads(r2.stdout.strip().splitlines()[-1])
    assert obj2["sha256"] == obj["sha256"] and obj2["rmse"] == pytest.approx(obj["rmse"])


def test_factorize_momentum_toeplitz_min_sep():
    r = run(
        "factorize",
        "--kind",
        "toeplitz",
        "--rounds",
        "64",
        "--epochs",
        "4",
        "--min-sep",
        "8",
        "--bands",
        "8",
        "--participation",
        "bminsep",
        "--json",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    assert obj["participation"] == "min-sep" and obj["bands"] == 8 and obj["sensitivity_exact"]
    assert obj["workload"]["momentum"] == 0.5  # simulate's: the numpy client's server momentum
    # the sampler may take a user every 8 rounds: k = ⌈64/8⌉ = 8, not --epochs 4, and it says so
    assert obj["epochs"] == 8
    assert "epochs 4 is not used" in r.stderr and "k = ⌈64/8⌉ = 8" in r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--kind", "dense", "--rounds", "10", "--epochs", "3"], "epochs"),
        (["--kind", "banded", "--rounds", "8", "--bands", "9"], "bands"),
        (
            ["--kind", "toeplitz", "--rounds", "8", "--min-sep", "9", "--participation", "bminsep"],
            "--min-sep",
        ),
        (["--kind", "toeplitz", "--rounds", "8", "--min-sep", "3"], "--min-sep"),  # fixed-epoch
        (["--kind", "dense", "--rounds", "8", "--momentum", "nan"], "--momentum"),
        (["--kind", "magic", "--rounds", "8"], "kind"),
        (["--rounds", "8", "--participation", "nope"], "--participation"),
    ],
)
def test_bad_arguments_exit_2(args, needle):
    r = run("factorize", *args, "--json")
    assert r.returncode == 2
    assert needle in r.stderr


def test_corrupted_or_truncated_file_is_a_bad_argument(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    r = run("factorize", "--describe", str(bad), "--json")
    assert (
        r.returncode == 2
        and "--describe" in r.stderr
        and "not a readable factorization" in r.stderr
    )
    good = tmp_path / "t.fact"  # written under exactly the name given
    assert (
        run(
            "factorize",
            "--kind",
            "toeplitz",
            "--rounds",
            "8",
            "--epochs",
            "2",
            "--quiet",
            "--out",
            str(good),
        ).returncode
        == 0
    )
    assert good.is_file() and not (tmp_path / "t.fact.npz").exists()
    (tmp_path / "cut.npz").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    r = run(
        "account",
        "--factorization",
        str(tmp_path / "cut.npz"),
        "--delta",
        "1e-5",
        "--noise-multiplier",
        "1",
    )
    assert r.returncode == 2 and "--factorization" in r.stderr


def _bad_input_cases():
    """(command line with {tmp} placeholders, the flag its error must name): inputs that once gave a
    traceback (an unwritable output, a binary manifest) or were silently ignored, each refused
    before anything is written."""
    plan = [
        "plan",
        "--rounds",
        "8",
        "--users",
        "20",
        "--cohort",
        "10",
        "--target-epsilon",
        "8",
        "--delta",
        "1e-5",
        "--quiet",
    ]
    sim = ["simulate", "--users", "10", "--rounds", "4", "--backend", "inprocess"]
    return [
        (plan + ["--out", "{tmp}/a_file"], "--out"),
        (plan + ["--out", "{tmp}/p", "--cache-dir", "{tmp}/a_file"], "--cache-dir"),
        (
            [
                "factorize",
                "--kind",
                "toeplitz",
                "--rounds",
                "8",
                "--epochs",
                "2",
                "--out",
                "/proc/corrflow.npz",
            ],
            "--out",
        ),
        (
            [
                "factorize",
                "--kind",
                "toeplitz",
                "--rounds",
                "8",
                "--epochs",
                "2",
                "--out",
                "{tmp}/a_file/f.npz",
            ],
            "--out",
        ),
        (
            [
                "factorize",
                "--kind",
                "toeplitz",
                "--rounds",
                "8",
                "--epochs",
                "2",
                "--cooldown-fraction",
                "2",
            ],
            "--cooldown-fraction",
        ),
        (
            ["factorize", "--kind", "dense", "--rounds", "8", "--epochs", "2", "--tol", "nan"],
            "--tol",
        ),
        (["factorize", "--kind", "dense", "--rounds", "10000000", "--epochs", "1"], "--rounds"),
        (["compare", "--preset", "tiny", "--out", "{tmp}/a_file"], "--out"),
        (sim + ["--out", "{tmp}/a_file"], "--out"),
        (
            sim + ["--mode", "cross-silo", "--manifest", "{tmp}/manifest.png", "--out", "{tmp}/s"],
            "--manifest",
        ),
    ]


@pytest.mark.parametrize("args, flag", _bad_input_cases())
def test_bad_input_exits_2_naming_the_flag_and_writes_nothing(tmp_path, args, flag):
    (tmp_path / "a_file").write_text("a file, not a directory\n")
    (tmp_path / "manifest.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2, r.stderr
    assert f"error: {flag}:" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_poisson_without_min_sep_runs(tmp_path):
    """--min-sep left at 0 is poisson's own separation (1), not a refusal (trial report)."""
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--backend",
            "inprocess",
            "--users",
            "20",
            "--rounds",
            "4",
            "--participation",
            "poisson",
            "--out",
            str(tmp_path / "o"),
            "--json",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code in (0, 3), res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["rounds_completed"] == 4
    assert report["planned"]["participation"]["kind"] == "poisson"
    assert report["planned"]["participation"]["min_sep"] == 1


def test_audit_help_shows_audits_own_defaults():
    """audit --help: --out's default is corrflow_audit, --users names what each preset sets
    (PRESETS is their one source), and exit 5 is the whole interval of ε̂ above the claim, as
    `corrflow.strategies.canaries._verdict` decides."""
    from corrflow.server.compare import PRESETS

    res = CliRunner().invoke(app, ["audit", "--help"], env={"COLUMNS": "400"})
    text = " ".join(res.output.split())
    assert "[default: corrflow_audit]" in text and "corrflow_run" not in text
    for name, preset in PRESETS.items():
        assert f"{name} {preset.users}" in text
    assert "the whole 95% bootstrap interval of ε̂ lies above it" in text


def test_shared_settings_help_is_per_command():
    """A command's help names only what it has: no noise multiplier in plan's --target-epsilon or
    compare's --epsilons, no server waiting in compare's --users; the accountants in one order;
    account's --mc-samples declares how it differs from a run's."""

    def help_of(command):
        res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
        return " ".join(res.output.replace("│", " ").split())

    for command, flag in (("plan", "--target-epsilon"), ("compare", "--epsilons")):
        line = help_of(command).split(flag, 1)[1].split("--", 1)[0]
        assert "noise multiplier" not in line, line
    assert "server waits" not in help_of("compare")
    order = "unamplified, cyclic-poisson (001 Prop. 2.1), monte-carlo"
    for command in ("simulate", "audit", "account"):
        assert order in help_of(command)
    assert "unamplified, cyclic-poisson, monte-carlo, mmcc" in help_of("plan")
    assert "at least 1000 for a run" in help_of("simulate")
    assert "Unlike a run's --mc-samples" in help_of("account")
