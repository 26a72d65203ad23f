"""Server CPU per round at StackOverflow's scale: 342,477 users, cohort 1,000, 2,052
rounds, k = 6 participations at separation b = 342 (000 §5.3 and App. F; 001) — fixed-epoch, and the
b-min-sep sampler (004 Alg. 2) at the same expected cohort — in process, with a client that returns
precomputed updates of a d-parameter model (a pool of 8, the model sent added: a full-weight reply
as a real client sends; its CPU is measured apart), so the server does all of its real work. A
round's 8 distinct replies are encoded once and shared by the clients that send them (the server
decodes every reply and never changes one), so a d = 4·10⁶ round does not spend 25 s building
identical messages.

Measured per round (process CPU, never wall: the machine is shared): the server's CPU (the round's
CPU minus the clients'), split into scheduling (the cohort planner, min-sep monitor, routing, the
train messages), identities (the node directory, replies matched to users), clipping (validate,
subtract, clip, sum), noise ((C⁻¹Z)_t, the server optimizer), accounting (realised sensitivity
and ε, the budget guard), checkpoint (ledger log + atomic checkpoint), journal (release journal
and registry) and report (privacy_report.json and metrics.json, every `REPORT_EVERY` rounds and at
the end); the bytes each round writes (``wchar`` of /proc/self/io); the peak RSS. σ is given
(``--noise-multiplier``), so no calibration runs; building the factorization, the population's
identities and the planner is ``setup`` and reported apart.

``--rounds R`` releases only the first R of the 2,052 planned rounds: with fixed-epoch k = 6,
b = 342 every user has trained by round 342, so R = 450 gives a first-100 and a last-100 median
after the whole population is seen; the total is extrapolated linearly to 2,052 rounds (flat per
round: the check is the last-100 / first-100 ratio). Targets: last-100 median ≤ 1.1× first-100;
server CPU ≤ 45 minutes per sampling mode (2 cores).

``python benchmarks/scale.py simulate ARGS…`` runs ``corrflow simulate ARGS…`` in this process and
prints the process CPU of each round (between two rounds' ends: server and in-process clients), the
means of rounds 2–9 and of the last 8 rounds, and the peak RSS — the check at 100,000 users:
``python benchmarks/scale.py simulate --backend inprocess --users 100000 --rounds 40 --epochs 1
--noise-multiplier 1 --out OUT``.

``python benchmarks/scale.py sums [--params 4000000] [--replies 40]`` prints the per-reply CPU of
the run's exact clip-and-sum (int64 fixed point, `corrflow.run.clipping.ExactSum`), the float32
clip-and-sum (`ClippedSum`) and a bare float32 sum at d parameters.

``python benchmarks/scale.py engines [--users 20000] [--rounds 20]`` runs the same ``corrflow
simulate`` (cohort = users / rounds, k = 1) on the in-process grid and on Flower's Ray engine and
prints each one's wall clock and process-tree CPU per round and Ray's overhead over in-process.

Usage: python benchmarks/scale.py [--mode fixed-epoch|bminsep] [--rounds 2052] [--users 342477]
       [--cohort 1000] [--params 100000] [--noise-multiplier 1.0]
       [--rows FILE] [--reference-every 50]
       python benchmarks/scale.py simulate ARGS…
       python benchmarks/scale.py sums [--params 4000000] [--replies 40]
       python benchmarks/scale.py engines [--users 20000] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

import corrflow.run.core as core
import corrflow.run.round as round_mod
import corrflow.strategies.correlated as correlated
from corrflow.accounting.policy import RunAccounting
from corrflow.accounting.tracking import IncrementalSensitivity
from corrflow.config import RunConfig
from corrflow.errors import InvalidArgumentError
from corrflow.run.clipping import ClippedSum, ExactSum, fixed_point_scale
from corrflow.run.ledger import LedgerLog
from corrflow.run.recorder import REPORT_EVERY, Recorder
from corrflow.run.resume import RunLock
from corrflow.run.store import RunStore
from corrflow.server.inprocess import InProcessGrid, enable_offline_messages
from corrflow.strategies.messaging import NodeDirectory, ReplyStream, pull_batch
from corrflow.strategies.session import RunSpec, prepare_run

PHASES = (
    "scheduling",
    "identities",
    "clipping",
    "noise",
    "accounting",
    "checkpoint",
    "journal",
    "report",
)


class Split:
    """Process CPU of each phase, exclusive of the timed phases nested in it."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t0 = time.process_time()
            self._stack.append(0.0)
            try:
                return fn(*a, **kw)
            finally:
                elapsed = time.process_time() - t0
                self.total[name] += elapsed - self._stack.pop()
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    def take(self) -> dict[str, float]:
        out, self.total = dict(self.total), defaultdict(float)
        return out


def _install(split: Split) -> None:
    """Time the server's phases (module- and class-level wrappers: this process only)."""
    w = split.wrap
    core.plan_round = w("scheduling", core.plan_round)
    core.RoundPlan.route = w("scheduling", core.RoundPlan.route)
    correlated.train_messages = w("scheduling", correlated.train_messages)
    NodeDirectory.refresh = w("identities", NodeDirectory.refresh)
    correlated.to_reply = w("identities", correlated.to_reply)
    core.collect = w("clipping", core.collect)
    round_mod.noisy_update = w("noise", round_mod.noisy_update)
    for name in ("realized_after", "budget_exceeded", "realized"):
        setattr(RunAccounting, name, w("accounting", getattr(RunAccounting, name)))
    IncrementalSensitivity.add = w("accounting", IncrementalSensitivity.add)
    LedgerLog.append = w("checkpoint", LedgerLog.append)
    RunStore.checkpoint = w("checkpoint", RunStore.checkpoint)
    RunStore.release = w("journal", RunStore.release)
    Recorder.write_report = w("report", Recorder.write_report)
    Recorder.write_metrics = w("report", Recorder.write_metrics)


def _written() -> int:
    """Bytes this process has written so far (``wchar``: every write call, page cache or not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _config(args, tmp: Path) -> RunConfig:
    fixed = args.mode == "fixed-epoch"
    return RunConfig(
        num_users=args.users,
        num_rounds=args.planned_rounds,
        epochs=args.epochs,
        participation="fixed-epoch" if fixed else "bminsep",
        min_sep=0 if fixed else args.min_sep,
        # b-min-sep at the same expected cohort: the stationary rate p0 = cohort / population
        participation_rate=0.0 if fixed else args.cohort / args.users,
        kind=args.kind,
        noise_multiplier=args.noise_multiplier,
        accountant=args.accountant,
        clip_norm=1.0,
        state_dir=str(tmp / "run"),
        release_registry=str(tmp / "registry.sqlite"),
    )


def run(args) -> dict:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("corrflow").setLevel(logging.WARNING)
    enable_offline_messages()
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal(args.params, dtype=np.float32) * 0.01 for _ in range(8)]
    client_cpu = [0.0]

    built: dict[int, ArrayRecord] = {}  # this round's replies by pool index, built once and shared
    built_round = [0]

    def train(msg, ctx):
        t0 = time.process_time()
        t = int(msg.content["config"]["server-round"])
        j = (ctx.node_config["partition-id"] + t) % 8
        if built_round[0] != t:
            built.clear()
            built_round[0] = t
        if j not in built:
            sent = msg.content["arrays"].to_numpy_ndarrays()[0]
            built[j] = ArrayRecord([sent + pool[j]])
        reply = Message(
            RecordDict(
                {
                    "arrays": built[j],
                    "metrics": MetricRecord({"num-examples": 10}),
                }
            ),
            reply_to=msg,
        )
        client_cpu[0] += time.process_time() - t0
        return reply

    tmp = Path(tempfile.mkdtemp(prefix="corrflow-bench-scale-"))
    try:
        cfg = _config(args, tmp)
        t0 = time.process_time()
        split = Split()
        # the grid runs the handler when its reply is pulled, inside the server's collection: timed
        # as its own phase, so the server's phases exclude it
        grid = InProcessGrid({"train": split.wrap("client", train)}, cfg.num_users)
        lock = RunLock(cfg.state_dir).__enter__()
        strategy = prepare_run(grid, RunSpec(cfg, [np.zeros(args.params, np.float32)]))
        setup = time.process_time() - t0
        _install(split)
        split.take()
        arrays = strategy.initial_arrays()
        batch = pull_batch(strategy.run.plan.layout)
        rows, reference = [], []
        for r in range(args.rounds):
            c0, w0, client_cpu[0] = time.process_time(), _written(), 0.0
            messages = list(strategy.configure_train(r + 1, arrays, None, grid))
            cohort = len(messages)
            # corrflow's own loop: pushed at once, pulled `batch` ids at a time, each reply summed
            # (and its buffer freed) as it arrives
            replies = ReplyStream(grid, messages, 600.0, None, batch)
            arrays, _ = strategy.aggregate_train(r + 1, replies)
            del replies, messages
            assert arrays is not None, f"round {r + 1} released no model"
            cpu = time.process_time() - c0
            rows.append(
                {
                    "server": cpu - client_cpu[0],
                    "client": client_cpu[0],
                    "bytes": _written() - w0,
                    "cohort": cohort,
                    **split.take(),
                }
            )
            if r == 0 or (r + 1) % args.reference_every == 0:
                reference.append(_reference_sums(args.params, cohort, pool))
                if args.rows:
                    _append(args.rows, {"round": r + 1, "reference": reference[-1]})
            if args.rows:  # each round as it ends: a run stopped early still has its rows
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                _append(args.rows, {"round": r + 1, **rows[-1], "peak_rss_mb": rss})
            if (r + 1) % 50 == 0 or r < 3:  # progress on stderr: a long run can be read as it goes
                done = [x["server"] for x in rows]
                print(
                    f"round {r + 1}: server CPU {statistics.median(done[-50:]):.3f} s/round "
                    f"(median of the last 50), client {client_cpu[0]:.3f} s, peak RSS "
                    f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB",
                    file=sys.stderr,
                    flush=True,
                )
        t1 = time.process_time()
        strategy.run.write_report()  # what the end of a run (or a stop after --rounds) writes
        strategy.run.write_metrics()
        final_report = time.process_time() - t1
        report_bytes = (Path(cfg.state_dir) / "privacy_report.json").stat().st_size
        noise_buffer = strategy.run.noise.buffer_bytes
        lock.__exit__(None, None, None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = _summary(args, cfg, rows, setup, final_report, report_bytes, noise_buffer)
    out["reference_cpu_s_per_round"] = _reference_summary(rows, reference)
    return out


def _append(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _reference_sums(d: int, cohort: int, pool: list[np.ndarray]) -> dict[str, float]:
    """The CPU of one cohort's clip-and-sum on the float32 reference path (`ClippedSum`: full-weight
    replies, ℓ2 clip 1) and of a bare float32 sum of the same updates, replies built outside the
    timed part."""
    sent = np.zeros(d, np.float32)
    clipped, bare = ClippedSum([(d,)]), np.zeros(d, np.float32)
    t_clip = t_bare = 0.0
    for i in range(cohort):
        reply = sent + pool[i % 8]
        t0 = time.process_time()
        clipped.add([reply], [sent], 1.0, 0.0)
        t1 = time.process_time()
        bare += reply
        t_clip, t_bare = t_clip + t1 - t0, t_bare + time.process_time() - t1
    return {"clipped_sum": t_clip, "bare_sum": t_bare}


def _reference_summary(rows: list[dict], reference: list[dict[str, float]]) -> dict:
    clip = statistics.median(x["clipped_sum"] for x in reference)
    bare = statistics.median(x["bare_sum"] for x in reference)
    server = statistics.median(r["server"] for r in rows)
    exact = statistics.median(r.get("clipping", 0.0) for r in rows)
    return {
        "samples": len(reference),
        "clipped_sum": clip,
        "bare_float32_sum": bare,
        "clipped_over_bare": clip / bare,
        "exact_clipping_over_clipped": exact / clip,
        "server_over_clipped": server / clip,
        "server_over_bare": server / bare,
    }


def _summary(args, cfg, rows, setup, final_report, report_bytes, noise_buffer) -> dict:
    server = [r["server"] for r in rows]
    w = min(100, max(1, len(rows) // 4))
    first, last = statistics.median(server[1 : w + 1]), statistics.median(server[-w:])
    total = sum(server)
    per_round = total / len(rows)
    return {
        "mode": args.mode,
        "users": cfg.num_users,
        "cohort_expected": args.cohort,
        "cohort_median": statistics.median(r["cohort"] for r in rows),
        "rounds_planned": cfg.num_rounds,
        "rounds_run": len(rows),
        "epochs": cfg.epochs,
        "min_sep": args.min_sep,
        "kind": cfg.kind,
        "accountant": cfg.accountant,
        "params": args.params,
        "report_every": REPORT_EVERY,
        "window": w,  # rounds in each median: 100, or a quarter of a shorter run
        "population_seen": len(rows) >= args.min_sep,  # else first/last compare a growing record
        "server_cpu_s": {
            "first_median": first,
            "last_median": last,
            "last_over_first": last / first,
            "mean": per_round,
            "total_run": total,
            "total_extrapolated_to_planned": per_round * cfg.num_rounds,
            "final_report": final_report,
        },
        "phases_cpu_s_per_round": {
            p: {
                "first_mean": statistics.fmean(r.get(p, 0.0) for r in rows[1 : w + 1]),
                "last_mean": statistics.fmean(r.get(p, 0.0) for r in rows[-w:]),
            }
            for p in PHASES
        },
        "client_cpu_s_per_round": statistics.median(r["client"] for r in rows),
        "setup_cpu_s": setup,
        "bytes_written_per_round": {
            "median": statistics.median(r["bytes"] for r in rows),
            "max": max(r["bytes"] for r in rows),
            "privacy_report_json": report_bytes,
        },
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_less_noise_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        - noise_buffer / 2**20,
        # model-sized noise state kept between rounds (in the peak RSS; (bands − 1)·d·4 banded)
        "noise_buffer_mb": noise_buffer / 2**20,
        "targets": {
            # meaningful only once every user has trained (rounds_run ≥ b)
            "last_over_first_le_1.1": (last / first <= 1.1) if len(rows) >= args.min_sep else None,
            "server_cpu_le_45_min": per_round * cfg.num_rounds <= 45 * 60,
        },
    }


def simulate(argv: list[str]) -> dict:
    """``corrflow simulate argv`` with the process CPU at the end of every round (see the module
    docstring)."""
    from corrflow.cli import main as cli_main

    ends: list[float] = []
    step = core.Run.step

    def timed_step(self, *a, **kw):
        out = step(self, *a, **kw)
        ends.append(time.process_time())
        return out

    core.Run.step = timed_step
    start = time.process_time()
    try:
        sys.argv = ["corrflow", "simulate", *argv]
        cli_main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    per_round = [b - a for a, b in zip([start, *ends], ends, strict=False)]
    early, late = per_round[1:9], per_round[-8:]
    return {
        "command": "corrflow simulate " + " ".join(argv),
        "exit_code": code,
        "rounds": len(per_round),
        "cpu_s_per_round": per_round,
        "rounds_2_9_mean": statistics.fmean(early),
        "last_8_mean": statistics.fmean(late),
        "last_over_first": statistics.fmean(late) / statistics.fmean(early),
        "cpu_s_total": time.process_time() - start,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _tree_cpu(root: int) -> float:
    """CPU seconds (user + system, and those of reaped children) of ``root`` and every process
    below it, read from /proc: Ray's GCS, raylet and workers are descendants of the driver."""
    parents, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(proc.name)] = int(fields[1])
        cpu[int(proc.name)] = sum(int(v) for v in fields[11:15]) / tick
    tree, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        tree += frontier
    return sum(cpu.get(p, 0.0) for p in tree)


def engines(argv: list[str]) -> dict:
    """Flower's Ray engine against the in-process grid on the same run (20,000 users,
    cohort 1,000, 20 rounds): each backend runs ``corrflow simulate`` as a child process, and every
    round's end (its progress line) is stamped with the wall clock and the CPU of the whole process
    tree (the driver, and for Ray its GCS, raylet and workers). Per round: the median over rounds
    2…R of each; the overhead is Ray's minus in-process's."""
    ap = argparse.ArgumentParser(prog="scale.py engines")
    ap.add_argument("--users", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument(
        "--identity",
        default="per-launch",
        help="the identity source (default per-launch: no setup probe of every node; on Ray the "
        "partition-id probe sends one message per user through the engine before round 1)",
    )
    args = ap.parse_args(argv)
    out = {
        "users": args.users,
        "rounds": args.rounds,
        "cohort": args.users // args.rounds,
        "identity": args.identity,
    }
    for backend in ("inprocess", "flower"):
        tmp = Path(tempfile.mkdtemp(prefix=f"corrflow-bench-engines-{backend}-"))
        cmd = [
            sys.executable, "-m", "corrflow.cli", "simulate", "--backend", backend,
            "--users", str(args.users), "--rounds", str(args.rounds), "--epochs", "1",
            "--noise-multiplier", str(args.noise_multiplier), "--out", str(tmp / "run"),
            "--identity", args.identity,
        ]  # fmt: skip
        env = {**os.environ, "CORRFLOW_HOME": str(tmp / "home")}
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        stamps, tail = [], []
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            if line.startswith("round ") and "/" in line.split()[1]:
                stamps.append((time.perf_counter() - t0, _tree_cpu(proc.pid)))
        code = proc.wait()
        wall = time.perf_counter() - t0
        shutil.rmtree(tmp, ignore_errors=True)
        if code != 0 or len(stamps) != args.rounds:
            raise SystemExit(f"{backend}: exit {code}, {len(stamps)} rounds\n{''.join(tail)}")
        walls = [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)]
        cpus = [b[1] - a[1] for a, b in zip(stamps, stamps[1:], strict=False)]
        out[backend] = {
            "wall_s_per_round_median": statistics.median(walls),
            "cpu_s_per_round_median": statistics.median(cpus),
            "until_round_1_wall_s": stamps[0][0],
            "until_round_1_cpu_s": stamps[0][1],
            "total_wall_s": wall,
        }
    ip, ray = out["inprocess"], out["flower"]
    out["ray_overhead_per_round"] = {
        "wall_s": ray["wall_s_per_round_median"] - ip["wall_s_per_round_median"],
        "cpu_s": ray["cpu_s_per_round_median"] - ip["cpu_s_per_round_median"],
        "wall_ratio": ray["wall_s_per_round_median"] / ip["wall_s_per_round_median"],
        "cpu_ratio": ray["cpu_s_per_round_median"] / ip["cpu_s_per_round_median"],
        "cpu_s_per_client": (ray["cpu_s_per_round_median"] - ip["cpu_s_per_round_median"])
        / out["cohort"],
    }
    return out


def sums(argv: list[str]) -> dict:
    """Per-reply process CPU of the run's exact clip-and-sum (`ExactSum`), the float32 one
    (`ClippedSum`) and a bare float32 sum, on the same full-weight replies of d parameters (half of
    them clipped), and the peak RSS."""
    ap = argparse.ArgumentParser(prog="scale.py sums")
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--replies", type=int, default=40)
    args = ap.parse_args(argv)
    d, rng = args.params, np.random.default_rng(0)
    sent = rng.standard_normal(d, dtype=np.float32)
    pool = [rng.standard_normal(d, dtype=np.float32) * s for s in (1e-4, 1e-3)]  # kept, clipped
    exact = ExactSum([(d,)], fixed_point_scale(342_477, 1.0))
    # untimed: the compiled passes load (or compile, the first time on a machine) at a first reply
    ExactSum([(8,)], exact.scale).add([np.ones(8, np.float32)], [np.zeros(8, np.float32)], 1.0, 0.0)
    clipped, bare = ClippedSum([(d,)]), np.zeros(d, np.float32)
    cpu = {"exact_sum": 0.0, "clipped_sum": 0.0, "bare_sum": 0.0}
    for i in range(args.replies):
        reply = sent + pool[i % 2]
        for name, add in (
            ("exact_sum", lambda r: exact.add([r], [sent], 1.0, 0.0)),
            ("clipped_sum", lambda r: clipped.add([r], [sent], 1.0, 0.0)),
            ("bare_sum", lambda r: bare.__iadd__(r)),
        ):
            t0 = time.process_time()
            add(reply)
            cpu[name] += time.process_time() - t0
    t0 = time.process_time()
    exact.total()
    to_float = time.process_time() - t0
    per = {k: v / args.replies for k, v in cpu.items()}
    return {
        "params": d,
        "replies": args.replies,
        "cpu_s_per_reply": per,
        "exact_total_to_float32_s": to_float,
        "exact_over_clipped": per["exact_sum"] / per["clipped_sum"],
        "clipped_over_bare": per["clipped_sum"] / per["bare_sum"],
        "exact_over_bare": per["exact_sum"] / per["bare_sum"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    if sys.argv[1:2] == ["sums"]:
        print(json.dumps(sums(sys.argv[2:]), indent=1))
        return
    if sys.argv[1:2] == ["simulate"]:
        result = simulate(sys.argv[2:])
        print(json.dumps(result, indent=1))
        return
    if sys.argv[1:2] == ["engines"]:
        print(json.dumps(engines(sys.argv[2:]), indent=1))
        return
    ap = argparse.ArgumentParser(
        description="Server CPU per round at StackOverflow's scale: 342,477 users, cohort 1,000, "
        "2,052 rounds, k = 6 at b = 342 (fixed-epoch or b-min-sep). Subcommands: `simulate ARGS…` "
        "(corrflow simulate with the CPU of every round) and `engines` (Flower's Ray engine "
        "against the in-process grid); see the module docstring.",
    )
    ap.add_argument(
        "--mode",
        choices=("fixed-epoch", "bminsep"),
        default="fixed-epoch",
        help="fixed-epoch groups, or the b-min-sep sampler at the same expected cohort (default "
        "%(default)s)",
    )
    ap.add_argument("--users", type=int, default=342_477, help="population (default %(default)s)")
    ap.add_argument(
        "--cohort",
        type=int,
        default=1000,
        help="clients per round (expected, for bminsep); b = users // cohort rounds between a "
        "user's turns (default %(default)s: b = 342)",
    )
    ap.add_argument(
        "--epochs", type=int, default=6, help="k, participations per user (default %(default)s)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="release only the first R of the b·k planned rounds (default: all); a run shorter "
        "than b has not seen the whole population",
    )
    ap.add_argument(
        "--params", type=int, default=100_000, help="d, model parameters (default %(default)s)"
    )
    ap.add_argument("--kind", default="toeplitz", help="factorization kind (default %(default)s)")
    ap.add_argument(
        "--noise-multiplier", type=float, default=1.0, help="σ, given (default %(default)s)"
    )
    ap.add_argument(
        "--rows",
        default=None,
        help="append each round's CPU split, bytes and peak RSS to this file as a JSON line",
    )
    ap.add_argument(
        "--reference-every",
        type=int,
        default=50,
        help="time the float32 clip-and-sum (ClippedSum) and a bare float32 sum of a cohort at the "
        "same d after round 1 and every N rounds (default %(default)s)",
    )
    ap.add_argument(
        "--accountant",
        default=None,
        help="the planned ε's accountant (default corrflow's: for bminsep the tightest verified "
        "bound, a Monte Carlo over the planned rounds; unamplified is the cheap worst-case bound)",
    )
    args = ap.parse_args()
    for name in ("users", "cohort", "epochs", "params", "reference_every"):
        if getattr(args, name) < 1:
            ap.error(
                f"--{name.replace('_', '-')}: expected a positive integer, "
                f"got {getattr(args, name)}"
            )
    if args.cohort > args.users:
        ap.error(f"--cohort: expected at most --users ({args.users}), got {args.cohort}")
    args.min_sep = args.users // args.cohort
    args.planned_rounds = args.min_sep * args.epochs
    if args.rounds is not None and not 1 <= args.rounds <= args.planned_rounds:
        ap.error(f"--rounds: expected 1…{args.planned_rounds} (b·k), got {args.rounds}")
    args.rounds = args.rounds or args.planned_rounds
    try:
        print(json.dumps(run(args), indent=1))
    except InvalidArgumentError as exc:
        ap.error(str(exc))


if __name__ == "__main__":
    main()
