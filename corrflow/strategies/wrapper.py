"""Correlated-noise DP for an existing Flower app, as one line around its strategy:

    strategy = DifferentialPrivacyCorrelatedNoise(FedAvg(...), clipping_norm=1.0, target_epsilon=8.0, delta=1e-5,
                                                  epochs=2, state_dir="/var/lib/corrflow/run")
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=20, train_config=ConfigRecord({"lr": 0.1}))

like Flower's ``DifferentialPrivacyServerSideFixedClipping(FedAvg(...), ...)``, but with the noise correlated across
rounds by a matrix factorization (DP-FTRL / BandMF) and the privacy accounted, checkpointed and journaled.

Inside ``start``: the population is the nodes present (``num_users`` of them, or at least the inner strategy's
``min_available_nodes``), the factorization is built (cached in ``state_dir``), σ calibrated, users resolved by the
declared ``identity``. Each round the inner strategy's ``configure_train`` runs only for its config (the user's
``train_config``, FedProx's ``proximal-mu``, …), which goes to corrflow's scheduled cohort; corrflow's
clip → sum → correlated noise → server optimizer replaces the inner parameter aggregation (equal weights: DP needs
them, so ``num-examples`` is ignored), and the inner metric aggregation and federated evaluation are kept.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import fields
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy

from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.progress import round_line
from corrflow.strategies.checkpoint import current_checkpoint
from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.identity import wait_for_nodes
from corrflow.strategies.session import RunHooks, run_strategy

log = logging.getLogger("corrflow")

# Strategies whose aggregation keeps its own optimizer state: corrflow's workload *is* the server optimizer (the
# factorization is built for it), so composing the two would change the mechanism the noise was calibrated for.
_STATEFUL = {"FedAdam", "FedYogi", "FedAdagrad", "FedAvgM", "FedOpt"}
SETTLE_SECONDS = 3.0


def ensure_console_log() -> None:
    """corrflow's round lines and summary reach the console in a user's app (Flower configures only its logger)."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("corrflow %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def check_composable(strategy: Strategy) -> None:
    """Refuse inner strategies whose aggregation is not plain (weighted) averaging, saying why."""
    name = type(strategy).__name__
    mro = {c.__name__ for c in type(strategy).__mro__}
    if mro & _STATEFUL:
        raise InvalidArgumentError("strategy", "a FedAvg-style strategy (FedAvg, FedProx, …): "
                                   f"{name} keeps server-optimizer state, but corrflow's server optimizer is the "
                                   "workload its noise is factorized for — set server_learning_rate/momentum on "
                                   "the wrapper instead", name)
    if not isinstance(strategy, FedAvg) or type(strategy).aggregate_train is not FedAvg.aggregate_train:
        raise InvalidArgumentError("strategy", "a strategy whose train aggregation is FedAvg's (corrflow replaces it "
                                   "with clip → sum → correlated noise; a robust or custom aggregation would be "
                                   "silently dropped)", name)


def check_inner_population(strategy: Strategy, users: int) -> None:
    """Federated evaluation stays the inner strategy's, and Flower's ``sample_nodes`` waits (logging only at INFO)
    until its ``min_available_nodes`` and ``min_evaluate_nodes`` are online: more than the run's population would
    stall the run after its first round, without a word. (Its train config is asked for on a padded grid.)"""
    if not getattr(strategy, "fraction_evaluate", 0.0):
        return
    for name in ("min_available_nodes", "min_evaluate_nodes"):
        value = int(getattr(strategy, name, 0) or 0)
        require(value <= users, name, f"at most the run's {users} users (Flower's node sampling for federated "
                "evaluation would wait for nodes the run does not have): lower it, set fraction_evaluate=0.0, "
                "or raise num_users", value)


class DifferentialPrivacyCorrelatedNoise(Strategy):
    """Wrap a FedAvg-style Message-API strategy with correlated-noise DP (see the module docstring).

    ``clipping_norm``: ℓ2 clip of each user's update; exactly one of ``target_epsilon`` (σ calibrated) and
    ``noise_multiplier``; ``delta``; ``epochs`` k and ``min_sep`` b (default rounds/epochs, fixed-epoch);
    ``kind``/``bands``: the factorization; ``participation``: fixed-epoch, bminsep or multi-attribution;
    ``identity``: node-key | user-id | partition-id | per-launch (default: partition-id in simulation, node-key in
    deployment); ``num_users``: the population to wait for (default: the nodes connected once the inner strategy's
    ``min_available_nodes`` are, or the checkpoint's population when resuming); ``state_dir``: the checkpoint
    directory, as the ServerApp's ``state-dir`` — ``release_journal.jsonl``, ``privacy_report.json``,
    ``metrics.json`` and the factorization go next to it, in its parent; ``replies``: "weights" (clients return
    full weights, as in Flower's quickstarts) or "delta"; ``server_learning_rate``, ``momentum``: the server
    optimizer (the workload the factorization is built for). Other keywords are :class:`StrategyConfig` fields.
    """

    def __init__(self, strategy: Strategy, *, clipping_norm: float, state_dir: str | Path,
                 delta: float | None = None, target_epsilon: float | None = None,
                 noise_multiplier: float | None = None, epochs: int | None = None, min_sep: int | None = None,
                 kind: str | None = None, bands: int | None = None, participation: str | None = None,
                 identity: str | None = None, num_users: int | None = None, replies: str = "weights",
                 server_learning_rate: float = 1.0, momentum: float | None = None, fresh: bool = False,
                 plan: str | Path | None = None, **settings):
        """``plan``: a recipe written by ``corrflow plan`` (recipe.json): it fixes the mechanism, participation,
        accountant, σ, δ and rounds; any of those given here that differ are refused, each named."""
        check_composable(strategy)
        known = {f.name for f in fields(StrategyConfig)}
        unknown = sorted(set(settings) - known)
        require(not unknown, "settings", f"StrategyConfig fields ({', '.join(sorted(known))})", unknown)
        self.inner = strategy
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.out_dir = self.state_dir.parent
        self.fresh = fresh
        self.num_users = num_users
        self.stop_event = threading.Event()
        self.core = None
        self.plan = None
        given = {k: v for k, v in dict(settings, delta=delta, target_epsilon=target_epsilon,
                                       noise_multiplier=noise_multiplier, epochs=epochs, min_sep=min_sep, kind=kind,
                                       bands=bands, participation=participation, momentum=momentum).items()
                 if v is not None}
        if plan is not None:
            from corrflow.planning.recipe import load_recipe

            recipe, fac_path = load_recipe(plan)
            diff = recipe.differences(given, {k: k for k in given})   # the keyword arguments as typed
            require(not diff, "plan", "settings that agree with the plan (or leave them out)", "; ".join(diff))
            self.plan = (recipe, fac_path)
            self.num_users = num_users or recipe.population
            given = recipe.strategy_settings()
        else:
            require(delta is not None, "delta", "δ (or a plan)")
            require((target_epsilon is None) != (noise_multiplier is None), "target_epsilon",
                    "exactly one of target_epsilon and noise_multiplier")
        require(math.isfinite(server_learning_rate) and server_learning_rate > 0, "server_learning_rate",
                "a finite learning rate > 0", server_learning_rate)
        self._settings = dict(settings, clip_norm=float(clipping_norm), delta=float(given["delta"]),
                              target_epsilon=float(given.get("target_epsilon") or 0.0),
                              noise_multiplier=float(given.get("noise_multiplier") or 0.0),
                              epochs=int(given.get("epochs") or 1), min_sep=int(given.get("min_sep") or 0),
                              kind=given.get("kind") or "toeplitz", bands=int(given.get("bands") or 0),
                              participation=given.get("participation") or "fixed-epoch",
                              identity=identity or "", replies=replies, server_lr=float(server_learning_rate),
                              momentum=float(given.get("momentum") or 0.0), state_dir=str(self.state_dir))
        for key in ("participation_rate", "accountant", "cooldown_fraction"):
            if key in given:
                self._settings[key] = given[key]
        rounds = self.plan[0].rounds if self.plan else max(1, self._settings["epochs"])
        self.config(num_rounds=rounds, num_users=max(1, self.num_users or 1))   # fail fast on bad settings

    def config(self, *, num_rounds: int, num_users: int) -> StrategyConfig:
        if self.plan is not None:
            require(num_rounds == self.plan[0].rounds, "num_rounds", f"the plan's {self.plan[0].rounds} rounds",
                    num_rounds)
        return StrategyConfig(**{**self._settings, "num_rounds": num_rounds, "num_users": num_users})

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn=None) -> Result:
        """Train ``num_rounds`` rounds (resuming from ``state_dir`` when it holds a checkpoint of this run). Logs a
        line per round and the realised ε on the ``corrflow`` logger; the full report is :meth:`privacy_report`."""
        ensure_console_log()
        cfg = self.config(num_rounds=num_rounds, num_users=self._population(grid, timeout))
        cfg = StrategyConfig(**{**cfg.to_dict(), "node_timeout": float(timeout)})
        check_inner_population(self.inner, cfg.num_users)
        if self.plan is not None:
            from corrflow.planning.recipe import install_factorization

            install_factorization(*self.plan, cfg.to_dict(), self.out_dir,
                                  replace=self.fresh or not (Path(cfg.state_dir) / "CURRENT").exists())
        hooks = RunHooks(initial_arrays, inner=self.inner, train_config=train_config,
                         evaluate_config=evaluate_config, evaluate_fn=evaluate_fn,
                         on_round_end=lambda core, metrics: log.info(round_line(metrics, num_rounds)))
        self.core, result = run_strategy(grid, cfg, self.out_dir, hooks, fresh=self.fresh, stop_event=self.stop_event)
        report = self.privacy_report()
        log.info("corrflow: %d of %d rounds, realised ε = %s (δ = %g)%s; report %s", report["rounds_completed"],
                 num_rounds, report["realized"]["epsilon"], report["delta"],
                 f"; stopped: {report['stopped_reason']}" if report.get("stopped_reason") else "", self.report_path)
        return result

    def _population(self, grid: Grid, timeout: float) -> int:
        """``num_users``, or the resumed run's, or the nodes connected once ``min_available_nodes`` are and no
        more arrive for a few seconds (nodes register one by one)."""
        if self.num_users is not None:
            return self.num_users
        try:
            ckpt = current_checkpoint(self.state_dir)
        except IntegrityError:
            ckpt = None   # the run itself refuses, naming the file
        if ckpt is not None:
            return int(json.loads((ckpt / "state.json").read_text())["settings"]["num_users"])
        count = len(wait_for_nodes(grid, getattr(self.inner, "min_available_nodes", 1), timeout))
        stable_since = time.monotonic()
        while time.monotonic() - stable_since < SETTLE_SECONDS:
            time.sleep(0.2)
            if (now := len(list(grid.get_node_ids()))) != count:
                count, stable_since = now, time.monotonic()
        log.info("corrflow: the population is the %d SuperNodes connected", count)
        return count

    def privacy_report(self) -> dict:
        """The run's privacy report (``privacy_report.json``), as written after every round."""
        return json.loads(self.report_path.read_text())

    # The Strategy API: corrflow drives its own rounds in start(); these delegate to the running core.
    def _running(self):
        if self.core is None:
            raise RuntimeError("DifferentialPrivacyCorrelatedNoise runs its rounds in start()")
        return self.core

    def configure_train(self, server_round, arrays, config, grid):
        return self._running().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        return self._running().aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log.info("DifferentialPrivacyCorrelatedNoise around %s: %s, clipping norm %g, δ = %g",
                 type(self.inner).__name__, self._settings["kind"], self._settings["clip_norm"],
                 self._settings["delta"])

    @property
    def report_path(self) -> Path:
        return self.out_dir / "privacy_report.json"
