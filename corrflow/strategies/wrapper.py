"""Correlated-noise DP for an existing Flower app, as one line around its strategy:

    strategy = DifferentialPrivacyCorrelatedNoise(FedAvg(...), clipping_norm=1.0,
    target_epsilon=8.0, delta=1e-5, epochs=2, state_dir="corrflow_state") result =
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=20, train_config=ConfigRecord({"lr":
    0.1}))

like Flower's ``DifferentialPrivacyServerSideFixedClipping(FedAvg(...), ...)``, but with the noise
correlated across rounds by a matrix factorization (DP-FTRL / BandMF) and the privacy accounted,
checkpointed and journaled.

``start`` behaves as Flower's ``Strategy.start``: ``num_rounds`` is the run's total (a resumed run
trains the rest), ``initial_arrays`` the model a new run starts from (a resumed run refuses other
arrays), ``evaluate_fn`` is called for the starting model and after every round. Everything the run
writes goes inside ``state_dir`` (relative: to the working directory): lock, checkpoints
(``state/``), release journal, privacy report, metrics, factorization.

Inside ``start``: the population is the nodes present (``num_users`` of them, or at least the inner
strategy's ``min_available_nodes``), the factorization is built (cached in ``state_dir``), σ
calibrated, users resolved by the declared ``identity``. Each round the inner strategy's
``configure_train`` runs only for its config (the user's ``train_config``, FedProx's
``proximal-mu``, …), which goes to corrflow's scheduled cohort; corrflow's clip → sum → correlated
noise → server optimizer replaces the inner parameter aggregation (equal weights: DP needs them, so
``num-examples`` is ignored), and the inner metric aggregation and federated evaluation are kept.
Their results are logged as Flower logs them (``Aggregated MetricRecord``), on the console for runs
whose schedule is public and on the operator log only for amplified runs, and the report lists them
under ``outside_guarantee``; ``evaluate_fn``'s results are logged as Flower does in every run, and
its loss is the held-out loss of ``metrics.json`` and the report's learning verdict
(`corrflow.strategies.app_metrics`).
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy

from corrflow.config import (
    RunConfig,
    help_text,
    settings_on,
    surface_default,
    surface_name,
    validated,
)
from corrflow.config import from_wrapper_keywords as _from_keywords
from corrflow.errors import CorrflowError, InvalidArgumentError, require
from corrflow.fileio import write_json
from corrflow.paths import run_directory
from corrflow.planning.recipe import install_factorization, load_recipe
from corrflow.progress import round_line
from corrflow.run.checkpoint import has_checkpoint
from corrflow.strategies.canaries import (
    MIN_CANARIES,
    CanaryGrid,
    CanaryPlan,
    RoundCapture,
    analyse,
    write_plot,
)
from corrflow.strategies.correlated import CorrelatedNoiseStrategy
from corrflow.strategies.identity import default_identity
from corrflow.strategies.session import RunSpec, run_strategy

log = logging.getLogger("corrflow")

# Strategies whose aggregation keeps its own optimizer state: corrflow's workload *is* the server
# optimizer (the factorization is built for it), so composing the two would change the mechanism the
# noise was calibrated for.
_STATEFUL = {"FedAdam", "FedYogi", "FedAdagrad", "FedAvgM", "FedOpt"}
#: partition-id of the first canary SuperNode (``canaries=N``): far above any simulation's real
# partitions.
CANARY_PARTITIONS = 1_000_000_000


def _same_doc(source: Callable) -> Callable:
    """Give the decorated method ``source``'s docstring (one text for a method the wrapper only
    forwards)."""

    def copy(method: Callable) -> Callable:
        method.__doc__ = source.__doc__
        return method

    return copy


def ensure_console_log() -> None:
    """corrflow's round lines and summary reach the console in a user's app (corrflow configures its
    own logger only, and only when neither it nor the root logger has a handler)."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("corrflow %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def check_composable(strategy: Strategy) -> None:
    """Refuse inner strategies whose aggregation is not plain (weighted) averaging, saying why."""
    name = type(strategy).__name__
    if {c.__name__ for c in type(strategy).__mro__} & _STATEFUL:
        raise InvalidArgumentError(
            "strategy",
            "a FedAvg-style strategy (FedAvg, FedProx, …): "
            f"{name} keeps server-optimizer state, but corrflow's server optimizer is the "
            "workload its noise is factorized for — set server_learning_rate/momentum on "
            "the wrapper instead",
            name,
        )
    if (
        not isinstance(strategy, FedAvg)
        or type(strategy).aggregate_train is not FedAvg.aggregate_train
    ):
        raise InvalidArgumentError(
            "strategy",
            "a strategy whose train aggregation is FedAvg's (corrflow replaces it "
            "with clip → sum → correlated noise; a robust or custom aggregation would be "
            "silently dropped)",
            name,
        )


def check_inner_population(strategy: Strategy, users: int) -> None:
    """Federated evaluation stays the inner strategy's, and Flower's ``sample_nodes`` waits (logging
    only at INFO) until its ``min_available_nodes`` and ``min_evaluate_nodes`` are online: more than
    the run's population would stall the run after its first round, without a word. (Its train
    config is asked for on a padded grid.)"""
    if not getattr(strategy, "fraction_evaluate", 0.0):
        return
    for name in ("min_available_nodes", "min_evaluate_nodes"):
        value = int(getattr(strategy, name, 0) or 0)
        require(
            value <= users,
            name,
            f"at most the run's {users} users (Flower's node sampling for federated evaluation "
            "would wait for nodes the run does not have): lower it, set fraction_evaluate=0.0, or "
            "raise num_users",
            value,
        )


def check_secure_evaluation(strategy: Strategy, secure: bool) -> None:
    """Under secure aggregation, refuse an inner strategy that evaluates on clients: Flower's
    ``secaggplus_mod`` acts on train messages only, so each sampled client's evaluation loss and
    accuracy would reach the server one by one, in the clear. (Summing them securely would take a
    second four-stage SecAgg+ protocol per round for numbers the server-side ``evaluate_fn`` gives
    without any client data.)"""
    fraction = float(getattr(strategy, "fraction_evaluate", 0.0) or 0.0)
    require(
        not secure or fraction == 0.0,
        "fraction_evaluate",
        "0.0 with secure_aggregation=True (federated evaluation would send each client's metrics "
        "to the server in the clear; evaluate on the server with evaluate_fn instead)",
        fraction,
    )


class DifferentialPrivacyCorrelatedNoise(Strategy):
    """Wrap a FedAvg-style Message-API strategy with correlated-noise DP (see the module docstring).

    Each round the sum of the cohort's clipped updates gets σ·clip·(C⁻¹Z)_t, the noise of a matrix
    factorization A = B·C of the server optimizer's workload (Choquette-Choo et al., arXiv
    2211.06530; McKenna, arXiv 2405.15913), and the run's ε is accounted, checkpointed and
    journaled.

    Args:
        strategy: the inner strategy: FedAvg or a subclass whose train aggregation is FedAvg's
            (FedProx, …); strategies with their own server-optimizer state (FedAdam, FedYogi,
            FedAdagrad, FedAvgM) or a robust aggregation are refused, saying why.
        plan: a recipe written by ``corrflow plan`` (``OUT/recipe.json``): its mechanism,
            participation, accountant and σ; settings given here that differ are refused, each
            named.
        fresh: move an earlier run in ``state_dir`` aside (``previous-runs/``) and start anew.
        canaries: simulation only, an empirical privacy audit (``corrflow audit``'s): that many
            candidate canary SuperNodes, about half inserted by coin flips; after the run `audit`
            (also ``audit.json`` and ``audit.png`` in ``state_dir``) holds the claimed ε, the
            estimate ε̂ and the 95% lower bound ε_lo.
        audit_seed: seeds the canaries' directions and coins (default: fresh).
        settings: corrflow's run settings as the wrapper names them (the signature lists each with
            its default; the run-config reference of the docs has them all), e.g. ``clipping_norm``,
            ``target_epsilon``, ``delta``, ``epochs``, ``kind``, ``state_dir``.

    Raises:
        InvalidArgumentError: an inner strategy that cannot be composed, an unknown keyword or an
            invalid value (naming the keyword and what was expected), or a plan that differs.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        plan: str | Path | None = None,
        fresh: bool = False,
        canaries: int = 0,
        audit_seed: int | None = None,
        **settings: Any,
    ):
        check_composable(strategy)
        self.inner, self.fresh = strategy, fresh
        require(
            isinstance(canaries, int)
            and not isinstance(canaries, bool)
            and (canaries == 0 or canaries >= MIN_CANARIES),
            "canaries",
            f"0 (no audit) or at least {MIN_CANARIES} candidate canaries",
            canaries,
        )
        self.canaries, self.audit_seed = canaries, audit_seed
        check_secure_evaluation(strategy, bool(settings.get("secure_aggregation")))
        self._audits: list[dict] = []  # one per start() with canaries
        self._values = _from_keywords(settings, client="app")
        require(
            not (canaries and self._values.get("secure_aggregation")),
            "canaries",
            "0 with secure_aggregation=True (canaries answer in the clear; audit the run without "
            "it: the mechanism, σ and ε are the same)",
            canaries,
        )
        self.plan = None
        if plan is not None:
            recipe, fac_path = load_recipe(plan)
            diff = recipe.differences(
                self._values, {f: surface_name(f, "wrapper") for f in self._values}
            )
            require(
                not diff,
                "plan",
                "settings that agree with the plan (or leave them out)",
                "; ".join(diff),
            )
            self.plan = (recipe, fac_path)
            self._values = {
                "num_users": recipe.population,
                **self._values,
                **recipe.strategy_settings(),
            }
        self.core = None
        self.stop_event = threading.Event()
        self.run_dir = run_directory(
            self._values.get("state_dir", surface_default("state_dir", "wrapper"))
        )
        self._settings()  # fail fast on bad settings

    def config(self, num_rounds: int | None = None) -> RunConfig:
        """The run's validated settings.

        Args:
            num_rounds: the run's total rounds (the plan's when a plan fixes them).

        Returns:
            The `corrflow.config.RunConfig` the run will use.
        """
        if self.plan is not None:
            require(
                num_rounds in (None, self.plan[0].rounds),
                "num_rounds",
                f"the plan's {self.plan[0].rounds} rounds",
                num_rounds,
            )
            num_rounds = self.plan[0].rounds
        values = {**self._values, "state_dir": str(self.run_dir)}
        if num_rounds is not None:
            values["num_rounds"] = num_rounds
        return validated(values, "wrapper")

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Train until ``num_rounds`` rounds in total are released, resuming from ``state_dir`` when
        it holds a checkpoint of this run. Logs a line per round and the realised ε on the
        ``corrflow`` logger; the full report is `privacy_report`. Arguments and result are
        `CorrelatedNoiseStrategy.start`'s (its text follows at run time).

        Raises:
            InvalidArgumentError: bad settings, other initial arrays than the run's, or an inner
                strategy asking for more nodes than the population.
            CorrflowError: the run cannot start or continue safely (another server on ``state_dir``,
                state that disagrees with its journal, a node without the declared identity).
        """
        ensure_console_log()
        cfg = self.config(num_rounds)
        if timeout is not None:
            cfg = validated({**cfg.to_dict(), "node_timeout": float(timeout)}, "wrapper")
        check_secure_evaluation(self.inner, cfg.secure_aggregation)
        if cfg.num_users is not None:
            check_inner_population(self.inner, cfg.num_users)
        if self.plan is not None:
            install_factorization(
                *self.plan, cfg, replace=self.fresh or not has_checkpoint(cfg.checkpoint_dir)
            )
        auditing = self._audit_grid(grid, cfg, initial_arrays) if self.canaries else None
        if auditing is not None:
            grid, capture = auditing
            users = None if cfg.num_users is None else cfg.num_users + len(grid.canary_nodes)
            cfg = validated(
                {**cfg.to_dict(), "num_users": users, "identity": "partition-id"}, "wrapper"
            )

        def round_end(core, metrics):
            log.info(round_line(metrics, cfg.num_rounds))
            if auditing is not None:
                capture(core, metrics)

        spec = RunSpec(
            cfg,
            initial_arrays,
            inner=self.inner,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            on_round_end=round_end,
            min_nodes=max(1, int(getattr(self.inner, "min_available_nodes", 1) or 1)),
            fresh=self.fresh,
            stop_event=self.stop_event,
            population_check=lambda n: check_inner_population(self.inner, n),
        )
        self.core, result = run_strategy(grid, spec)
        report = self.privacy_report()
        if auditing is not None:
            self._audits.append(self._finish_audit(report, grid, capture))
        log.info(
            "corrflow: %d of %d rounds, realised ε = %s (δ = %g)%s; report %s",
            report["rounds_completed"],
            cfg.num_rounds,
            report["realized"]["epsilon"],
            report["delta"],
            f"; stopped: {report['stopped_reason']}" if report.get("stopped_reason") else "",
            self.report_path,
        )
        return result

    def _audit_grid(self, grid: Grid, cfg: RunConfig, initial_arrays: ArrayRecord):
        """The grid with one virtual canary SuperNode per inserted canary (simulation only), and the
        capture of the released models (corrflow.strategies.canaries)."""
        require(
            default_identity(grid) == "partition-id" and cfg.identity in (None, "partition-id"),
            "canaries",
            "a simulation (Flower's simulation engine or corrflow's in-process grid, identity "
            "partition-id): canaries are simulated SuperNodes and cannot join a deployment of "
            "real devices",
            self.canaries,
        )
        require(
            cfg.mode == "cross-device",
            "canaries",
            "cross-device mode (a canary is a SuperNode)",
            cfg.mode,
        )
        plan = CanaryPlan.draw(
            self.canaries, secrets.randbits(32) if self.audit_seed is None else self.audit_seed
        )
        arrays = [
            a for a in initial_arrays.to_numpy_ndarrays() if np.issubdtype(a.dtype, np.floating)
        ]
        initial = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
        canary_grid = CanaryGrid(
            grid, plan, float(cfg.clip_norm), cfg.reply_kind, CANARY_PARTITIONS
        )
        return canary_grid, RoundCapture([initial], [])

    def _finish_audit(self, report: dict, grid, capture) -> dict:
        """The audit of the run just finished (``audit.json`` and ``audit.png`` in the run
        directory)."""
        core = self.core
        inserted = len(grid.canary_nodes)
        result = analyse(
            report,
            core,
            capture,
            grid.plan,
            grid.canary_users(),
            core.cfg.num_users - inserted,
            core.cfg,
        )
        result["plot"] = str(write_plot(result, capture.scores, self.run_dir / "audit.png"))
        write_json(self.run_dir / "audit.json", result, sort_keys=True)
        log.info(
            "corrflow audit: claimed ε = %s, estimate ε̂ = %.4g, 95%% lower bound ε_lo = %.4g "
            "with %d canaries: %s",
            report["realized"]["epsilon"],
            result["epsilon_estimate"],
            result["epsilon_lower"],
            self.canaries,
            result["verdict"],
        )
        return result

    @property
    def audit(self) -> dict | None:
        """The last run's audit with ``canaries`` (``audit.json``): claimed ε, estimate ε̂, lower
        bound ε_lo, the statistics; None before one ran."""
        return self._audits[-1] if self._audits else None

    def privacy_report(self) -> dict:
        """The run's privacy report, as written after every round.

        Returns:
            The parsed ``privacy_report.json`` (schema: ``corrflow schema privacy-report``).
        """
        return json.loads(self.report_path.read_text())

    @property
    def report_path(self) -> Path:
        return self.run_dir / "privacy_report.json"

    @property
    def out_dir(self) -> Path:
        return self.run_dir

    # The Strategy API: corrflow plans the noise for the run's total rounds, so rounds run inside
    # start().
    def _running(self):
        if self.core is None:
            raise CorrflowError(
                "DifferentialPrivacyCorrelatedNoise factorizes its noise for the run's total "
                "number of rounds: drive it with start(grid, initial_arrays, num_rounds=N), as "
                "Flower's strategies are driven"
            )
        return self.core

    # The Strategy API's methods below have one docstring each, the running strategy's
    # (`_same_doc` copies it): the wrapper only forwards them.
    @_same_doc(CorrelatedNoiseStrategy.configure_train)
    def configure_train(self, server_round, arrays, config, grid):
        return self._running().configure_train(server_round, arrays, config, grid)

    @_same_doc(CorrelatedNoiseStrategy.aggregate_train)
    def aggregate_train(self, server_round, replies):
        return self._running().aggregate_train(server_round, replies)

    @_same_doc(CorrelatedNoiseStrategy.configure_evaluate)
    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    @_same_doc(CorrelatedNoiseStrategy.aggregate_evaluate)
    def aggregate_evaluate(self, server_round, replies):
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the wrapper's mechanism and settings (Flower calls it when a run starts): the running
        run's, or — before `start` — the settings with any number of rounds they fit."""
        cfg = self._settings()
        log.info(
            "DifferentialPrivacyCorrelatedNoise around %s: %s, %s, clipping norm %g, δ = %g%s",
            type(self.inner).__name__,
            cfg.kind,
            f"{cfg.epochs} epoch(s)" + (f", min-sep {cfg.min_sep}" if cfg.min_sep else ""),
            cfg.clip_norm,
            cfg.delta,
            f", {cfg.num_rounds} rounds" if self.core is not None or self.plan else "",
        )

    def _settings(self) -> RunConfig:
        """The validated settings: the running run's, else the plan's, else with epochs × min-sep
        rounds — a number every valid setting fits (``start(num_rounds=…)`` picks the real one)."""
        if self.core is not None:
            return self.core.cfg
        epochs = int(self._values.get("epochs", 1))
        min_sep = int(self._values.get("min_sep", 0) or 1)
        return self.config(None if self.plan else epochs * min_sep)


def _signature() -> inspect.Signature:
    """The wrapper's keywords as generated from the settings model (what ``help()`` and IDEs
    show)."""
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("strategy", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Strategy),
    ]
    for name, info in settings_on("wrapper").items():
        default = surface_default(name, "wrapper")
        params.append(
            inspect.Parameter(
                surface_name(name, "wrapper"),
                inspect.Parameter.KEYWORD_ONLY,
                default=getattr(default, "value", default),
                annotation=info.annotation,
            )
        )
    params += [
        inspect.Parameter(
            "plan", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=str | Path | None
        ),
        inspect.Parameter("fresh", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool),
        inspect.Parameter("canaries", inspect.Parameter.KEYWORD_ONLY, default=0, annotation=int),
        inspect.Parameter(
            "audit_seed", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=int | None
        ),
    ]
    return inspect.Signature(params)


DifferentialPrivacyCorrelatedNoise.__init__.__signature__ = _signature()
DifferentialPrivacyCorrelatedNoise.__init__.__doc__ = "Keywords:\n" + "\n".join(
    f"    {surface_name(n, 'wrapper')}: {help_text(n)}" for n in settings_on("wrapper")
)

# The start's arguments and result are documented once, on the strategy's start.
DifferentialPrivacyCorrelatedNoise.start.__doc__ += (
    "\n" + CorrelatedNoiseStrategy.start.__doc__.split("\n\n", 1)[1]
)
