"""κ for the planner's score measured on *public proxy data* (`corrflow.planning.score`): the task's
own ClientApp trains a non-private run on the proxy data, never on the private training data, and
nothing of it is accounted.

The proxy is a dataset file the user names (``--proxy-data``: it must be public, e.g. an earlier
public crawl or a public corpus in the same format) or, for the synthetic tasks of the presets, the
same generator with another seed (`PROXY_SEED`: other users, other sentences).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from corrflow.clients.tasks import get_task
from corrflow.config import RunConfig
from corrflow.data.federated import check_dataset, train_clients_count
from corrflow.errors import DataFormatError, InvalidArgumentError, require
from corrflow.planning.run import workload_for
from corrflow.planning.score import DEFAULT_KAPPA, Damping, estimate_damping
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


def proxy_damping(
    cfg: RunConfig,
    population: int,
    cohort_size: int,
    *,
    proxy_data: str = "",
    proxy_vocab: str = "",
    seed: int = PROXY_SEED,
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

    Returns:
        `Damping` with source ``proxy``.

    Raises:
        InvalidArgumentError: (``proxy-data``, ``proxy-vocab``) a missing file, or a synthetic
            client (numpy) asked to read one.
    """
    if proxy_data:
        require(
            cfg.client in ("nextword", "keras"),
            "client",
            "a client that trains on text files (nextword or keras) with --proxy-data",
            cfg.client,
        )
        require(bool(proxy_vocab), "proxy-vocab", "the proxy data's vocabulary file", proxy_vocab)
        check_proxy_files(proxy_data, proxy_vocab)
        users = min(population, train_clients_count(proxy_data))
        what = f"the proxy file {proxy_data}"
    else:
        users = population
        what = f"the synthetic generator with seed {seed} ({cfg.client} client)"
    cohort = max(1, min(cohort_size, users))
    task = get_task(cfg.client, cfg.model_dim, proxy_data, proxy_vocab, cfg.seq_len, seed, 1)
    weights = task.initial_weights()
    shapes = [np.shape(w) for w in weights]
    train = task.handlers["train"]
    order = np.random.default_rng([int(seed), 37]).permutation(users)
    groups = max(1, users // cohort)
    enable_offline_messages()

    def unflat(v: np.ndarray) -> list[np.ndarray]:
        out, i = [], 0
        for s in shapes:
            k = int(np.prod(s))
            out.append(v[i : i + k].reshape(s).astype(np.float32))
            i += k
        return out

    def update(x: np.ndarray, t: int) -> np.ndarray:
        # The round's mean clipped update over a fixed-epoch cohort, as the server computes it
        # without noise (corrflow.run.clipping): Σ clip(reply − model) / B.
        sent = unflat(x)
        config = {
            "server-round": t + 1,
            "local-lr": cfg.local_lr,
            "local-steps": cfg.local_steps,
            "clip-norm": cfg.clip_norm,
            "seed": seed,
            "client": cfg.client,
        }
        if proxy_data:
            config.update(
                {"data-path": proxy_data, "vocab-path": proxy_vocab, "seq-len": cfg.seq_len}
            )
        total = np.zeros_like(x)
        g = t % groups
        for user in order[g * cohort : (g + 1) * cohort]:
            msg = Message(
                content=RecordDict({"arrays": ArrayRecord(sent), "config": ConfigRecord(config)}),
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
            reply = train(msg, ctx).content["arrays"].to_numpy_ndarrays()
            delta = np.concatenate(
                [(np.asarray(r, np.float64) - s).ravel() for r, s in zip(reply, sent, strict=True)]
            )
            norm = float(np.linalg.norm(delta))
            total += delta * (min(1.0, cfg.clip_norm / norm) if norm > 0 else 1.0)
        return total / cohort

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


def damping_for(
    cfg: RunConfig,
    population: int,
    cohort_size: int,
    *,
    kappa: float | None = None,
    proxy_data: str = "",
    proxy_vocab: str = "",
    synthetic_proxy: bool = False,
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

    Returns:
        The `Damping` the plan ranks by.
    """
    if kappa is not None:
        return Damping(float(kappa), "declared")
    if proxy_data or synthetic_proxy:
        return proxy_damping(
            cfg, population, cohort_size, proxy_data=proxy_data, proxy_vocab=proxy_vocab
        )
    return Damping(DEFAULT_KAPPA, "default")
