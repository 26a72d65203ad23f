"""Run configuration of the correlated-noise strategy: a dataclass, read from Flower's run config (kebab-case keys
under the ``corrflow.`` prefix, so that they coexist with the user's own keys).

Unknown keys inside the prefix are an error naming the key; values are type-checked against the defaults' types.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from corrflow.errors import InvalidArgumentError, require

POLICIES = ("reject", "accept-and-account")
# Where a node's stable user id comes from (the server cannot see whether SuperNode authentication is on, so the
# operator declares it): see corrflow.strategies.identity. "" = partition-id in simulation, node-key in deployment.
IDENTITIES = ("node-key", "user-id", "partition-id", "per-launch")
PREFIX = "corrflow."   # corrflow's keys in Flower's run config; every other key is the user's app's
PARTICIPATIONS = ("fixed-epoch", "bminsep", "multi-attribution", "poisson", "cyclic-poisson")
ACCOUNTANTS = ("unamplified", "monte-carlo", "mmcc", "cyclic-poisson")
#: Accountants valid for each participation (poisson needs MMCC: no fixed pattern bounds it without sampling).
ACCOUNTANTS_BY_PARTICIPATION = {"fixed-epoch": ("unamplified",), "bminsep": ("unamplified", "monte-carlo"),
                                "multi-attribution": ("unamplified", "monte-carlo"), "poisson": ("mmcc",),
                                "cyclic-poisson": ("unamplified", "mmcc", "cyclic-poisson")}   # 001 Prop. 2.1


@dataclass(frozen=True)
class StrategyConfig:
    num_users: int = 50
    num_rounds: int = 20
    epochs: int = 2
    kind: str = "toeplitz"
    bands: int = 0                  # 0: the factorization's default (min-sep)
    buffers: int = 0                # blt: buffers B; 0: chosen by the optimiser
    taper: int = 0                  # toeplitz: b₀ of the 001 App. H taper when min-sep is uncertain; 0 = none
    noise_multiplier: float = 0.0   # 0: calibrate from target_epsilon
    target_epsilon: float = 0.0     # 0: no target (then noise_multiplier is required)
    delta: float = 1e-5
    clip_norm: float = 1.0
    zeroing_factor: float = 100.0   # 000 App. F.3: zero updates with ℓ∞ > factor·clip (0 disables)
    server_lr: float = 0.5          # numpy-client defaults; see corrflow.clients.tasks.TRAINING_DEFAULTS
    momentum: float = 0.5
    cooldown_fraction: float = 0.25
    local_lr: float = 0.1
    local_steps: int = 5
    schedule_seed: int = 0          # public: fixed-epoch groups, k_u bounding, unamplified samplers (amplified: a key)
    seed: int = 0                   # the task's data and model initialisation (never the noise key)
    policy: str = "reject"
    model_dim: int = 20
    client: str = "numpy"
    data: str = "stackoverflow"
    data_path: str = ""             # keras client: a TFF StackOverflow SQLite file ("" = generated on the fly)
    vocab_path: str = ""            # its vocabulary (corrflow data vocab)
    seq_len: int = 20               # next-word sequence length for data-path
    state_dir: str = "corrflow_state"
    non_private: bool = False       # baseline only: no noise, no privacy guarantee (ε reported as null)
    # Participation control (004): who trains when, at the level of users (persons) behind items.
    participation: str = "fixed-epoch"   # fixed-epoch | bminsep | multi-attribution | poisson | cyclic-poisson
    min_sep: int = 0                # b; 0: num-rounds / epochs
    participation_rate: float = 0.0  # p0 per item and round for bminsep / multi-attribution; 0: 1/(2b)
    accountant: str = "unamplified"  # unamplified | monte-carlo (bminsep / multi-attribution, 004 Eq. 1, Thm 6.1)
    #                                  | mmcc (poisson / cyclic-poisson, 002 Alg. 1 / Alg. 3)
    mc_samples: int = 100_000
    mode: str = "cross-device"      # cross-device (item = a SuperNode) | cross-silo (item = an example in a silo)
    attribution_path: str = ""      # items → users (CSV / JSON lines / arXiv metadata); "" = each item its own user
    manifest_path: str = ""         # cross-silo: partition manifest (corrflow data partition) item → silo
    max_items_per_user: int = 0     # k_u: greedy contribution bounding (004 §6); 0 = no bounding
    replies: str = ""               # weights (full weights, as Flower's quickstarts) | delta; "": weights cross-device,
                                    # delta cross-silo (a silo returns the sum of its per-item clipped updates)
    identity: str = ""              # node-key | user-id | partition-id | per-launch; "" = the engine's default
    max_empty_rounds: int = 3       # stop after this many consecutive rounds without an accepted reply (0: never)
    node_timeout: float = 600.0     # seconds to wait for the population's SuperNodes, and for replies each round

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "target_epsilon", "participation_rate", "server_lr", "local_lr",
                     "momentum", "cooldown_fraction", "zeroing_factor", "delta"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, name.replace("_", "-"), "a finite number ≥ 0", value)
        if self.noise_multiplier > 0:  # fail before a PLD library call could blow up on a tiny σ
            from corrflow.accounting.mechanisms import check_pld_size, check_sigma

            check_sigma(self.noise_multiplier, "noise-multiplier")
            check_pld_size(self.noise_multiplier, 1.0, "noise-multiplier")   # every factorization has sensitivity 1
        for name in ("server_lr", "local_lr"):   # a zero rate trains nothing while the noise is still spent
            require(getattr(self, name) > 0, name.replace("_", "-"), "a learning rate > 0", getattr(self, name))
        require(self.local_steps >= 1, "local-steps", "a positive integer", self.local_steps)
        for name in ("seed", "schedule_seed"):   # numpy seeds are non-negative integers
            require(getattr(self, name) >= 0, name.replace("_", "-"), "an integer ≥ 0", getattr(self, name))
        require(self.num_users >= 1, "num-users", "a positive integer", self.num_users)
        require(self.num_rounds >= 1, "num-rounds", "a positive integer", self.num_rounds)
        require(self.participation in PARTICIPATIONS, "participation", f"one of {PARTICIPATIONS}",
                self.participation)
        if self.participation == "fixed-epoch":
            require(self.epochs >= 1 and self.num_rounds % self.epochs == 0, "epochs",
                    f"a positive divisor of num-rounds={self.num_rounds} (fixed-epoch participation)", self.epochs)
            require(self.min_sep in (0, self.num_rounds // self.epochs), "min-sep",
                    "0 or num-rounds/epochs for fixed-epoch participation", self.min_sep)
            require(self.mode == "cross-silo" or self.num_users >= self.b, "num-users",
                    f"at least rounds/epochs = {self.b} so every round has a cohort", self.num_users)
            require(self.participation_rate == 0, "participation-rate",
                    "0 for fixed-epoch participation (every user trains once per epoch; the rate is a sampler's)",
                    self.participation_rate)
        else:
            require(self.epochs >= 1, "epochs", "a positive integer", self.epochs)
            require(1 <= self.b <= self.num_rounds, "min-sep", f"in [1, num-rounds = {self.num_rounds}]", self.b)
            require(0 <= self.participation_rate <= 1.0 / self.b, "participation-rate",
                    f"in (0, 1/min-sep = {1 / self.b:g}], or 0 for the default 1/(2·min-sep)", self.participation_rate)
        require(self.taper == 0 or (self.kind == "toeplitz" and 1 <= self.taper < (self.bands or self.b)),
                "taper", "0, or with kind toeplitz a lower min-sep b₀ below the bands", self.taper)
        from corrflow.factorization.blt import MAX_BUFFERS

        require(self.buffers == 0 or (self.kind == "blt" and 1 <= self.buffers <= MAX_BUFFERS), "buffers",
                f"0, or with kind blt a number of buffers between 1 and {MAX_BUFFERS}", self.buffers)
        require(self.accountant in ACCOUNTANTS, "accountant", f"one of {ACCOUNTANTS}", self.accountant)
        require(self.accountant in ACCOUNTANTS_BY_PARTICIPATION[self.participation], "accountant",
                f"one of {ACCOUNTANTS_BY_PARTICIPATION[self.participation]} for participation {self.participation} "
                "(monte-carlo: bminsep or multi-attribution, 004; mmcc: poisson or cyclic-poisson, 002)",
                self.accountant)
        require(self.participation != "poisson" or self.min_sep == 1, "min-sep",
                "1 for poisson participation (a user may train in any round)", self.min_sep)
        require(self.mode in ("cross-device", "cross-silo"), "mode", "cross-device or cross-silo", self.mode)
        require(self.mode == "cross-device" or bool(self.manifest_path), "manifest-path",
                "a partition manifest (corrflow data partition) in cross-silo mode")
        require(self.max_items_per_user >= 0, "max-items-per-user", "≥ 0 (0: no bounding)", self.max_items_per_user)
        require(self.mc_samples >= 1000, "mc-samples", "at least 1000", self.mc_samples)
        require(self.non_private or self.noise_multiplier > 0 or self.target_epsilon > 0, "noise-multiplier",
                "a positive noise multiplier or a positive target-epsilon (or non-private for a baseline)")
        require(not (self.non_private and (self.noise_multiplier > 0 or self.target_epsilon > 0)), "non-private",
                "no noise-multiplier or target-epsilon with a non-private baseline")
        require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        require(math.isfinite(self.clip_norm) and self.clip_norm > 0, "clip-norm", "a finite positive number",
                self.clip_norm)
        from corrflow.factorization.build import KINDS

        require(self.kind in KINDS, "kind", f"one of {KINDS}", self.kind)
        for name in ("attribution_path", "manifest_path", "data_path", "vocab_path"):
            path = getattr(self, name)
            require(not path or Path(path).is_file(), name.replace("_", "-"), "an existing file", path)
        require(self.replies in ("", "weights", "delta"), "replies", "weights or delta", self.replies)
        require(self.mode == "cross-device" or self.reply_kind == "delta", "replies",
                "delta in cross-silo mode (a silo returns the sum of its per-item clipped updates)", self.replies)
        require(self.identity in ("",) + IDENTITIES, "identity", f"one of {IDENTITIES}", self.identity)
        require(self.max_empty_rounds >= 0, "max-empty-rounds", "≥ 0 (0: never stop for empty rounds)",
                self.max_empty_rounds)
        require(math.isfinite(self.node_timeout) and self.node_timeout > 0, "node-timeout",
                "a finite positive number of seconds", self.node_timeout)
        require(self.zeroing_factor >= 0, "zeroing-factor", "≥ 0 (0 disables zeroing)", self.zeroing_factor)
        require(0 <= self.momentum < 1, "momentum", "a number in [0, 1)", self.momentum)
        require(self.policy in POLICIES, "policy", f"one of {POLICIES}", self.policy)
        require(self.client in ("numpy", "nextword", "keras"), "client", "numpy, nextword or keras", self.client)
        require(not self.data_path or (self.client == "keras" and bool(self.vocab_path)), "data-path",
                "client = keras and a vocab-path when a data file is given")

    @property
    def reply_kind(self) -> str:
        """What a reply holds: "weights" or "delta" (``replies``, or the mode's default)."""
        return self.replies or ("delta" if self.mode == "cross-silo" else "weights")

    @property
    def b(self) -> int:
        """The design min-sep: ``min-sep`` when set, else num-rounds / epochs."""
        return self.min_sep or self.num_rounds // self.epochs

    @property
    def max_participations(self) -> int:
        """k: the most distinct rounds one user may contribute to."""
        if self.participation == "fixed-epoch":
            return self.epochs
        return -(-self.num_rounds // self.b)

    @classmethod
    def from_run_config(cls, run_config: dict, **overrides) -> StrategyConfig:
        """Read the ``corrflow.``-prefixed keys of Flower's run config (``[tool.flwr.app.config.corrflow]`` in a
        pyproject, or ``-c 'corrflow.num-rounds=10'``); other keys belong to the user's app and are left alone.
        An unknown key inside the prefix, or a value of the wrong type, is an error naming the key."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        values = dict(overrides)
        for full_key, value in run_config.items():
            if not full_key.startswith(PREFIX):
                continue
            key = full_key[len(PREFIX):]
            if key not in known:
                raise InvalidArgumentError(full_key, f"a known corrflow run-config key ({PREFIX}"
                                           f"{{{', '.join(sorted(known))}}})", value)
            f = known[key]
            default = f.default
            if isinstance(value, bool) and not isinstance(default, bool):
                raise InvalidArgumentError(full_key, f"a {type(default).__name__}, not a boolean", value)
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(full_key, "true or false", value)
                values[f.name] = value
                continue
            try:
                values[f.name] = type(default)(value)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(full_key, f"a {type(default).__name__}", value) from exc
            if isinstance(default, int) and float(value) != values[f.name]:
                raise InvalidArgumentError(full_key, "an integer", value)
        return cls(**values)

    @staticmethod
    def unprefixed_keys(run_config: dict) -> list[str]:
        """Keys outside the prefix that match a corrflow setting: probably meant for corrflow (worth a warning)."""
        known = {f.name.replace("_", "-") for f in fields(StrategyConfig)}
        return sorted(k for k in run_config if k in known)

    def to_dict(self) -> dict:
        return asdict(self)

    def run_settings(self) -> dict:
        """The settings that fix the mechanism and the data order (a restart must match them)."""
        d = self.to_dict()
        for operational in ("state_dir", "max_empty_rounds", "node_timeout"):
            d.pop(operational)
        if not d["buffers"]:   # runs recorded before the field existed resume: 0 (chosen by the optimiser) is absent
            d.pop("buffers")
        return d

    def fingerprint(self) -> str:
        """Hash of :meth:`run_settings`."""
        return hashlib.sha256(json.dumps(self.run_settings(), sort_keys=True).encode()).hexdigest()
