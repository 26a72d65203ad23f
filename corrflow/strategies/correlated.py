"""The correlated-noise Flower strategy (Message API; flwr 1.41/1.42): a thin shell over the
Flower-free `corrflow.run.Run`.

``configure_train`` asks the run for round t's plan (`plan_next`: the cohort
planner, the separation policy, operator overrides, the budget guard), routes it to the nodes online
and sends the training messages. ``aggregate_train`` converts the replies to
`Reply` values and hands them to `step` (clip → sum →
correlated noise → server optimizer → checkpoint → release journal → report → metrics, before the
model leaves the server), the one place where the run's state changes.

A round interrupted (SIGINT/SIGTERM) while replies are awaited is abandoned: nothing of it is
committed or released, and a restart redoes it. The run stops — on the record, in ``stopped_reason``
— at the budget guard, on an operator interrupt, or after ``max_empty_rounds`` consecutive rounds
without an accepted reply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from corrflow.errors import InvalidArgumentError, require
from corrflow.run import Run
from corrflow.run.round import Reply, RoundPlan
from corrflow.strategies.app_metrics import AppMetrics, ServerEvaluation
from corrflow.strategies.messaging import (
    NodeDirectory,
    ReplyStream,
    RoundAbandonedError,
    exchange,
    inner_train_config,
    model_record,
    model_sha256,
    pull_batch,
    to_reply,
    train_messages,
)
from corrflow.strategies.secagg import secure_train

log = logging.getLogger("corrflow")

INTERRUPTED = "interrupted by the operator (SIGINT/SIGTERM)"


class InFlight:
    """The round between ``configure_train`` and ``aggregate_train`` (Flower's two calls), never
    persisted: its plan and the messages sent (whose ids the grid fills in when it pushes them)."""

    def __init__(self):
        self._round: tuple[RoundPlan, list[Message]] | None = None

    def put(self, plan: RoundPlan | None, messages: list[Message] = ()) -> None:
        self._round = None if plan is None else (plan, list(messages))

    def take(self) -> tuple[RoundPlan | None, dict[str, int]]:
        """The plan and message id → destination node of what was sent."""
        held, self._round = self._round, None
        if held is None:
            return None, {}
        plan, messages = held
        return plan, {
            m.metadata.message_id: int(m.metadata.dst_node_id)
            for m in messages
            if m.metadata.message_id
        }


class CorrelatedNoiseStrategy(Strategy):
    """DP-FTRL / matrix-factorization training with correlated noise (see the module docstring).
    Built by `corrflow.strategies.session.prepare_run` over a `Run`, who
    is behind each node (``directory``), the user's inner strategy, the event that stops it, and
    the app's ``evaluate_fn`` when it is the run's server-side evaluation; the run's state is read
    through the properties (read-only views)."""

    def __init__(
        self,
        run: Run,
        directory: NodeDirectory,
        inner: Strategy | None = None,
        stop_event: threading.Event | None = None,
        server_evaluation: ServerEvaluation | None = None,
    ):
        self.run, self.directory, self.inner = run, directory, inner
        self.stop_event = stop_event or threading.Event()
        #: a Flower app's ``evaluate_fn`` as the run's server-side evaluation (its results are
        # shown as Flower shows them, and returned in ``Result``)
        self.server_evaluation = server_evaluation
        self.inflight = InFlight()
        self._said: set[str] = set()  # one-time warnings

    # -- read-only views of the run ----------------------------------------------------------------
    cfg = property(lambda self: self.run.plan.cfg)
    planner = property(lambda self: self.run.plan.planner)
    sigma = property(lambda self: self.run.plan.sigma)
    state = property(lambda self: self.run.state)
    next_round = property(lambda self: self.state.next_round)
    params = property(lambda self: self.state.params)
    ledger = property(lambda self: self.state.ledger)
    metrics_history = property(lambda self: self.state.metrics_history)
    stopped_reason = property(lambda self: self.state.stopped_reason)

    def initial_arrays(self) -> ArrayRecord:
        """The current model.

        Returns:
            The model (the initial one before round 1) in the user's arrays' names, order and
            dtypes.
        """
        return model_record(self.run.plan.layout, self.params)

    def report(self) -> dict:
        """The run's privacy report.

        Returns:
            The report as the operator holds it (before the amplified-run redactions of the
            published file).
        """
        return self.run.report()

    def override(self, round_index: int, items: list[str]) -> None:
        """Operator override: add items to a future round's cohort.

        They pass through the separation monitor like sampled items (the ``policy`` setting
        decides), every override is listed in the privacy report, and an amplified run's report
        switches to post-hoc accounting.

        Args:
            round_index: a future round, 0-based.
            items: item ids known to the planner.
        """
        self.run.override(round_index, items)

    # -- Flower Strategy API -----------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Train until ``num_rounds`` rounds in total are released (default: all planned; a resumed
        run runs the rest).

        Args:
            grid: Flower's Grid (the ServerApp's ``main(grid, context)`` receives it).
            initial_arrays: the model a new run starts from (any ``ArrayRecord``: keys, order and
                dtypes are kept in every model sent; a resumed run refuses other arrays).
            num_rounds: n, the run's total rounds (a resumed run trains the rest).
            timeout: seconds to wait for nodes and replies (default: the ``node_timeout`` setting).
            train_config: the config sent to the cohort each round (merged with the inner
                strategy's).
            evaluate_config: the config of the inner strategy's federated evaluation.
            evaluate_fn: ``evaluate_fn(server_round, arrays)``, called for the starting model (round
                0) and after every round, as Flower's FedAvg does; its loss (the metric named
                ``loss`` or ending in ``loss``) and accuracy go to ``metrics.json`` as ``test_loss``
                and ``test_accuracy`` and decide the report's learning verdict.

        Returns:
            Flower's ``Result`` with the final arrays and the per-round train and evaluation
            metrics.
        """
        if initial_arrays is not None and model_sha256(initial_arrays) != self.run.initial_sha256:
            raise InvalidArgumentError(
                "initial_arrays", "the initial model this run was prepared with"
            )
        last = self.cfg.num_rounds if num_rounds is None else int(num_rounds)
        require(
            1 <= last <= self.cfg.num_rounds,
            "num_rounds",
            f"between 1 and the {self.cfg.num_rounds} rounds "
            "the run was planned for (the noise is factorized for them)",
            num_rounds,
        )
        return run_rounds(
            self,
            grid,
            last,
            self.cfg.node_timeout if timeout is None else timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Plan the round's cohort, check the budget guard, and build the train messages.

        Args:
            server_round: Flower's 1-based round number.
            arrays: the current global model.
            config: the round's config.
            grid: Flower's Grid.

        Returns:
            One message per scheduled, online node (none once the run is complete or stopped).
        """
        if self.run.done:
            return []
        online = self.directory.refresh(grid)
        plan = self.run.plan_next()
        if plan is None:  # the budget guard stopped the run
            return []
        t = plan.round
        user_config, sent = (
            (dict(config or {}), True)
            if self.inner is None
            else inner_train_config(self.inner, t + 1, arrays, config, grid)
        )
        if not sent and "inner-config" not in self._said:
            self._said.add("inner-config")
            log.warning(
                "the inner strategy's configure_train sent no message (fraction_train = 0?): "
                "corrflow's cohort trains with the train_config alone"
            )
        run_plan = self.run.plan
        plan = plan.route(self.directory.user_to_node, online, run_plan.item_home)
        messages = train_messages(run_plan.cfg, plan, arrays, user_config)
        self.inflight.put(plan, messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Validate and clip the replies, add the correlated noise, step the server optimizer, and
        commit the round.

        Args:
            server_round: Flower's 1-based round number.
            replies: the cohort's reply messages: a list, or a `ReplyStream` that pulls them
                while each is summed (corrflow's own round loop).

        Returns:
            (the new global model, the round's metrics), or (None, None) for a round that was not
            planned or a run that stopped while its replies were awaited.
        """
        plan, sent = self.inflight.take()
        if plan is None or self.run.done:  # not planned, or the run stopped while it waited
            return None, None
        node_to_user = self.directory.node_to_user
        # Each reply is summed as it arrives (``replies`` may pull them); the inner strategy's
        # metric aggregation keeps the replies' records without their arrays.
        kept: list[RecordDict] | None = [] if self.inner is not None else None

        def converted() -> Iterator[Reply]:
            for msg in replies:
                if kept is not None:
                    kept.append(_without_arrays(msg))
                # a reply is matched by the message it answers (an error the SuperLink makes for an
                # offline node comes from the SuperLink, not the node)
                node = sent.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))
                yield to_reply(msg, node, node_to_user)
                msg = None  # noqa: PLW2901 - summed: its bytes go before the next pull

        record = self.run.step(plan, converted())
        if record is None:  # refused (a non-finite model): the run stopped, nothing was released
            return None, None
        metrics = MetricRecord(
            {k: float(v) for k, v in record.metrics.items() if isinstance(v, int | float)}
        )
        if self.inner is not None:
            # A wrapped app's train metrics are its own strategy's aggregate of the accepted
            # replies, never corrflow's counters (those are in metrics.json, with a 0-based round):
            # none when no reply was accepted or the strategy aggregates none.
            contents = [kept[i] for i in record.accepted_replies] if kept is not None else []
            metrics = inner_metrics(self.inner, contents) if contents else None
        return model_record(self.run.plan.layout, record.params), metrics

    def configure_evaluate(self, server_round, arrays, config, grid):
        """Federated evaluation is the inner strategy's (its metrics are computed on clients' data
        and are not covered by the DP guarantee, as with Flower's own DP wrappers); corrflow alone
        evaluates server-side.

        Args:
            server_round: Flower's 1-based round number.
            arrays: the current global model.
            config: the round's config.
            grid: Flower's Grid.

        Returns:
            The inner strategy's evaluate messages (none without an inner strategy).
        """
        inner = self.inner
        if inner is None or self.cfg.secure_aggregation:
            return []  # under SecAgg+ no client sends metrics in the clear (the wrapper refuses)
        return inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        """The inner strategy's aggregation of federated-evaluation replies (outside the DP
        guarantee).

        Args:
            server_round: Flower's 1-based round number.
            replies: the evaluation replies.

        Returns:
            The inner strategy's aggregated metrics, or None.
        """
        inner = self.inner
        return None if inner is None else inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        eps = self.ledger.epsilon_history[-1] if self.ledger.epsilon_history else None
        log.info(
            "corrflow: %d rounds completed, realised ε = %s (δ = %g)",
            self.next_round,
            "n/a" if eps is None else f"{eps:.4f}",
            self.cfg.delta,
        )


def run_rounds(
    strategy: CorrelatedNoiseStrategy,
    grid: Grid,
    last: int,
    timeout: float,
    train_config: ConfigRecord | None,
    evaluate_config: ConfigRecord | None,
    evaluate_fn: Callable | None,
) -> Result:
    """Flower's ``Strategy.start`` loop with an interruptible exchange: rounds until ``last`` are
    released, the run stops or the operator interrupts (then the round in flight is abandoned,
    unreleased)."""
    stop = strategy.stop_event
    arrays = strategy.initial_arrays()
    result = Result(arrays=arrays)  # a finished or resumed run returns its current model
    # A wrapped app's metrics, shown as Flower shows them as far as privacy allows (app_metrics).
    shown = AppMetrics(strategy.run)
    server = strategy.server_evaluation
    if evaluate_fn is not None:
        t0 = strategy.next_round
        res = server.results[0] if server and t0 == 0 else evaluate_fn(t0, arrays)
        shown.initial_evaluation(res)
        if res is not None:
            result.evaluate_metrics_serverapp[t0] = res
    while strategy.next_round < last and not strategy.stopped_reason and not stop.is_set():
        server_round = strategy.next_round + 1
        if strategy.inner is not None:
            shown.round_header(server_round, last)
        if server is not None:
            server.round = server_round
        messages = list(
            strategy.configure_train(server_round, arrays, train_config or ConfigRecord(), grid)
        )
        if strategy.stopped_reason:
            break
        new_arrays, metrics = train_round(strategy, grid, server_round, messages, timeout, stop)
        # the cohort's replies (cohort × model bytes) go now, not with the next round's
        del messages
        if new_arrays is None:
            break
        arrays = result.arrays = new_arrays
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        if strategy.inner is not None:
            shown.aggregated("train", server_round, metrics)
        evaluation = list(
            strategy.configure_evaluate(
                server_round, arrays, evaluate_config or ConfigRecord(), grid
            )
        )
        ev = exchange(grid, evaluation, timeout, stop) if evaluation else None
        if ev is not None and (agg := strategy.aggregate_evaluate(server_round, ev)) is not None:
            result.evaluate_metrics_clientapp[server_round] = agg
            shown.aggregated("evaluate", server_round, agg)
        if evaluate_fn is not None:
            res = server.results.get(server_round) if server else evaluate_fn(server_round, arrays)
            shown.global_evaluation(res)
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res
    if (
        stop.is_set()
        and not strategy.stopped_reason
        and strategy.next_round < strategy.cfg.num_rounds
    ):
        # the engine's failure (its ``reason``), the noise workers' head, or a signal
        why = getattr(stop, "reason", None) or strategy.run.noise.lost or INTERRUPTED
        strategy.run.stop(
            f"{why} before round {strategy.next_round + 1} of "
            f"{strategy.cfg.num_rounds}; nothing of that round was released"
        )
    return result


def train_round(strategy, grid, server_round, messages, timeout, stop):
    """One round's exchange and aggregation: (new model, metrics), or (None, None) when it was
    abandoned (``stop``: nothing of it committed or released) or not released. Under
    ``--secagg`` the server sees masked vectors and their sum only (`secure_train`)."""
    if strategy.cfg.secure_aggregation:
        return secure_train(strategy, grid, messages, timeout, stop) or (None, None)
    # pushed now (the in-flight round needs the message ids); pulled a few at a time while summed
    replies = ReplyStream(grid, messages, timeout, stop, pull_batch(strategy.run.plan.layout))
    try:
        return strategy.aggregate_train(server_round, replies)
    except RoundAbandonedError:
        strategy.inflight.put(None)  # nothing of the round was committed or released
        return None, None


def inner_metrics(inner: Strategy, contents: list) -> MetricRecord | None:
    """The inner strategy's aggregation of the accepted replies' metrics (None when it has none or
    fails)."""
    aggregate = getattr(inner, "train_metrics_aggr_fn", None)
    if aggregate is None:
        return None
    try:
        return aggregate(contents, getattr(inner, "weighted_by_key", "num-examples"))
    except Exception as exc:  # a user's aggregation function; the round itself is already recorded
        log.warning("the inner strategy's train-metrics aggregation failed: %s", exc)
        return None


def _without_arrays(msg: Message) -> RecordDict:
    """A reply's records less its arrays (what a metric aggregation reads); empty for an error."""
    if msg.has_error():
        return RecordDict()
    return RecordDict({k: v for k, v in msg.content.items() if not isinstance(v, ArrayRecord)})
