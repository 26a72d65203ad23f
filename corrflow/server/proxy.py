"""κ for the planner's score measured on *public proxy data* (`corrflow.planning.score`): the task's
own ClientApp trains a non-private run on the proxy data, never on the private training data, and
nothing of it is accounted.

The proxy is a dataset file the user names (``--proxy-data``: it must be public, e.g. an earlier
public crawl or a public corpus in the same format) or, for the synthetic tasks of the presets, the
same generator with another seed (`PROXY_SEED`: other users, other sentences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from corrflow.clients.tasks import Task, get_task
from corrflow.config import RunConfig
from corrflow.data.federated import check_dataset, train_clients_count
from corrflow.errors import DataFormatError, InvalidArgumentError, require
from corrflow.planning.run import workload_for
from corrflow.planning.score import DEFAULT_KAPPA, Damping, estimate_damping
from corrflow.server.cohort_backend import COHORT_CLIENTS, CohortTrainer
from corrflow.server.inprocess import enable_offline_messages

#: The synthetic generator's seed for proxy data: far from the training seeds 0, 1, 2, … that
# comparisons and runs use, so the proxy users and sentences are not those trained on.
PROXY_SEED = 1000


def check_proxy_files(proxy_data: str, proxy_vocab: str) -> None:
    """Refuse proxy data without training or held-out examples, or a vocabulary without a word,
    naming ``--proxy-data`` or ``--proxy-vocab`` (not the run's own ``--data``/``--vocab``) before
    any training.

    Args:
        proxy_data: the proxy dataset file.
        proxy_vocab: its vocabulary file.

    Raises:
        InvalidArgumentError: naming ``proxy-data`` or ``proxy-vocab``, with the file's error.
    """
    try:
        check_dataset(proxy_data, proxy_vocab)
    except DataFormatError as exc:
        flag = "proxy-vocab" if exc.path == str(proxy_vocab) else "proxy-data"
        raise InvalidArgumentError(flag, f"a usable proxy file ({exc})") from None
    except InvalidArgumentError as exc:
        if exc.field not in ("data", "vocab"):
            raise
        raise InvalidArgumentError(f"proxy-{exc.field}", exc.expected, exc.got) from None


#: The engines of the proxy run: Flower's ClientApp per user, in process, or the cohort engine.
PROXY_BACKENDS = ("inprocess", "cohort")

#: (model sent, users, 1-based server round) → each user's reply: the new weights, in model order.
Replies = Callable[[list[np.ndarray], Sequence[int], int], list[list[np.ndarray]]]


def check_proxy_backend(client: str, backend: str) -> None:
    """Refuse, naming ``--backend``, an engine the proxy run cannot train ``client`` on.

    Raises:
        InvalidArgumentError: (``--backend``) not one of `PROXY_BACKENDS`, or the cohort engine
            for a task it does not train.
    """
    require(
        backend in PROXY_BACKENDS,
        "--backend",
        "inprocess or cohort (the proxy run trains in this process)",
        backend,
    )
    require(
        backend != "cohort" or client in COHORT_CLIENTS,
        "--backend",
        f"inprocess for the {client} client (the cohort engine trains corrflow's numpy and "
        "nextword tasks)",
        backend,
    )


def proxy_damping(
    cfg: RunConfig,
    population: int,
    cohort_size: int,
    *,
    proxy_data: str = "",
    proxy_vocab: str = "",
    seed: int = PROXY_SEED,
    backend: str = "inprocess",
) -> Damping:
    """κ of the task ``cfg`` trains, measured on public proxy data (`estimate_damping`).

    Args:
        cfg: the run's settings: client, optimizer (server lr, momentum, cooldown), local
            training, clip norm, rounds; its own data files are never read.
        population: users P (the proxy's users: at most its training partitions).
        cohort_size: users per round B (at most the proxy's users).
        proxy_data: a public dataset file in a format ``--data`` reads ("": the synthetic
            generator with ``seed``).
        proxy_vocab: its vocabulary (required with ``proxy_data``).
        seed: the synthetic generator's seed (with no ``proxy_data``), and the probes' seed.
        backend: the engine that trains the users (`PROXY_BACKENDS`).

    Returns:
        `Damping` with source ``proxy``.

    Raises:
        InvalidArgumentError: (``proxy-data``, ``proxy-vocab``) a missing file, or a synthetic
            client (numpy) asked to read one; (``--backend``) an engine it cannot train on.
    """
    check_proxy_backend(cfg.client, backend)
    users, what = _proxy_users(cfg, population, proxy_data, proxy_vocab, seed)
    cohort = max(1, min(cohort_size, users))
    task = get_task(cfg.client, cfg.model_dim, proxy_data, proxy_vocab, cfg.seq_len, seed, 1)
    weights = task.initial_weights()
    if backend == "cohort":
        replies = _cohort_replies(cfg, task, seed)
    else:
        replies = _client_app_replies(cfg, task, users, seed, proxy_data, proxy_vocab)
    order = np.random.default_rng([int(seed), 37]).permutation(users)
    update = _mean_clipped_update(replies, [np.shape(w) for w in weights], order, cohort, cfg)
    x0 = np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])
    return estimate_damping(
        update,
        x0,
        workload_for(cfg.momentum, cfg.cooldown_fraction),
        cfg.num_rounds,
        cfg.server_lr,
        seed=seed,
        proxy=what,
    )


def _proxy_users(
    cfg: RunConfig, population: int, proxy_data: str, proxy_vocab: str, seed: int
) -> tuple[int, str]:
    """The proxy's users (at most the proxy file's training partitions) and what it is, for the
    report; a proxy file is checked first."""
    if not proxy_data:
        return population, f"the synthetic generator with seed {seed} ({cfg.client} client)"
    require(
        cfg.client in ("nextword", "keras"),
        "client",
        "a client that trains on text files (nextword or keras) with --proxy-data",
        cfg.client,
    )
    require(bool(proxy_vocab), "proxy-vocab", "the proxy data's vocabulary file", proxy_vocab)
    check_proxy_files(proxy_data, proxy_vocab)
    return min(population, train_clients_count(proxy_data)), f"the proxy file {proxy_data}"


def _client_app_replies(
    cfg: RunConfig, task: Task, users: int, seed: int, proxy_data: str, proxy_vocab: str
) -> Replies:
    """`Replies` from the task's own ClientApp, one Flower message per user."""
    train = task.handlers["train"]
    enable_offline_messages()
    config = {
        "local-lr": cfg.local_lr,
        "local-steps": cfg.local_steps,
        "clip-norm": cfg.clip_norm,
        "seed": seed,
        "client": cfg.client,
    }
    if proxy_data:
        config.update({"data-path": proxy_data, "vocab-path": proxy_vocab, "seq-len": cfg.seq_len})

    def replies(sent, cohort, server_round):
        out = []
        for user in cohort:
            msg = Message(
                content=RecordDict(
                    {
                        "arrays": ArrayRecord(sent),
                        "config": ConfigRecord({**config, "server-round": server_round}),
                    }
                ),
                message_type="train",
                dst_node_id=1,
            )
            ctx = Context(
                run_id=1,
                node_id=1,
                node_config={"partition-id": int(user), "num-partitions": users},
                state=RecordDict(),
                run_config={},
            )
            out.append(train(msg, ctx).content["arrays"].to_numpy_ndarrays())
        return out

    return replies


def _cohort_replies(cfg: RunConfig, task: Task, seed: int) -> Replies:
    """`Replies` from the cohort engine (`corrflow.server.cohort_backend.CohortTrainer`): the
    same data order as the ClientApp's (its ``seed`` is the proxy's), in float64 like the
    ClientApp's arithmetic, since κ's probes difference nearby models."""
    names = tuple(str(i) for i in range(len(task.initial_weights())))
    trainer = CohortTrainer(cfg.replace(seed=int(seed)), task, names, dtype=np.float64)

    def replies(sent, cohort, server_round):
        return trainer.train(sent, [int(u) for u in cohort], server_round - 1).new_weights(sent)

    return replies


def _mean_clipped_update(
    replies: Replies, shapes: list[tuple], order: np.ndarray, cohort: int, cfg: RunConfig
) -> Callable[[np.ndarray, int], np.ndarray]:
    """The update map `estimate_damping` probes: (flat model, round t) → the mean clipped update
    of round t's fixed-epoch cohort (``order``'s group t mod groups), as the server computes it
    without noise (`corrflow.run.clipping`): Σ clip(reply − model) / B."""
    groups = max(1, len(order) // cohort)

    def unflat(v: np.ndarray) -> list[np.ndarray]:
        out, i = [], 0
        for s in shapes:
            k = int(np.prod(s))
            out.append(v[i : i + k].reshape(s).astype(np.float32))
            i += k
        return out

    def update(x: np.ndarray, t: int) -> np.ndarray:
        sent = unflat(x)
        g = t % groups
        total = np.zeros_like(x)
        for reply in replies(sent, order[g * cohort : (g + 1) * cohort], t + 1):
            delta = np.concatenate(
                [(np.asarray(r, np.float64) - s).ravel() for r, s in zip(reply, sent, strict=True)]
            )
            norm = float(np.linalg.norm(delta))
            total += delta * (min(1.0, cfg.clip_norm / norm) if norm > 0 else 1.0)
        return total / cohort

    return update


def damping_for(
    cfg: RunConfig,
    population: int,
    cohort_size: int,
    *,
    kappa: float | None = None,
    proxy_data: str = "",
    proxy_vocab: str = "",
    synthetic_proxy: bool = False,
    backend: str = "inprocess",
) -> Damping:
    """The planner's κ: declared (``kappa``), measured on ``proxy_data`` or — with
    ``synthetic_proxy``, for the synthetic tasks — on the generator with `PROXY_SEED`, else the
    default assumption (`corrflow.planning.score.DEFAULT_KAPPA`).

    Args:
        cfg: the run's settings (client, optimizer, local training; its data files are not read).
        population: users P.
        cohort_size: users per round B.
        kappa: a declared κ (None: not declared).
        proxy_data: a public dataset file ("": none).
        proxy_vocab: its vocabulary.
        synthetic_proxy: measure on the synthetic generator when no file is named.
        backend: the proxy run's engine (`PROXY_BACKENDS`).

    Returns:
        The `Damping` the plan ranks by.
    """
    if kappa is not None:
        return Damping(float(kappa), "declared")
    if proxy_data or synthetic_proxy:
        return proxy_damping(
            cfg,
            population,
            cohort_size,
            proxy_data=proxy_data,
            proxy_vocab=proxy_vocab,
            backend=backend,
        )
    return Damping(DEFAULT_KAPPA, "default")
