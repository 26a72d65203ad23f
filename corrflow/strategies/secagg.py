"""corrflow's server driver of SecAgg+ (``--secagg``): the four stages of Flower's protocol (setup →
share keys → collect masked vectors → unmask) in the stock message format, over corrflow's
interruptible exchange, with Flower's primitives (``flwr.common.secure_aggregation``: Shamir
shares, key agreement, pseudo-random masks, modular sums, dequantization).

What differs from Flower's ``SecAggPlusWorkflow``: the quantization range is chosen per round from
the cohort size so the modular sum never wraps (`corrflow.run.secure_sum`); the result is the sum
(weight exactly 1 per client, checked), not a weighted mean; a dropout is removed only through the
pairwise masks it actually added; a failure is an outcome, not a log line.

Each attempt is setup → share keys → collect → unmask (`secure_sum`); every stage's replies pass
`_Stage`, which fails the attempt naming the node at fault: the sender of a malformed reply, of a
public key that does not parse (checked here, not by its users), of a share ciphertext that is not
a Fernet token, or whose ciphertext its receivers report as undecryptable (`_blame`); every secret
is reconstructed and checked before any mask is removed (`_reconstruct`), naming the holder whose
share does not fit. A failed attempt is redone with the same scheduled cohort and the same (never
released) noise, at most `MAX_ATTEMPTS` times (`secure_train`); a sum that was unmasked and fails
the plausibility check stops the run for good (`SECURE_SUM_REFUSED`: a second sum of the same
cohort could tell members apart). The unmasked sum enters `Run.step` as `SummedReplies` and is
never persisted before its round is released.

With a noise node (``--noise-node``, `corrflow.noisenode`) the noise node is one more member of
every stage: it gets the stock stage messages plus the round index and the recipe it checks
against its pin; its setup reply carries the signature of its keys, relayed to the clients' guard
mod; T leaves the noise its headroom (`corrflow.run.secure_sum.noise_headroom_range`); an attempt
it did not answer fails before anything is unmasked; the decode subtracts the clients' offsets
only and reads values past the headroom as negative (`corrflow.run.secure_sum.centre`); and its
receipt (key segment, journal head) goes to the run's `NoiseNodeStream`. Each attempt then
carries a fresh row, never the same one.
"""

from __future__ import annotations

import base64
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_mod
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)

from corrflow.errors import IntegrityError
from corrflow.fileio import write_json
from corrflow.noise.segments import PublicSegment
from corrflow.noisenode.protocol import (
    HEAD_KEY,
    RECIPE_KEY,
    ROUND_KEY,
    SEGMENT_KEY,
    SIGNATURE_KEY,
)
from corrflow.run.noise_node_link import NoiseNodeStream
from corrflow.run.resume import SECURE_SUM_REFUSED
from corrflow.run.round import RoundPlan, SummedReplies
from corrflow.run.secure_sum import (
    ACTIONS,
    MAX_ATTEMPTS,
    UNDECRYPTABLE_KEY,
    SecureSumParams,
    centre,
    decode_counts,
    implausible,
    secure_sum_params,
)
from corrflow.strategies.messaging import exchange

log = logging.getLogger("corrflow")

#: The TRAIN config keys the collect stage adds for corrflow's client mod.
REPLIES_KEY, ZEROING_KEY = "replies", "zeroing-factor"
#: A Fernet token's bytes besides its ciphertext: version, timestamp, IV, HMAC.
_TOKEN_OVERHEAD = 1 + 8 + 16 + 32


class SecureSumError(Exception):
    """A round's secure sum did not produce a releasable sum; ``redo``: nothing was unmasked, so
    the round may be attempted again with the same cohort and noise."""

    def __init__(self, reason: str, redo: bool):
        super().__init__(reason)
        self.reason, self.redo = reason, redo


@dataclass
class _Attempt:
    """One attempt's protocol state, in memory only (a killed server redoes the round)."""

    params: SecureSumParams
    shapes: list[tuple[int, ...]]
    neighbours: dict[int, set[int]]
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    u1: set[int] = field(default_factory=set)  # sent its shares (share keys)
    u2: set[int] = field(default_factory=set)  # sent its masked vector
    masked: list[np.ndarray] | None = None
    dropped: dict[int, str] = field(default_factory=dict)  # node → the stage it dropped in
    receipt: tuple[dict, str] = ({}, "")  # the noise node's (key segment, journal head)
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)
    noise: NoiseNodeStream | None = None  # the noise node, a member of every stage
    noise_signature: bytes = b""  # its signature of its SecAgg+ keys (relayed to the clients)
    round: int = 0

    @property
    def noise_id(self) -> int | None:
        """The noise node's id, or None."""
        return None if self.noise is None else self.noise.node_id

    def clients(self, members: set[int]) -> set[int]:
        """``members`` without the noise node."""
        return members - {self.noise_id}

    def require_noise_node(self, members: set[int], stage: str) -> None:
        """Nothing is unmasked without the noise node's input: a stage it did not answer fails
        the attempt (redone with a fresh row; the row it may have sent is never reused)."""
        if self.noise is not None and self.noise_id not in members:
            raise SecureSumError(f"{stage}: the noise node did not answer", True)


def neighbour_graph(nodes: list[int], num_shares: int, rng: random.Random) -> dict[int, set[int]]:
    """SecAgg+'s graph (as Flower's workflow builds it): the nodes in a random ring, each with the
    ``num_shares`` nearest (itself included)."""
    order = list(nodes)
    rng.shuffle(order)
    half, m = num_shares >> 1, len(order)
    return {
        nid: {order[(i + o) % m] for o in range(-half, half + 1)} for i, nid in enumerate(order)
    }


def round_graph(
    nodes: list[int], num_shares: int, noise_id: int | None, rng: random.Random
) -> dict[int, set[int]]:
    """The round's neighbour graph: `neighbour_graph` over the clients ``nodes``; with a noise
    node, it is a neighbour of every client (one more in each neighbourhood of ``num_shares``):
    each client's guard mod must see it in the round, and a client that is not its neighbour
    would hold none of its shares).

    Args:
        nodes: the clients.
        num_shares: the neighbourhood size (itself included), the noise node included.
        noise_id: the noise node's id, or None.
        rng: shuffles the ring.

    Returns:
        node → its neighbours, itself included.
    """
    if noise_id is None:
        return neighbour_graph(nodes, num_shares, rng)
    graph = {
        n: {*ring, noise_id} for n, ring in neighbour_graph(nodes, num_shares - 1, rng).items()
    }
    graph[noise_id] = {*nodes, noise_id}
    return graph


class _Stage:
    """Send one stage's messages and keep the well-formed replies (node → config record); a node
    that does not answer has dropped out, a malformed answer fails the round naming the node."""

    def __init__(self, grid: Grid, timeout: float, stop, check: Callable[[int, object], None]):
        self.grid, self.timeout, self.stop, self.check = grid, timeout, stop, check

    def __call__(self, stage: str, contents: dict[int, RecordDict]) -> dict[int, ConfigRecord]:
        messages = {
            nid: Message(content=c, message_type=MessageType.TRAIN, dst_node_id=nid)
            for nid, c in contents.items()
        }
        replies = exchange(self.grid, list(messages.values()), self.timeout, self.stop)
        if replies is None:
            raise InterruptedError
        sent = {m.metadata.message_id: nid for nid, m in messages.items()}
        by_node = {
            sent.get(r.metadata.reply_to_message_id, int(r.metadata.src_node_id)): r
            for r in replies
        }
        by_node = {n: r for n, r in by_node.items() if n in contents}
        _blame(stage, by_node, set(contents))
        out: dict[int, ConfigRecord] = {}
        for nid, reply in sorted(by_node.items()):
            if reply.has_error():
                if reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION:
                    # the protocol failed inside the client (corrflow's mod turns a failed training
                    # into a zero update): a ciphertext it could not decrypt, a config it refused
                    first = (str(reply.error.reason).strip().splitlines() or [""])[-1][:200]
                    raise SecureSumError(f"{stage}: node {nid} failed: {first}", True)
                continue  # dropped out (offline, timed out, crashed)
            if int(reply.metadata.src_node_id) != nid:
                raise SecureSumError(f"{stage}: node {nid}'s reply came from another node", True)
            record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
            clear = [k for k, r in reply.content.array_records.items() if len(r)]
            if record is None or clear:
                why = f"arrays in the clear ({clear})" if clear else "no secaggplus_configs record"
                raise SecureSumError(f"{stage}: node {nid} replied {why}", True)
            self.check(nid, record)
            out[nid] = record
        return out


def _blame(stage: str, replies: dict[int, Message], cohort: set[int]) -> None:
    """Name the senders of the share ciphertexts that receivers could not authenticate or decrypt
    (corrflow's client mod reports them under `UNDECRYPTABLE_KEY` instead of a masked vector): the
    sender of a bad ciphertext or a bad key is at fault, not the honest receiver."""
    blamed: dict[int, list[int]] = {}
    for nid, reply in replies.items():
        if reply.has_error():
            continue
        record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if record is None or UNDECRYPTABLE_KEY not in record:
            continue
        senders = record[UNDECRYPTABLE_KEY]
        if not isinstance(senders, list) or not senders or not set(senders) <= cohort - {nid}:
            raise _fail(stage, nid, "a report of undecryptable shares naming no cohort member")
        for sender in senders:
            blamed.setdefault(int(sender), []).append(nid)
    if blamed:
        named = "; ".join(
            f"node {src}'s (failed at node(s) {sorted(at)})" for src, at in sorted(blamed.items())
        )
        raise SecureSumError(
            f"{stage}: share ciphertexts that did not authenticate or decrypt: {named}", True
        )


def _fail(stage: str, nid: int, what: str) -> SecureSumError:
    return SecureSumError(f"{stage}: node {nid} sent {what}", True)


def secure_sum(
    grid: Grid,
    messages: list[Message],
    plan: RoundPlan,
    clip: float,
    shapes: list[tuple[int, ...]],
    config: dict,
    timeout: float,
    stop,
    noise: NoiseNodeStream | None = None,
) -> SummedReplies:
    """One attempt at round ``plan``'s secure sum over the routed train ``messages`` (one per
    node). Returns the sum as `SummedReplies` (accepted: the items of the nodes whose masked
    vectors are in it; the others rejected as dropped out); ``config`` joins the collect stage's
    train config. A lone member is never asked to train (its sum would be its update): it is
    rejected and the round releases noise only. With a ``noise`` node it is one more member of
    every stage, its input the round's noise (the sum comes back noised, and its receipt goes to
    ``noise``). Raises `SecureSumError`, or ``InterruptedError`` when ``stop`` was set."""
    train = {int(m.metadata.dst_node_id): m.content for m in messages}
    nodes = sorted(train)
    dim = sum(int(np.prod(s)) for s in shapes)
    if len(nodes) < 2 and noise is not None:
        # the server holds no noise to release a round alone, and the noise node joins no sum
        # of fewer than 2 clients (its row would be the sum): retried, then the run stops
        raise SecureSumError(
            f"{len(nodes)} client(s) online in the cohort: a round with a noise node needs at "
            "least 2 (the server holds no noise to release it alone)",
            True,
        )
    if len(nodes) < 2:
        alone = SummedReplies.empty(shapes)
        alone.rejections = [
            (str(plan.expected[n]), "alone online in its cohort: a secure sum needs another member")
            for n in nodes
        ]
        return alone
    sigma = None if noise is None else noise.sigma_max
    params = secure_sum_params(len(nodes), clip, dim, sigma)
    members = nodes if noise is None else [*nodes, noise.node_id]
    noise_id = None if noise is None else noise.node_id
    graph = round_graph(nodes, params.num_shares, noise_id, random.SystemRandom())
    t = plan.round if noise is not None else 0  # the noise node needs the round index
    a = _Attempt(params, list(shapes), graph, noise=noise, round=t)
    _setup(a, grid, members, timeout, stop)
    _share_keys(a, grid, timeout, stop)
    _collect(a, grid, train, config, timeout, stop)
    total, counts = _unmask(a, grid, timeout, stop)
    reason = implausible(total, counts, len(a.clients(a.u2)), params)
    if reason is not None:
        raise SecureSumError(reason + " — refused without naming anyone", False)
    summed = SummedReplies.empty(shapes)
    summed.total = [t.astype(np.float32) for t in total]
    summed.counts.update(counts)
    summed.accepted = sorted(str(plan.expected[n]) for n in a.clients(a.u2))
    summed.rejections = [
        (str(plan.expected[n]), f"dropped out of the secure sum ({stage})")
        for n, stage in sorted(a.dropped.items())
        if n != a.noise_id
    ]
    if noise is not None:
        noise.receive(plan.round, *a.receipt)
    return summed


def _check_keys(nid: int, record) -> None:
    keys = [record.get(k) for k in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2)]
    if not all(isinstance(k, bytes) for k in keys):
        raise _fail(Stage.SETUP, nid, "no public keys")
    try:  # checked here, so that a garbage key is blamed on its sender, not on its users
        for key in keys:
            bytes_to_public_key(key)
    except Exception:  # any unparsable key
        raise _fail(Stage.SETUP, nid, "a public key that is not an EC public key") from None
    if keys[0] == keys[1]:
        raise _fail(Stage.SETUP, nid, "the same public key twice")


def _check_unique_keys(keys: dict[int, tuple[bytes, bytes]]) -> None:
    """Flower's clients refuse a key list with a key twice: name the nodes that sent it."""
    owners: dict[bytes, list[int]] = {}
    for nid, pair in sorted(keys.items()):
        for key in pair:
            owners.setdefault(key, []).append(nid)
    shared = sorted({n for nodes in owners.values() if len(nodes) > 1 for n in nodes})
    if shared:
        raise SecureSumError(f"{Stage.SETUP}: nodes {shared} sent the same public key", True)


def _setup(a: _Attempt, grid: Grid, nodes: list[int], timeout: float, stop) -> None:
    p = a.params
    config = {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: p.cohort,
        Key.SHARE_NUMBER: p.num_shares,
        Key.THRESHOLD: p.threshold,
        Key.CLIPPING_RANGE: p.clipping_range,
        Key.TARGET_RANGE: p.quantization_range,
        Key.MOD_RANGE: p.modulus,
        Key.MAX_WEIGHT: 1.0,  # the client mod sends weight 1: the sum is a sum, not a mean
    }
    if a.noise is not None:
        config[Key.SAMPLE_NUMBER] = p.participants
    contents = {n: RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(config)}) for n in nodes}
    if a.noise is not None:  # the request the noise node checks against its pinned recipe
        asked = {**config, RECIPE_KEY: json.dumps(a.noise.recipe, sort_keys=True)}
        contents[a.noise_id] = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(asked)})
    got = _Stage(grid, timeout, stop, _check_keys)(Stage.SETUP, contents)
    a.require_noise_node(set(got), Stage.SETUP)
    if a.noise is not None:
        sig = got[a.noise_id].get(SIGNATURE_KEY)
        if not isinstance(sig, bytes):
            raise _fail(Stage.SETUP, a.noise_id, "no signature of its keys (not a noise node)")
        a.noise_signature = sig
    a.keys = {n: (r[Key.PUBLIC_KEY_1], r[Key.PUBLIC_KEY_2]) for n, r in got.items()}
    _check_unique_keys(a.keys)
    _drop(a, set(nodes) - set(got), Stage.SETUP)
    _check_threshold(a, set(got), Stage.SETUP)


def _share_keys(a: _Attempt, grid: Grid, timeout: float, stop) -> None:
    alive = set(a.keys)

    def check(nid: int, record) -> None:
        dsts, texts = record.get(Key.DESTINATION_LIST), record.get(Key.CIPHERTEXT_LIST)
        if not isinstance(dsts, list) or not isinstance(texts, list) or len(dsts) != len(texts):
            raise _fail(Stage.SHARE_KEYS, nid, "destination and ciphertext lists that do not match")
        if len(set(dsts)) != len(dsts) or not set(dsts) <= (a.neighbours[nid] & alive) - {nid}:
            raise _fail(Stage.SHARE_KEYS, nid, "shares for nodes that are not its neighbours")
        if not all(_is_token(t) for t in texts):
            raise _fail(Stage.SHARE_KEYS, nid, "a share ciphertext that is not a Fernet token")

    contents = {}
    for n in alive:
        record = ConfigRecord({str(j): list(a.keys[j]) for j in a.neighbours[n] & alive})
        record[Key.STAGE] = Stage.SHARE_KEYS
        if a.noise is not None and n != a.noise_id:  # the clients' guard checks it
            record[SIGNATURE_KEY] = a.noise_signature
        contents[n] = RecordDict({RECORD_KEY_CONFIGS: record})
    got = _Stage(grid, timeout, stop, check)(Stage.SHARE_KEYS, contents)
    a.require_noise_node(set(got), Stage.SHARE_KEYS)
    a.u1 = set(got)
    _drop(a, alive - a.u1, Stage.SHARE_KEYS)
    _check_threshold(a, a.u1, Stage.SHARE_KEYS)
    a.forward = {n: ([], []) for n in a.u1}  # destination → (sources, ciphertexts)
    for src in sorted(a.u1):
        for dst, text in zip(
            got[src][Key.DESTINATION_LIST], got[src][Key.CIPHERTEXT_LIST], strict=True
        ):
            if dst in a.forward:
                a.forward[dst][0].append(src)
                a.forward[dst][1].append(text)


def _is_token(text) -> bool:
    """Whether ``text`` has the form of the Fernet token Flower's clients encrypt shares into
    (version 0x80, timestamp, IV, whole AES blocks, HMAC): a malformed one is blamed on its sender
    before anyone tries to decrypt it."""
    if not isinstance(text, bytes):
        return False
    try:
        raw = base64.urlsafe_b64decode(text)
    except ValueError:
        return False
    return (
        len(raw) >= _TOKEN_OVERHEAD + 16
        and raw[0] == 0x80
        and not ((len(raw) - _TOKEN_OVERHEAD) % 16)
    )


def _collect(
    a: _Attempt, grid: Grid, train: dict[int, RecordDict], extra: dict, timeout: float, stop
) -> None:
    shapes = [(1,), *a.shapes, (len(ACTIONS),)]
    m = a.params.modulus

    def check(nid: int, record) -> None:
        data = record.get(Key.MASKED_PARAMETERS)
        if not isinstance(data, list) or len(data) != len(shapes):
            raise _fail(Stage.COLLECT_MASKED_VECTORS, nid, f"not {len(shapes)} masked arrays")
        try:
            arrays = [bytes_to_ndarray(b) for b in data]
        except Exception as exc:  # any undecodable payload
            raise _fail(Stage.COLLECT_MASKED_VECTORS, nid, f"undecodable arrays ({exc})") from None
        for arr, shape in zip(arrays, shapes, strict=True):
            if tuple(arr.shape) != tuple(shape) or arr.dtype.kind not in "iu":
                raise _fail(
                    Stage.COLLECT_MASKED_VECTORS,
                    nid,
                    f"a {arr.dtype} array of shape {arr.shape}, expected int {shape}",
                )
            if arr.size and (arr.min() < 0 or arr.max() >= m):
                raise _fail(Stage.COLLECT_MASKED_VECTORS, nid, f"values outside [0, {m})")

    contents = {}
    for n in a.u1:
        if n == a.noise_id:  # no model, no training: the stock stage config and the round
            srcs, texts = a.forward[n]
            contents[n] = RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord(
                        {
                            Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                            Key.CIPHERTEXT_LIST: texts,
                            Key.SOURCE_LIST: srcs,
                            ROUND_KEY: a.round,
                        }
                    )
                }
            )
            continue
        content = RecordDict(dict(train[n].items()))
        content["config"] = ConfigRecord({**dict(content["config"]), **extra})
        srcs, texts = a.forward[n]
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
            {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: texts,
                Key.SOURCE_LIST: srcs,
            }
        )
        contents[n] = content
    got = _Stage(grid, timeout, stop, check)(Stage.COLLECT_MASKED_VECTORS, contents)
    a.require_noise_node(set(got), Stage.COLLECT_MASKED_VECTORS)
    if a.noise is not None:
        a.receipt = _receipt(got[a.noise_id])
    a.u2 = set(got)
    _drop(a, a.u1 - a.u2, Stage.COLLECT_MASKED_VECTORS)
    _check_threshold(a, a.u2, Stage.COLLECT_MASKED_VECTORS, owners=a.u1)
    total = None
    for n in sorted(a.u2):
        vec = [bytes_to_ndarray(b).astype(np.int64) for b in got[n][Key.MASKED_PARAMETERS]]
        total = (
            vec
            if total is None
            else parameters_mod([x + y for x, y in zip(total, vec, strict=True)], m)
        )
    a.masked = total


def _unmask(a: _Attempt, grid: Grid, timeout: float, stop) -> tuple[list[np.ndarray], dict]:
    dead = a.u1 - a.u2

    def check(nid: int, record) -> None:
        owners, shares = record.get(Key.NODE_ID_LIST), record.get(Key.SHARE_LIST)
        if (
            not isinstance(owners, list)
            or not isinstance(shares, list)
            or len(owners) != len(shares)
            or len(set(owners)) != len(owners)
        ):
            raise _fail(Stage.UNMASK, nid, "node id and share lists that do not match")
        if not set(owners) <= a.neighbours[nid] & a.u1:
            raise _fail(Stage.UNMASK, nid, "shares of nodes that are not its neighbours")
        for owner, share in zip(owners, shares, strict=True):
            _check_share(a, nid, owner, share, dead)

    contents = {
        n: RecordDict(
            {
                RECORD_KEY_CONFIGS: ConfigRecord(
                    {
                        Key.STAGE: Stage.UNMASK,
                        Key.ACTIVE_NODE_ID_LIST: sorted(a.neighbours[n] & a.u2),
                        Key.DEAD_NODE_ID_LIST: sorted(a.neighbours[n] & dead),
                    }
                )
            }
        )
        for n in a.u2
    }
    got = _Stage(grid, timeout, stop, check)(Stage.UNMASK, contents)
    shares: dict[int, dict[int, bytes]] = {n: {} for n in a.u1}  # owner → holder → share
    for n in sorted(got):
        for owner, share in zip(got[n][Key.NODE_ID_LIST], got[n][Key.SHARE_LIST], strict=True):
            shares[owner][n] = share
    short = sorted(n for n, s in shares.items() if len(s) < a.params.threshold)
    if short:  # checked before any secret is combined: nothing of this attempt is unmasked
        raise SecureSumError(
            f"{Stage.UNMASK}: fewer than {a.params.threshold} shares for {len(short)} node(s) "
            f"({len(got)} of {len(a.u2)} answered)",
            True,
        )
    return _remove_masks(a, _reconstruct(a, shares))


#: What Flower's clients share (``secaggplus_mod``): a 32-byte mask seed, a PEM private key.
SEED_BYTES, PRIVATE_KEY_BYTES = 32, 306


def _share_bytes(secret_bytes: int) -> int:
    """The length of one of Flower's Shamir shares of a secret (4-byte index, 16 bytes per padded
    chunk)."""
    return 4 + 16 * (secret_bytes // 16 + 1)


def _check_share(a: _Attempt, holder: int, owner: int, share, dead: set[int]) -> None:
    """A share's form: bytes of the length of the secret asked for (the owner's mask seed when it
    sent its masked vector, its first private key when it dropped out), a Shamir index in
    [1, shares per member]."""
    size = _share_bytes(PRIVATE_KEY_BYTES if owner in dead else SEED_BYTES)
    if not isinstance(share, bytes) or len(share) != size:
        got = len(share) if isinstance(share, bytes) else type(share).__name__
        raise _fail(Stage.UNMASK, holder, f"a share of node {owner} of {got} bytes, not {size}")
    index = int.from_bytes(share[:4], "little")
    # a noise node shares with every client: its Shamir indices run to its neighbourhood's size
    if not 1 <= index <= max(a.params.num_shares, len(a.neighbours[owner])):
        raise _fail(Stage.UNMASK, holder, f"a share of node {owner} with Shamir index {index}")


def _reconstruct(a: _Attempt, shares: dict[int, dict[int, bytes]]) -> dict[int, bytes]:
    """Every secret the unmasking needs, each checked before any mask is removed (no sum exists
    yet, so a failure leaves the attempt redoable): a mask seed must unpad to its 32 bytes, a
    private key must match the public key its owner sent. A secret that fails is decoded again
    without each share in turn, to name the holder whose share does not fit the others."""
    secrets: dict[int, bytes] = {}
    for owner in sorted(shares):
        valid = _is_seed if owner in a.u2 else partial(_matches, a.keys[owner][0])
        secret, bad = _decode(shares[owner], a.params.threshold, valid)
        if secret is None or bad:
            culprits = f"node(s) {bad}" if bad else f"one of nodes {sorted(shares[owner])}"
            raise SecureSumError(
                f"{Stage.UNMASK}: {culprits} sent a share of node {owner}'s secret that does not "
                "fit the others (a garbage or swapped share); nothing was unmasked",
                True,
            )
        secrets[owner] = secret
    return secrets


def _is_seed(secret: bytes) -> bool:
    """Whether ``secret`` unpadded to a mask seed's 32 bytes: its last 16-byte chunk is all
    padding, so a share that does not fit the others fails this but with probability 2⁻¹²⁸ (unless
    it alters only the earlier chunks: then the weights check after unmasking refuses the sum)."""
    return len(secret) == SEED_BYTES


def _matches(public_key: bytes, secret: bytes) -> bool:
    """Whether ``secret`` is the private key of ``public_key`` (a dropout's reconstructed key)."""
    try:
        derived = bytes_to_private_key(secret).public_key()
    except Exception:  # not a key at all
        return False
    return public_key_to_bytes(derived) == public_key


def _combine(shares: list[bytes]) -> bytes | None:
    try:
        return combine_shares(shares)
    except Exception:  # Flower's combine raises on bad padding, duplicate indices, …
        return None


def _decode(
    held: dict[int, bytes], threshold: int, valid: Callable[[bytes], bool]
) -> tuple[bytes | None, list[int]]:
    """The secret of the shares ``held`` (holder → share) and the holders whose share does not fit
    it. First the ``threshold`` shares of the lowest holders; when their secret is not ``valid``,
    the same without each holder in turn (one wrong share among ≥ threshold + 1 is found). Then
    every other share is checked against threshold − 1 shares of the valid set: it fits when they
    decode to the same secret. Returns (None, []) when no subset tried is valid. Shares beyond the
    first ``threshold`` are checked only when those fail: unused, they cannot change the sum, and
    checking each would cost one more decoding per share."""
    holders = sorted(held)
    base = None
    for skip in [None, *holders]:
        chosen = [h for h in holders if h != skip][:threshold]
        secret = _combine([held[h] for h in chosen]) if len(chosen) == threshold else None
        if secret is not None and valid(secret):
            base = chosen
            break
    if base is None:
        return None, []
    if skip is None:
        return secret, []  # the common case: the first shares decode; the rest are not needed
    rest = [held[h] for h in base[:-1]]
    bad = [h for h in holders if h not in base and _combine([*rest, held[h]]) != secret]
    return secret, sorted(bad)


def _remove_masks(a: _Attempt, secrets: dict[int, bytes]) -> tuple[list[np.ndarray], dict]:
    """The sum without masks (self-masks of contributors, pairwise masks of dropouts with the
    contributors that added them), dequantized: Σ x = deq(Σ q) − (m − 1)·r."""
    p, vec = a.params, a.masked
    shapes = [v.shape for v in vec]
    for nid in sorted(a.u1):
        secret = secrets[nid]
        if nid in a.u2:
            mask = pseudo_rand_gen(secret, p.modulus, shapes)
            vec = [x - y for x, y in zip(vec, mask, strict=True)]
            continue
        for other in sorted(a.neighbours[nid] & a.u2):  # only they added a mask with nid
            key = generate_shared_key(
                bytes_to_private_key(secret), bytes_to_public_key(a.keys[other][0])
            )
            mask = pseudo_rand_gen(key, p.modulus, shapes)
            sign = 1 if nid > other else -1  # undo `other`'s subtraction (other < nid) or addition
            vec = [x + sign * y for x, y in zip(vec, mask, strict=True)]
    vec = parameters_mod(vec, p.modulus)
    m = len(a.clients(a.u2))  # the noise node's weight and count slots are zeros
    if int(vec[0][0]) != m * p.quantization_range:
        raise SecureSumError(
            f"the unmasked weights add up to {int(vec[0][0])}, not {m} × {p.quantization_range} "
            "(a client that did not send weight 1, or a wrong share) — refused without naming "
            "anyone",
            False,
        )
    if a.noise is not None:  # the noise is centred at 0: values past the headroom are negative
        vec = [vec[0], *(centre(v, p) for v in vec[1:])]
    values = dequantize(vec[1:], p.clipping_range, p.quantization_range)
    values = [v - (m - 1) * p.clipping_range for v in values]
    return values[:-1], decode_counts(values[-1], p)


def _receipt(record) -> tuple[dict, str]:
    """The noise node's receipt in its masked-vector reply: the key segment of its row and its
    journal head after sending it."""
    try:
        segment = json.loads(str(record[SEGMENT_KEY]))
        head = str(record[HEAD_KEY])
        PublicSegment.from_public(segment)  # a receipt of a known form and derivation version
    except (KeyError, TypeError, ValueError, AttributeError, IntegrityError):
        raise SecureSumError(
            f"{Stage.COLLECT_MASKED_VECTORS}: the noise node sent no receipt of its row", True
        ) from None
    return segment, head


def _drop(a: _Attempt, nodes: set[int], stage: str) -> None:
    for n in nodes:
        a.dropped.setdefault(n, stage)


def _check_threshold(
    a: _Attempt, alive: set[int], stage: str, owners: set[int] | None = None
) -> None:
    """Every member whose secrets may be needed (``owners``, default ``alive``) needs ``threshold``
    live neighbours (itself included), or they could not be reconstructed (Flower's
    ``_check_threshold``)."""
    short = [n for n in owners or alive if len(a.neighbours[n] & alive) < a.params.threshold]
    if short or len(alive) < 2:
        raise SecureSumError(
            f"{stage}: {len(a.dropped)} of {a.params.cohort} cohort members dropped out; "
            f"{len(short)} member(s) kept fewer than the threshold of {a.params.threshold} "
            "live neighbours",
            True,
        )


def secure_train(strategy, grid: Grid, messages: list[Message], timeout: float, stop):
    """Round ``strategy``'s planned round through the secure sum, then `Run.step` (checkpoint →
    journal → report → release): (the new model, the round's metrics), or None when the round was
    abandoned (``stop``) or failed for good — then the run is stopped on the record and nothing of
    the round was released. With a noise node (``run.noise_node`` a `NoiseNodeStream`) each attempt
    carries a fresh noise row: the noise node never sends a row twice."""
    plan, _ = strategy.inflight.take()
    cfg, run = strategy.cfg, strategy.run
    if plan is None or plan.round != strategy.next_round or strategy.stopped_reason:
        return None
    extra = {REPLIES_KEY: cfg.reply_kind, ZEROING_KEY: cfg.zeroing_factor}
    shapes = run.plan.layout.trainable_shapes
    noise = run.noise_node
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            if noise is not None:
                noise.prepare(run.plan)
            summed = secure_sum(
                grid, messages, plan, cfg.clip_norm, shapes, extra, timeout, stop, noise
            )
            break
        except InterruptedError:
            return None  # abandoned: nothing of this round is committed or released
        except SecureSumError as exc:
            log.warning(
                "round %d, attempt %d of %d: the secure sum failed: %s",
                plan.round + 1,
                attempt,
                MAX_ATTEMPTS,
                exc.reason,
            )
            if not exc.redo or attempt == MAX_ATTEMPTS:
                why = "refused after unmasking" if not exc.redo else f"failed {attempt} times"
                reason = (
                    f"round {plan.round + 1} of {cfg.num_rounds}: the secure sum {why} "
                    f"({exc.reason}); nothing of that round was released"
                )
                if not exc.redo:  # sticky: a rerun must not sum this round again
                    write_json(
                        Path(cfg.state_dir) / SECURE_SUM_REFUSED,
                        {"round": plan.round, "reason": reason},
                    )
                run.stop(reason)
                return None
    record = run.step(plan, summed)
    if record is None:
        return None
    metrics = {k: float(v) for k, v in record.metrics.items() if isinstance(v, int | float)}
    return strategy.initial_arrays(), MetricRecord(metrics)
