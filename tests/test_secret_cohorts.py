"""Amplified ε holds only while nobody learns who was sampled: two amplified runs that differ only
in their secret cohort key publish the same console output, privacy_report.json and metrics.json
(apart from the model's loss and accuracy, the learning verdict, paths and the run id), and no
public file or console line carries a hashed user id or a per-round reply count. Those go to the
owner-only operator files."""

import json
import logging
import re
import stat

import pytest
from flwr.app import ArrayRecord, Message, RecordDict
from strategy_support import HANDLERS, KEY, request_for
from strategy_support import small_config as _cfg

from corrflow.run.reading import participation_users
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

AMPLIFIED = {
    "poisson": dict(
        participation="poisson", min_sep=1, participation_rate=0.25, accountant="mmcc", kind="dpsgd"
    ),
    "bminsep": dict(
        participation="bminsep",
        min_sep=3,
        participation_rate=0.2,
        accountant="monte-carlo",
        mc_samples=2000,
        delta=1e-3,
    ),
    # No accountant named: the tightest verified bound (Monte Carlo or unamplified), its selection
    # public.
    "bminsep-tightest": dict(
        participation="bminsep", min_sep=3, participation_rate=0.2, mc_samples=2000, delta=1e-3
    ),
}
MODEL = re.compile(r"(test-loss|accuracy) -?[0-9.]+(e-?\d+)?|\d+(\.\d+)?\s*s\b")


def _corrupt_first(replies):
    """One reply per round with a NaN: a rejection whose sender only the operator may learn."""
    out = list(replies)
    if out and not out[0].has_error():
        arrays = out[0].content["arrays"].to_numpy_ndarrays()
        arrays[0][0] = float("nan")
        out[0] = Message(
            RecordDict({"arrays": ArrayRecord(arrays), "metrics": out[0].content["metrics"]}),
            reply_to=request_for(out[0]),
        )
    return out


def _run(tmp_path, name, settings, capsys, caplog):
    # σ small enough that both runs learn: the console then differs in loss and accuracy figures
    # only.
    cfg = _cfg(
        tmp_path / name, num_users=20, num_rounds=6, epochs=2, noise_multiplier=0.3, **settings
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="corrflow"):
        s = run_server(InProcessGrid(HANDLERS, 20, tamper=_corrupt_first), cfg, noise_key=KEY)
    console = capsys.readouterr().err + "\n".join(r.getMessage() for r in caplog.records)
    return s, console, tmp_path / name


def _public(run_dir):
    report = json.loads((run_dir / "privacy_report.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in ("run_id", "learning"):
        report.pop(key)
    for m in metrics:
        m.pop("test_loss", None)
        m.pop("test_accuracy", None)
    return report, metrics


def _mask(text, run_dir):
    return MODEL.sub("#", text.replace(str(run_dir), "RUN"))


@pytest.mark.parametrize("sampling", list(AMPLIFIED))
def test_public_record_does_not_depend_on_the_secret_cohorts(tmp_path, capsys, caplog, sampling):
    a, console_a, dir_a = _run(tmp_path, "a", AMPLIFIED[sampling], capsys, caplog)
    b, console_b, dir_b = _run(tmp_path, "b", AMPLIFIED[sampling], capsys, caplog)
    assert a.ledger.selected != b.ledger.selected  # the two runs sampled other cohorts
    assert a.ledger.rejections and b.ledger.rejections  # and rejected replies
    assert _public(dir_a) == _public(dir_b)
    # the selection and every bound are public, and cohort-free
    if "accountant" not in AMPLIFIED[sampling]:
        acc = json.loads((dir_a / "privacy_report.json").read_text())["accountant"]
        assert acc["selected"] and {b["accountant"] for b in acc["bounds"]} == {
            "monte-carlo",
            "unamplified",
        }
    assert _mask(console_a, dir_a) == _mask(console_b, dir_b)

    for run, console, run_dir in ((a, console_a, dir_a), (b, console_b, dir_b)):
        operator = run_dir / "operator"
        # each user's entry: the operator's store, which the operator's participation.json names
        participation = json.loads((operator / "participation.json").read_text())["realized"][
            "participation"
        ]
        assert participation["per_user"]["store"] == "operator/participation.sqlite"
        hashed = set(
            participation_users(json.loads((run_dir / "privacy_report.json").read_text()), run_dir)
        )
        assert len(hashed) == len(run.ledger.selected) > 0
        public = [
            (run_dir / "privacy_report.json").read_text(),
            (run_dir / "metrics.json").read_text(),
            console,
        ]
        for text in public:
            assert not any(h in text for h in hashed)
            assert not re.search(r'"(accepted|rejected|replies|kept|clipped|zeroed)"', text)
            assert "rejected reply" not in text and "accepted " not in text
        assert stat.S_IMODE(operator.stat().st_mode) == 0o700
        for name in ("participation.json", "participation.sqlite", "rounds.jsonl", "operator.log"):
            assert stat.S_IMODE((operator / name).stat().st_mode) == 0o600
        # the sender, for the operator
        assert "rejected reply" in (operator / "operator.log").read_text()
        rounds = [json.loads(line) for line in (operator / "rounds.jsonl").read_text().splitlines()]
        assert [r["rejected"] for r in rounds] == [
            sum(x["round"] == t for x in run.ledger.rejections) for t in range(6)
        ]


def test_a_run_with_a_public_schedule_says_what_it_publishes_outside_the_guarantee(tmp_path):
    s = run_server(InProcessGrid(HANDLERS, 12), _cfg(tmp_path), noise_key=KEY, quiet=True)
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert "accepted" in report["outside_guarantee"]["metrics"] and len(
        participation_users(report, tmp_path)
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [m["accepted"] for m in metrics[1:]] == [
        sum(t in rs for rs in s.ledger.replied.values()) for t in range(6)
    ]
