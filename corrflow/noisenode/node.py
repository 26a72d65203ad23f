"""The noise node's protocol: the client side of SecAgg+ (setup → share keys → collect masked
vectors → unmask) written with Flower's primitives (``flwr.common.secure_aggregation``: key
agreement, Shamir shares, authenticated encryption, pseudo-random masks), with round t's noise as
its input.

Flower's stock ``secaggplus_mod`` cannot carry it: it clips every coordinate to [−r, r] and rounds
stochastically, and clipping Gaussian noise breaks the mechanism. Here the input is
N_t = ⌊n_t/Δ + ½⌋ with n_t = σ·c·(C⁻¹Z)_t (`corrflow.run.secure_sum.grid_noise`), centred at 0 and
represented modulo M, with zeros in the weight and action-count slots. Since the clients' quantized
sum S is an integer vector, S + N_t = round(S + n_t/Δ): what the server decodes is post-processing
of the Gaussian (matrix) mechanism on the quantized sum (docs/explanation/noise-node.md).

Rules: the node answers only requests that match its pinned recipe (factorization sha256, σ, clip,
δ, rounds; T as `corrflow.run.secure_sum.noise_headroom_range` gives it for the cohort; cohorts of
at least 2 clients); it signs its per-round SecAgg+ public keys with its long-term key (the
clients' guard mod checks them); it refuses an unmask that calls it dead. Release authority is its
journal (`corrflow.noisenode.store`): a row is journaled before the masked vector containing it
leaves, and is never sent again — a redo of round t, a restart of this node, or a server that asks
for a round at or before one already sent opens a new key segment at t first.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
from flwr.common import ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_mod
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from corrflow.accounting.noise_scale import noise_std_per_round
from corrflow.errors import IntegrityError
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_bytes
from corrflow.noise import CorrelatedNoise, new_secret
from corrflow.noisenode.protocol import (  # noqa: E402
    HEAD_KEY,
    RECIPE_FIELDS,
    RECIPE_KEY,
    ROUND_KEY,
    SEGMENT_KEY,
    SIGNATURE_KEY,
    id_message,
    signed_keys_message,
)
from corrflow.noisenode.store import FACTORIZATION, NoiseNodeStore
from corrflow.run.secure_sum import ACTIONS, MODULUS, grid_noise, secure_sum_params


class RecipeRefusedError(ValueError):
    """A request for parameters other than the pinned recipe's."""


@dataclass
class _Round:
    """One secure round's protocol state (in memory: a restarted node fails the round)."""

    config: dict
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    seed_shares: dict[int, bytes] = field(default_factory=dict)
    sk1_shares: dict[int, bytes] = field(default_factory=dict)
    shared: dict[int, bytes] = field(default_factory=dict)


class NoiseNode:
    """The noise node (module docstring), over its directory ``store``."""

    def __init__(self, store: NoiseNodeStore):
        self.store = store
        self.table, self._restarted = store.segments()
        self._gen: CorrelatedNoise | None = None
        self._round: _Round | None = None
        self._fac: Factorization | None = None
        self._sigma_max: float | None = None

    def identity(self) -> dict:
        """Its node id, long-term public key (raw Ed25519) and the id's signature (the pin)."""
        nid = self.store.node_id
        return {
            "node_id": nid,
            "public_key": self.store.public_key,
            "signature": self.store.sign(id_message(nid)),
        }

    def pin(self, recipe: dict, factorization: bytes) -> dict:
        """Pin the run's recipe (once; a later pin must be the same).

        Args:
            recipe: factorization sha256, σ, clip, δ, rounds and the trainable shapes.
            factorization: the bytes of the factorization file the recipe names.

        Returns:
            ``{"sigma_max": σ·max_t ‖row t of C⁻¹‖}``.

        Raises:
            IntegrityError: the file is not the recipe's, or another recipe is pinned.
        """
        recipe = {k: recipe[k] for k in (*RECIPE_FIELDS, "shapes")}
        check = self.store.dir / ".factorization-check.npz"
        write_bytes(check, factorization)
        try:
            if Factorization.load(check).sha256() != recipe["factorization_sha256"]:
                raise IntegrityError("the factorization file is not the recipe's (sha256 differs)")
        finally:
            check.unlink(missing_ok=True)
        self.store.pin(recipe, factorization)
        return {"sigma_max": self.sigma_max()}

    def factorization(self) -> Factorization:
        """The pinned factorization (loaded once)."""
        if self._fac is None:
            self._fac = Factorization.load(self.store.dir / FACTORIZATION)
        return self._fac

    def sigma_max(self) -> float:
        """σ_max = σ·max_t ‖row t of C⁻¹‖ of the pinned recipe (computed once per process)."""
        if self._sigma_max is None:
            recipe = self._recipe()
            fac = self.factorization()
            self._sigma_max = float(noise_std_per_round(fac, recipe["noise_multiplier"])["max"])
        return self._sigma_max

    def _recipe(self) -> dict:
        recipe = self.store.recipe()
        if recipe is None:
            raise RecipeRefusedError("the noise node has no pinned recipe")
        return recipe

    # -- the stages --------------------------------------------------------------------------------
    def handle(self, stage: str, config: dict) -> dict:
        """Answer one SecAgg+ stage message (its config record as a dict).

        Raises:
            RecipeRefusedError: parameters other than the pinned recipe's, or a cohort below 2.
            ValueError: a message out of order or malformed.
        """
        if stage == Stage.SETUP:
            return self._setup(config)
        if self._round is None:
            raise ValueError(f"{stage} before setup")
        if stage == Stage.SHARE_KEYS:
            return self._share_keys(config)
        if stage == Stage.COLLECT_MASKED_VECTORS:
            return self._collect(config)
        if stage == Stage.UNMASK:
            return self._unmask(config)
        raise ValueError(f"unknown stage {stage!r}")

    def _check_request(self, config: dict) -> None:
        recipe = self._recipe()
        asked = json.loads(str(config.get(RECIPE_KEY, "{}")))
        differ = [k for k in RECIPE_FIELDS if asked.get(k) != recipe[k]]
        if differ:
            raise RecipeRefusedError(
                f"a request for {', '.join(f'{k} = {asked.get(k)!r}' for k in differ)}; the "
                f"pinned recipe has {', '.join(f'{k} = {recipe[k]!r}' for k in differ)}"
            )
        clients = int(config[Key.SAMPLE_NUMBER]) - 1
        if clients < 2:
            raise RecipeRefusedError(
                f"a cohort of {clients} client(s): a secure sum needs at least 2"
            )
        dim = sum(int(np.prod(s)) for s in recipe["shapes"])
        want = secure_sum_params(clients, recipe["clip_norm"], dim, self.sigma_max())
        got = (
            float(config[Key.CLIPPING_RANGE]),
            int(config[Key.TARGET_RANGE]),
            int(config[Key.MOD_RANGE]),
            int(config[Key.THRESHOLD]),
        )
        expected = (want.clipping_range, want.quantization_range, want.modulus, want.threshold)
        if got != expected:
            raise RecipeRefusedError(
                f"SecAgg+ parameters (r, T, M, threshold) = {got}; the recipe gives {expected} "
                f"for {clients} clients"
            )

    def _setup(self, config: dict) -> dict:
        self._round = None
        self._check_request(config)
        r = _Round(dict(config))
        sk1, pk1 = generate_key_pairs()
        sk2, pk2 = generate_key_pairs()
        r.sk1, r.pk1 = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
        r.sk2, r.pk2 = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
        self._round = r
        return {
            Key.PUBLIC_KEY_1: r.pk1,
            Key.PUBLIC_KEY_2: r.pk2,
            SIGNATURE_KEY: self.store.sign(signed_keys_message(r.pk1, r.pk2)),
        }

    def _share_keys(self, config: dict) -> dict:
        r, nid = self._round, self.store.node_id
        keys = {int(k): (v[0], v[1]) for k, v in config.items() if str(k).isdigit()}
        if keys.get(nid) != (r.pk1, r.pk2):
            raise ValueError("the share-keys message does not carry this node's own keys")
        r.public_keys = keys
        # a neighbour of every client: one share per member of the round, not SHARE_NUMBER
        share_num, threshold = len(keys), int(r.config[Key.THRESHOLD])
        if len(keys) < threshold:
            raise ValueError("fewer neighbours than the threshold")
        seed = os.urandom(32)
        r.config["seed"] = seed
        b_shares = create_shares(seed, threshold, share_num)
        s_shares = create_shares(r.sk1, threshold, share_num)
        dsts, texts = [], []
        sk2 = bytes_to_private_key(r.sk2)  # parsed once, not once per client
        for idx, (other, (_, pk2)) in enumerate(keys.items()):
            if other == nid:
                r.seed_shares[nid], r.sk1_shares[nid] = b_shares[idx], s_shares[idx]
                continue
            key = generate_shared_key(sk2, bytes_to_public_key(pk2))
            r.shared[other] = key
            text = encrypt(
                key, share_keys_plaintext_concat(nid, other, b_shares[idx], s_shares[idx])
            )
            dsts.append(other)
            texts.append(text)
        return {Key.DESTINATION_LIST: dsts, Key.CIPHERTEXT_LIST: texts}

    def _collect(self, config: dict) -> dict:
        r, nid = self._round, self.store.node_id
        srcs, texts = config.get(Key.SOURCE_LIST, []), config.get(Key.CIPHERTEXT_LIST, [])
        for src, text in zip(srcs, texts, strict=True):
            actual, dst, seed_share, sk1_share = share_keys_plaintext_separate(
                decrypt(r.shared[src], text)
            )
            if actual != src or dst != nid:
                raise ValueError(f"a share ciphertext from {src} that is not for this node")
            r.seed_shares[src], r.sk1_shares[src] = seed_share, sk1_share
        t = int(config[ROUND_KEY])
        recipe = self._recipe()
        if not 0 <= t < int(recipe["rounds"]):
            raise RecipeRefusedError(
                f"round {t + 1} outside the recipe's {recipe['rounds']} rounds"
            )
        step = 2 * float(r.config[Key.CLIPPING_RANGE]) / int(r.config[Key.TARGET_RANGE])
        inputs, entry = self._draw(t, step)
        modulus = int(r.config[Key.MOD_RANGE])
        vec = [np.zeros(1, np.int64), *inputs, np.zeros(len(ACTIONS), np.int64)]
        shapes = [v.shape for v in vec]
        for v, m in zip(vec, pseudo_rand_gen(r.config["seed"], modulus, shapes), strict=True):
            v += m  # in place: no second copy of the d-vector per mask
        sk1 = bytes_to_private_key(r.sk1)
        for other in srcs:  # the neighbours whose shares arrived added a mask with this node
            key = generate_shared_key(sk1, bytes_to_public_key(r.public_keys[other][0]))
            add = np.add if nid > other else np.subtract
            for v, m in zip(vec, pseudo_rand_gen(key, modulus, shapes), strict=True):
                add(v, m, out=v)
        vec = parameters_mod(vec, modulus)
        return {
            Key.MASKED_PARAMETERS: [ndarray_to_bytes(v) for v in vec],
            SEGMENT_KEY: json.dumps(entry["segment"], sort_keys=True),
            HEAD_KEY: entry["hash"],
        }

    def _unmask(self, config: dict) -> dict:
        r, nid = self._round, self.store.node_id
        active = list(config.get(Key.ACTIVE_NODE_ID_LIST, []))
        dead = list(config.get(Key.DEAD_NODE_ID_LIST, []))
        self._round = None
        if nid in dead:
            raise ValueError("an unmask that declares the noise node dead: refused")
        shares = [r.seed_shares[n] for n in active] + [r.sk1_shares[n] for n in dead]
        return {Key.NODE_ID_LIST: active + dead, Key.SHARE_LIST: shares}

    # -- the noise ---------------------------------------------------------------------------------
    def _draw(self, t: int, step: float) -> tuple[list[np.ndarray], dict]:
        """Row t's grid input, journaled before it is returned (a redo, a restart or a rewound
        server opens a new key segment at t first: no row is ever sent twice)."""
        last = self.store.last_sent_round()
        fresh = self._restarted or (last is not None and last >= t)
        if fresh or self._gen is None or self._gen.next_round != t:
            self._gen = self._rebuild(t, fresh)
        noise = self._gen.next(t)
        inputs = [grid_noise(a, step, MODULUS) for a in noise]
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in inputs))
        entry = self.store.append(t, self.table.segment_for(t).public(), digest.hexdigest())
        self._restarted = False
        self.store.write_report(self.table)
        return inputs, entry

    def _rebuild(self, t: int, fresh: bool) -> CorrelatedNoise:
        """A generator at round t with the stored segments (O(t·d): rows are replayed), and a new
        segment at t when ``fresh`` (saved before anything is drawn with it)."""
        recipe = self._recipe()
        scale = float(recipe["noise_multiplier"]) * float(recipe["clip_norm"])
        shapes = [tuple(s) for s in recipe["shapes"]]
        first = self.table.segments[0]
        gen = CorrelatedNoise(
            self.factorization(), shapes, scale, key=first.key, key_version=first.version
        )
        for j in range(t):
            seg = [s for s in self.table.segments if s.first_round == j and j > 0]
            if seg:
                gen.begin_segment(seg[0].key, seg[0].version)
            gen.next(j)
        later = [s for s in self.table.segments if s.first_round == t and t > 0]
        if fresh:
            gen.begin_segment(new_secret())
        elif later:
            gen.begin_segment(later[0].key, later[0].version)
        if gen.segments != self.table:  # a new segment; segment 0's key is written once
            self.store.save_segments(gen.segments)
        self.table = gen.segments
        return gen
