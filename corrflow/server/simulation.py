"""Run a corrflow simulation: Flower's simulation engine (Ray; ``backend="flower"``) or the
in-process grid.

The first SIGINT or SIGTERM asks the server to stop: the round in flight is abandoned unreleased
(or, if it is being aggregated, finished), the checkpoint and the report are written, and
`RunInterruptedError` is raised so the CLI exits with 130. A second signal is ignored while
the server winds down (no traceback from Ray's threads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import warnings
from pathlib import Path

from corrflow.clients.secagg import secure_client_app, with_secure_aggregation
from corrflow.clients.tasks import task_for
from corrflow.config import RunConfig
from corrflow.data.federated import check_dataset, data_format, train_clients_count
from corrflow.errors import CorrflowError, DataFormatError, InvalidArgumentError, require
from corrflow.paths import run_directory
from corrflow.server.app import make_server_app, run_cohort_server, run_server
from corrflow.server.cohort_backend import check_supported
from corrflow.server.inprocess import InProcessGrid
from corrflow.server.noise_node_sim import check_noise_node, noise_node_grid, running_noise_node
from corrflow.server.tensorflow_guard import ray_workers_without_tensorflow, tensorflow_absent
from corrflow.strategies.correlated import INTERRUPTED

log = logging.getLogger("corrflow")


class RunInterruptedError(Exception):
    """The run stopped on an operator signal; its state and report are complete."""


class RunStoppedEarlyError(Exception):
    """The run stopped before its planned rounds (budget guard, no valid replies); ``report`` says
    why."""

    def __init__(self, report: dict):
        super().__init__(report.get("stopped_reason"))
        self.report = report


@contextlib.contextmanager
def stop_on_signals():
    """Yields an Event that the first SIGINT/SIGTERM sets (main thread only; elsewhere signals are
    untouched)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if not stop.is_set():
            log.warning(
                "%s received: finishing the current round's bookkeeping and stopping (state is "
                "kept)",
                signal.Signals(signum).name,
            )
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def quiet_native_logs() -> None:
    """TensorFlow's, gRPC's and Ray's start-up chatter off; effective for libraries not yet
    imported, and inherited by Ray's workers."""
    import os

    for var, value in (
        ("TF_CPP_MIN_LOG_LEVEL", "3"),
        ("GRPC_VERBOSITY", "ERROR"),
        ("RAY_DEDUP_LOGS", "1"),
    ):
        os.environ.setdefault(var, value)


@contextlib.contextmanager
def engine_output(log_path: Path, verbose: bool):
    """Unless ``verbose``: Flower's log lines go to ``log_path`` instead of the terminal, and
    TensorFlow's, gRPC's and Ray's start-up chatter is silenced, so that a run prints its own round
    lines and summary only."""
    if verbose:
        yield
        return
    quiet_native_logs()
    flwr_log = logging.getLogger("flwr")
    console = [
        h
        for h in flwr_log.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    to_file = logging.FileHandler(log_path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for h in console:
        flwr_log.removeHandler(h)
    flwr_log.addHandler(to_file)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # Ray's accelerator tip
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        flwr_log.removeHandler(to_file)
        to_file.close()
        for h in console:
            flwr_log.addHandler(h)


def check_backend(cfg: RunConfig, backend: str) -> None:
    """Refuse noise workers on Flower's simulation engine: the engine starts its own Ray instance
    in the server's process, which the workers would join instead of ``--ray-address``, sharing
    its resources with the simulated clients and outliving none of its faults.

    Raises:
        InvalidArgumentError (``noise-workers``): noise workers with ``backend`` "flower".
    """
    require(
        backend == "inprocess" or not cfg.noise_workers,
        "noise-workers",
        "0 with --backend flower (Flower's simulation engine runs its own Ray instance, which "
        "the noise workers would join instead of --ray-address); run --noise-workers N with "
        "--backend inprocess",
        cfg.noise_workers,
    )


def check_data_population(cfg: RunConfig, flag: str = "num-users") -> None:
    """A run on a dataset file trains at most the file's training partitions (StackOverflow train
    clients, arXiv training papers): more simulated users would ask for partitions that do not exist
    (every round would reject their replies and train on fewer users than planned), so it is
    refused, naming ``flag`` and the file's count. A file without training examples or a held-out
    split, or an empty vocabulary, is refused too (`corrflow.data.federated.check_dataset`)."""
    if not cfg.data_path:
        return
    check_dataset(cfg.data_path, cfg.vocab_path)
    if cfg.mode != "cross-device" or cfg.num_users is None:
        return

    count = train_clients_count(cfg.data_path)
    what = (
        "train clients"
        if data_format(cfg.data_path) == "stackoverflow-sqlite"
        else "training papers (arXiv: those without a held-out author)"
    )
    require(
        cfg.num_users <= count,
        flag,
        f"at most the {count} {what} of {cfg.data_path}",
        cfg.num_users,
    )


def simulate(
    cfg: RunConfig,
    backend: str = "flower",
    *,
    fresh: bool = False,
    noise_key: bytes | None = None,
    quiet: bool = False,
    verbose: bool = True,
) -> dict:
    """Run ``cfg`` in its run directory (``cfg.state_dir``) and return the final privacy report
    (also in ``privacy_report.json`` there). Raises `RunInterruptedError` after a signal and
    `RunStoppedEarlyError` when the run ended before its planned rounds. ``noise_key`` is for
    tests that compare runs bit for bit (the key of this start's rows: a resumed run's rows from its
    checkpoint on); a real run draws a fresh secret key on every start."""
    from corrflow.run.noise_shards import check_ray_address

    check_ray_address(cfg.ray_address)  # first: an unreachable head is refused in 10 s, not 100
    out = run_directory(cfg.state_dir)
    cfg = cfg.replace(state_dir=str(out))
    check_backend(cfg, backend)
    check_noise_node(cfg, backend)
    check_data_population(cfg)
    created = new_files_undo(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _simulate(
            cfg, out, backend, noise_key=noise_key, fresh=fresh, quiet=quiet, verbose=verbose
        )
    except (InvalidArgumentError, DataFormatError):
        created()  # a refusal leaves --out as it found it
        raise


def new_files_undo(out: Path):
    """A function that removes what a refused start wrote into ``out`` (its lock, .gitignore,
    engine.log and the factorization it built, a cache rebuilt on the next start; the directory
    itself if this start created it) — nothing once a round was checkpointed or journaled."""
    before = set(os.listdir(out)) if out.is_dir() else None

    def undo() -> None:
        if not out.is_dir() or any(
            (out / p).exists()
            for p in ("state/checkpoint.zip", "state/CURRENT", "release_journal.jsonl")
        ):
            return
        for name in set(os.listdir(out)) - (before or set()):
            path = out / name
            if name in (".gitignore", "engine.log", "factorization.npz") or name.startswith(
                ".corrflow.lock"
            ):
                path.unlink(missing_ok=True)
            elif path.is_dir() and not any(path.rglob("*")):
                path.rmdir()
        if before is None and not any(out.iterdir()):
            out.rmdir()

    return undo


#: Why a run stops when Flower's simulation engine fails under its running ServerApp.
ENGINE_FAILED = "Flower's simulation engine failed"

#: From this population on, a run on Flower's simulation engine is warned of its cost (below).
FLOWER_ENGINE_WARN_USERS = 5_000


def _simulate(cfg: RunConfig, out: Path, backend: str, **kwargs) -> dict:
    verbose = kwargs.pop("verbose")
    if backend == "flower" and cfg.num_users >= FLOWER_ENGINE_WARN_USERS:
        # flwr 1.41/1.42: vce_api.add_messages_to_queue asks InMemoryLinkState.get_message_ins for
        # every node in turn, and each call checks every stored message
        log.warning(
            "corrflow: Flower's simulation engine checks every pending message for every node on "
            "each delivery sweep, so its cost grows with population × cohort: at 20,000 users and "
            "cohort 1,000 about 53 CPU-s per round (0.6 s in process), and the identity probe "
            "before round 1 (one message per user) did not finish within node-timeout 600 s "
            "(docs/reference/benchmarks.md). --backend inprocess runs the same strategy and "
            "clients without it"
        )

    if backend == "cohort":
        check_supported(cfg)  # before anything is written
    task = task_for(cfg)
    handlers, client_app = task.handlers, task.client_app
    if cfg.secure_aggregation:  # the clients clip, quantize and mask (Flower's SecAgg+ mod)
        handlers = {"train": with_secure_aggregation(task.handlers["train"])}
        client_app = secure_client_app(task.handlers["train"])
    try:
        with stop_on_signals() as stop, engine_output(out / "engine.log", verbose):
            if backend == "cohort":
                run_cohort_server(cfg, stop_event=stop, **kwargs)
            elif backend == "inprocess" and cfg.noise_node:
                with running_noise_node(cfg) as node:
                    grid = noise_node_grid(cfg, task.handlers["train"], node)
                    kwargs["noise_key"] = node.link()  # the server's link; the key stays there
                    run_server(grid, cfg, stop_event=stop, **kwargs)
            elif backend == "inprocess":
                run_server(InProcessGrid(handlers, cfg.num_users), cfg, stop_event=stop, **kwargs)
            else:
                _run_flower_engine(cfg, stop, client_app, verbose, kwargs)
    except CorrflowError as exc:
        # a signal before round 1 (waiting for SuperNodes, probing identities) ends the start
        # with an error from deep inside: it is still the operator's interrupt (exit 130)
        if _interrupted(stop):
            raise RunInterruptedError(str(exc)) from exc
        raise
    report_path = out / "privacy_report.json"
    if not report_path.exists() and _interrupted(stop):
        raise RunInterruptedError(f"{INTERRUPTED} before round 1; nothing was trained")
    if not report_path.exists():
        raise RuntimeError(
            f"the simulation produced no privacy report in {out} (see the log above)"
        )
    report = json.loads(report_path.read_text())
    why = report.get("stopped_reason") or INTERRUPTED
    # a lost Ray head (noise workers) or a failed engine also sets the stop event, with its reason:
    # that stop is no interrupt, nor is a run the budget guard stopped before the signal came
    if (
        _interrupted(stop)
        and report["rounds_completed"] < cfg.num_rounds
        and why.startswith(INTERRUPTED)
    ):
        raise RunInterruptedError(why)
    if report["rounds_completed"] < cfg.num_rounds:
        raise RunStoppedEarlyError(report)
    return report


def _interrupted(stop: threading.Event) -> bool:
    """The stop event was set by a signal (an engine failure or a lost Ray head names its
    ``reason``)."""
    return stop.is_set() and not getattr(stop, "reason", None)


def _run_flower_engine(cfg: RunConfig, stop, client_app, verbose: bool, kwargs: dict) -> None:
    """Flower's simulation engine (Ray) running the ServerApp and ``client_app``; the engine and its
    workers import TensorFlow only for a Keras client (`corrflow.server.tensorflow_guard`)."""
    hide = cfg.client != "keras"
    with tensorflow_absent(hide):
        from flwr.simulation import run_simulation
    try:  # run_simulation is deprecated, but the only in-process engine of flwr 1.41/1.42
        with ray_workers_without_tensorflow(hide):
            run_simulation(
                server_app=make_server_app(cfg, stop_event=stop, **kwargs),
                client_app=client_app,
                num_supernodes=cfg.num_users,
                backend_config=_backend_config(cfg, verbose),
            )
    except RuntimeError as exc:
        # Ray's workers die with the terminal's SIGINT; the server did not
        if not stop.is_set():
            # The engine is gone, but the ServerApp's thread would wait node-timeout for replies
            # that cannot come (and the process for that thread): stop it, on the record.
            stop.reason = f"{ENGINE_FAILED} (its error is in engine.log)"
            stop.set()
            root = exc
            while root.__cause__ is not None:
                root = root.__cause__
            raise CorrflowError(
                f"{ENGINE_FAILED}: {type(root).__name__}: {root} (Flower's "
                f"traceback is in {cfg.state_dir}/engine.log); nothing of the round in flight was "
                "released, and a rerun resumes from the last checkpoint"
            ) from exc


def _backend_config(cfg: RunConfig, verbose: bool = True) -> dict:
    """One CPU per simulated client; with a GPU visible to TensorFlow, Keras clients share it (4 per
    GPU). Workers' output reaches the terminal only when ``verbose``."""
    gpus = 0.0
    if cfg.client == "keras":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            gpus = 0.25
    config = {
        "client_resources": {"num_cpus": 1, "num_gpus": gpus},
        "init_args": {
            "log_to_driver": verbose,
            "logging_level": logging.INFO if verbose else logging.ERROR,
        },
    }
    if gpus:
        config["init_args"]["num_gpus"] = 1
    return config
