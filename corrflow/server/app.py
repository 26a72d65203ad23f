"""The corrflow ServerApp: lock the output directory, check it against the release journal, resolve
stable user ids, build (or reuse) the factorization, calibrate σ, run the correlated-noise strategy,
and write ``privacy_report.json`` and ``metrics.json``.

``app`` reads Flower's run config (``flwr run``); `make_server_app` binds a config for
in-process simulation.
"""

from __future__ import annotations

import logging
import sys
import threading

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

# The ClientApp modules are imported with the ServerApp, not on first use in main(): Flower's
# simulation loads the ClientApp in another thread, under its app-loading lock, and takes a module
# already in sys.modules as it is, so a lazy import running at that moment handed it a
# half-initialised module ("partially initialized module 'corrflow.clients.numpy_client' has no
# attribute 'app'") and `flwr run` failed at random.
from corrflow.clients import dispatch, keras_client, nextword_client, numpy_client  # noqa: F401
from corrflow.clients.tasks import task_for
from corrflow.config import PREFIX, RunConfig, from_run_config, unprefixed_keys
from corrflow.errors import InvalidArgumentError
from corrflow.paths import run_directory
from corrflow.progress import round_line
from corrflow.run.evaluation import ScheduledEvaluation
from corrflow.server.noise_node_deploy import deployed_noise_node
from corrflow.strategies.correlated import CorrelatedNoiseStrategy
from corrflow.strategies.session import RunSpec, run_strategy

log = logging.getLogger("corrflow")


def run_server(
    grid: Grid,
    cfg: RunConfig,
    *,
    noise_key: bytes | None = None,
    quiet: bool = False,
    on_round_end=None,
    fresh: bool = False,
    stop_event: threading.Event | None = None,
    relative_to: str = "cwd",
) -> CorrelatedNoiseStrategy:
    """Train corrflow's own task (``cfg.client``) in the run directory ``cfg.state_dir`` (a relative
    one resolved per ``relative_to``, see `corrflow.paths.run_directory`) with one line per
    round on stderr; see `run_strategy`."""
    cfg = cfg.replace(state_dir=str(run_directory(cfg.state_dir, relative_to)))
    task = task_for(cfg)

    def round_end(strategy, metrics):
        if not quiet:
            print(round_line(metrics, cfg.num_rounds), file=sys.stderr, flush=True)
        if on_round_end is not None:
            on_round_end(strategy, metrics)

    spec = RunSpec(
        cfg,
        task.initial_weights(),
        evaluate=ScheduledEvaluation(task.evaluate, cfg.eval_every, cfg.num_rounds),
        on_round_end=round_end,
        fresh=fresh,
        noise_key=noise_key,
        stop_event=stop_event,
    )
    strategy, _ = run_strategy(grid, spec)
    return strategy


def run_cohort_server(
    cfg: RunConfig,
    *,
    noise_key: bytes | None = None,
    quiet: bool = False,
    fresh: bool = False,
    stop_event: threading.Event | None = None,
    on_round_end=None,
    **kwargs,
):
    """`run_server` on the cohort engine (`corrflow.server.cohort_backend`): the same run, one
    line per round on stderr, with a round's clients trained together in process. ``kwargs``:
    `corrflow.server.cohort_backend.run_cohort`'s ``on_start`` and ``canaries``."""
    from corrflow.server.cohort_backend import run_cohort

    def round_end(metrics):
        if not quiet:
            print(round_line(metrics, cfg.num_rounds), file=sys.stderr, flush=True)
        if on_round_end is not None:
            on_round_end(metrics)

    return run_cohort(
        cfg.replace(state_dir=str(run_directory(cfg.state_dir))),
        noise_key=noise_key,
        fresh=fresh,
        stop_event=stop_event,
        on_round_end=round_end,
        **kwargs,
    )


def make_server_app(cfg: RunConfig, **kwargs) -> ServerApp:
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        run_server(grid, cfg, **kwargs)

    return server


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    # Flower forwards the ServerApp's stderr to `flwr log`: corrflow's messages belong there
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    run_config = dict(context.run_config)
    for key in unprefixed_keys(run_config):
        log.warning("run-config key %r is left to your app; corrflow reads %s%s", key, PREFIX, key)
    try:
        cfg = from_run_config(run_config)
        grid, link = deployed_noise_node(cfg, grid)  # the noise node is no user
    except InvalidArgumentError as exc:
        log.error("bad run config: %s", exc)
        raise
    # `flwr run` starts the ServerApp in the SuperLink's directory: a relative state-dir lives under
    # $CORRFLOW_HOME.
    outcome_failure(run_server(grid, cfg, relative_to="home", noise_key=link))


class RunOutcomeError(RuntimeError):
    """A deployed run that stopped before its planned rounds or did not learn: raised from the
    ServerApp so that Flower marks the run failed (``flwr ls`` shows ``finished:failed``) — the
    deployment's exit code, as `corrflow simulate` exits 1 or 3. Everything released is already
    checkpointed and reported."""


def outcome_failure(strategy: CorrelatedNoiseStrategy) -> None:
    """Raise `RunOutcomeError` naming why when the run stopped early or did not learn."""
    learning = strategy.run.learning()
    if strategy.stopped_reason is not None:
        why = f"stopped before its planned rounds: {strategy.stopped_reason}"
    elif learning["learned"] is False:
        why = learning["verdict"]
    else:
        return
    log.error("corrflow: the run %s (privacy_report.json has the details)", why)
    raise RunOutcomeError(f"corrflow: the run {why}")
