"""The run's record kept per round in O(cohort): the incremental realised sensitivity
equals a recomputation over the whole ledger, the append-only ledger log adds up to the ledger, and
a run killed (SIGKILL) at any moment and resumed reports what an uninterrupted run reports."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_support import checkpoint
from strategy_support import HANDLERS, KEY
from strategy_support import small_config as _cfg

from corrflow.accounting import realized_sensitivity
from corrflow.accounting.participation import entries_digest
from corrflow.accounting.policy import with_round
from corrflow.accounting.tracking import IncrementalSensitivity, PrivacyPlan, RunPrivacy
from corrflow.factorization.encoders import DenseEncoder
from corrflow.run.journal import JOURNAL, ReleaseJournal
from corrflow.run.ledger import LEDGER_LOG, LedgerLog, LogPosition, replay
from corrflow.run.reading import participation_users
from corrflow.run.recorder import REPORT_EVERY
from corrflow.run.user_store import STORE, read_entries
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

TESTS = Path(__file__).parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))


def _encoder(n: int, signed: bool) -> DenseEncoder:
    """A lower-triangular C: non-negative (exact pattern values) or with negative entries (upper
    bounds, which need not grow with the pattern)."""
    rng = np.random.default_rng(3)
    C = np.tril(rng.standard_normal((n, n)) if signed else rng.random((n, n)))
    C[np.diag_indices(n)] = np.abs(C[np.diag_indices(n)]) + 1.0
    return DenseEncoder(C)


@pytest.mark.parametrize("signed", [False, True])
def test_incremental_sensitivity_equals_a_recomputation_over_the_ledger(signed):
    """Every round — prospective (`after`, the budget guard) and recorded (`add`) — the tracker's
    value, exactness and method equal `realized_sensitivity` over every user from scratch, with
    users listed twice in a round (multi-attribution), and the prospective check changes nothing.
    3,000 users over 12 rounds leave enough stale patterns to rebuild the heap."""
    n, users = 12, [f"u{i}" for i in range(3000)]
    enc, rng = _encoder(n, signed), np.random.default_rng(7)
    tracker, selected = IncrementalSensitivity(enc), {}
    for t in range(n):
        cohort = list(rng.choice(users, size=900, replace=False))
        cohort += cohort[:5]  # five users contribute two items this round
        expected, _ = realized_sensitivity(enc, with_round(selected, t, cohort))
        assert tracker.after(selected, t, cohort) == expected
        before, _ = realized_sensitivity(enc, selected)
        assert tracker.value() == before  # the prospective round left nothing behind
        tracker.add(selected, t, cohort)
        for u in cohort:
            selected.setdefault(u, []).append(t)
        got, want = tracker.value(), realized_sensitivity(enc, selected)[0]
        assert (got.value, got.exact, got.method) == (want.value, want.exact, want.method)
    assert want.exact == (not signed)  # the signed C's patterns are bounded, not exact
    assert len(tracker._heap) <= 2 * len(tracker._live) + 1024 + 900  # compacted, O(patterns)
    rebuilt = IncrementalSensitivity.of(enc, selected)  # a resumed run's tracker
    assert rebuilt.value() == tracker.value()


def test_a_runs_epsilon_and_ledger_log_equal_a_recomputation(tmp_path):
    """After a run, the reported realised sensitivity and ε equal a from-scratch recomputation over
    the full ledger (`RunPrivacy.realized`), every round's ε equals the one recomputed from the
    ledger up to it, and the ledger log (one line per round, chained) adds up to the ledger."""
    cfg = _cfg(tmp_path, num_rounds=12, epochs=3)
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    fac, ledger = s.run.plan.factorization, s.ledger
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    privacy = RunPrivacy(fac, PrivacyPlan(cfg.noise_multiplier, None), cfg.delta)
    full = privacy.realized(ledger.selected)
    assert report["rounds_completed"] == 12
    assert report["realized"]["sensitivity"] == pytest.approx(full.sensitivity, rel=1e-12)
    assert report["realized"]["epsilon"] == pytest.approx(full.epsilon, rel=1e-12)
    assert full.sensitivity == pytest.approx(np.sqrt(3) * fac.sensitivity.value, rel=0.5)
    for t, eps in enumerate(ledger.epsilon_history):
        upto = {u: [r for r in rs if r <= t] for u, rs in ledger.selected.items()}
        want = privacy.realized({u: rs for u, rs in upto.items() if rs}).epsilon
        assert eps == pytest.approx(want, rel=1e-12)
    public = checkpoint(tmp_path).public
    assert "ledger" not in public and "metrics_history" not in public  # O(1) in the population
    log = LedgerLog(tmp_path / "state" / LEDGER_LOG, LogPosition.from_dict(public["ledger_log"]))
    entries = log.read()
    assert [e["round"] for e in entries] == list(range(12))
    again, history = replay(entries)
    assert again.selected == dict(ledger.selected)
    assert again.epsilon_history == list(ledger.epsilon_history)
    assert history == list(s.metrics_history)


def _normalised(report: dict, run_dir: Path) -> dict:
    """A report without what differs between two runs of the same schedule (run id, salted user
    hashes and the per-user store's digest of them, noise lineage, learning curve: the noise keys
    differ); each user's entry read back from the per-user store."""
    real = dict(report["realized"])
    part = dict(real["participation"])
    part["per_user"] = {k: v for k, v in part["per_user"].items() if k != "digest"}
    part["users"] = sorted(
        (u["rounds"], u["min_gap"]) for u in participation_users(report, run_dir).values()
    )
    real["participation"] = part
    out = {k: v for k, v in report.items() if k not in ("run_id", "lineage", "learning")}
    out["realized"] = real
    return out


@pytest.mark.integration
def test_sigkill_at_any_moment_then_resume_reports_what_an_uninterrupted_run_does(tmp_path):
    """A server killed (SIGKILL) mid-run at three different moments, each time resumed: the journal
    releases every round once, the ledger log holds each round once, and the final report equals an
    uninterrupted run's (same schedule) field for field — ε, sensitivity, participation."""
    whole = tmp_path / "whole"
    run_server(InProcessGrid(HANDLERS, 12), _cfg(whole, num_rounds=8), noise_key=KEY, quiet=True)
    out = tmp_path / "killed"
    for wait_for in (2, 4, 6):
        proc = subprocess.Popen(
            [sys.executable, str(TESTS / "fault_run.py"), str(out)],
            env=dict(ENV, ROUND_DELAY="0.05"),
        )
        deadline = time.monotonic() + 240
        journal = out / JOURNAL
        while not (journal.exists() and len(journal.read_text().splitlines()) >= wait_for):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.013 * wait_for)  # somewhere inside the next round
        proc.kill()
        proc.wait()
    r = subprocess.run(
        [sys.executable, str(TESTS / "fault_run.py"), str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [e.round for e in ReleaseJournal(out / JOURNAL).read()] == list(range(8))
    lines = (out / "state" / LEDGER_LOG).read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == list(range(8))
    resumed = json.loads((out / "privacy_report.json").read_text())
    uninterrupted = json.loads((whole / "privacy_report.json").read_text())
    assert resumed["rounds_completed"] == 8 and resumed["schema_version"] == 3
    assert _normalised(resumed, out) == _normalised(uninterrupted, whole)
    assert len(resumed["lineage"]["key_segments"]) > 1  # it did restart
    assert REPORT_EVERY > 1
    operator_lines = (out / "operator" / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in operator_lines] == list(range(8))


def test_a_kill_between_a_release_and_its_operator_line_is_completed_at_the_restart(tmp_path):
    """The operator's ``rounds.jsonl`` line is written after the round's release: a kill between
    the two — here the last line cut, torn half-way — leaves a released round without its line,
    and the restart writes it (on a line of its own) before the next round; every round has one
    line, once."""
    from test_run import INITIAL, NODE, USERS, _client

    from corrflow.run import Run, RunLock, open_run_directory, prepare

    cfg = _cfg(tmp_path / "run", num_rounds=6)
    lines = tmp_path / "run" / "operator" / "rounds.jsonl"
    for count in (3, None):
        with RunLock(cfg.state_dir):
            plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
            run = Run.start(plan, INITIAL, open_run_directory(cfg.state_dir), noise_key=KEY)
            while (count is None or run.state.next_round < count) and (
                round_plan := run.plan_next()
            ) is not None:
                routed = round_plan.route(NODE, set(NODE.values()))
                run.step(routed, [_client(run, n) for n in routed.expected])
        if count is not None:
            text = lines.read_text().splitlines(keepends=True)
            assert [json.loads(line)["round"] for line in text] == [0, 1, 2]
            lines.write_text("".join(text[:-1]) + text[-1][:10])  # round 3's line, torn
    rounds = [json.loads(line)["round"] for line in lines.read_text().splitlines()[3:]]
    assert lines.read_text().splitlines()[2] == text[-1][:10]
    assert rounds == [2, 3, 4, 5]


def test_report_command_says_when_the_journal_is_ahead_of_the_report(tmp_path):
    """A server killed between two complete reports leaves privacy_report.json behind the journal:
    `corrflow report` says how many rounds the journal released and how many the report covers,
    instead of 'released N of M'."""
    cfg = _cfg(tmp_path, num_rounds=6)
    run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    path = tmp_path / "privacy_report.json"
    report = json.loads(path.read_text())
    # as a kill after round 2's: the report's reference to the per-user store is round 2's (the
    # store itself is at round 6, and reads back as of round 2)
    entries = list(read_entries(tmp_path / STORE, below=2))
    part = report["realized"]["participation"]
    part["per_user"].update(rows=len(entries), digest=entries_digest(entries))
    path.write_text(json.dumps({**report, "rounds_completed": 2}))
    r = subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", "report", str(tmp_path), "--no-plot"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the release journal records 6 released rounds, this report covers 2" in r.stderr
    assert "released 2 of" not in r.stderr
