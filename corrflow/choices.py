"""The named choices every layer shares: participations, samplings, accountants, identities,
policies, clients, modes and reply kinds, as string enums (the CLI shows them as choices), plus the
one table of which accountants apply to which sampling. Factorization kinds live in their registry
(`corrflow.factorization.registry.KINDS`).

Bottom layer: imports nothing of corrflow, so accounting, participation, planning and the settings
model can all use it.
"""

from __future__ import annotations

from enum import StrEnum


class Participation(StrEnum):
    """Who may train when (004): fixed-epoch groups, the b-min-sep sampler (one item per user, or
    several with multi-attribution), Poisson sampling in every round, or cyclic Poisson over b
    groups (001 §2, 002)."""

    FIXED_EPOCH = "fixed-epoch"
    BMINSEP = "bminsep"
    MULTI_ATTRIBUTION = "multi-attribution"
    POISSON = "poisson"
    CYCLIC_POISSON = "cyclic-poisson"


class Sampling(StrEnum):
    """The randomness an accountant may assume (``none``: a deterministic pattern, no
    amplification)."""

    NONE = "none"
    CYCLIC_POISSON = "cyclic-poisson"
    POISSON = "poisson"
    BMINSEP = "bminsep"
    BALLS_IN_BINS = "balls-in-bins"
    MULTI_ATTRIBUTION = "multi-attribution"


class Accountant(StrEnum):
    """How ε is computed: one Gaussian of the (k, b) sensitivity (000 App. D.2); ⌈n/b⌉ subsampled
    Gaussians (001 Prop. 2.1); 004's Monte Carlo with Estimate-Verify-Release; MMCC (002 Alg. 1 /
    Alg. 3)."""

    UNAMPLIFIED = "unamplified"
    CYCLIC_POISSON = "cyclic-poisson"
    MONTE_CARLO = "monte-carlo"
    MMCC = "mmcc"


class Identity(StrEnum):
    """Where a node's stable user id comes from (``corrflow.strategies.identity``)."""

    NODE_KEY = "node-key"
    USER_ID = "user-id"
    PARTITION_ID = "partition-id"
    PER_LAUNCH = "per-launch"


class Policy(StrEnum):
    """What happens to an item whose users would break the design min-sep: refused, or included and
    accounted post hoc."""

    REJECT = "reject"
    ACCEPT_AND_ACCOUNT = "accept-and-account"


class Client(StrEnum):
    """The training task: corrflow's regression, numpy next-word and Keras next-word ClientApps, or
    ``app``, the user's own ClientApp behind the wrapper (corrflow then knows nothing of its
    training)."""

    NUMPY = "numpy"
    NEXTWORD = "nextword"
    KERAS = "keras"
    APP = "app"


class Mode(StrEnum):
    """Cross-device (an item is a SuperNode) or cross-silo (an item is an example a silo holds)."""

    CROSS_DEVICE = "cross-device"
    CROSS_SILO = "cross-silo"


class Replies(StrEnum):
    """What a client's reply holds: full weights (Flower's quickstarts) or the update (a delta)."""

    WEIGHTS = "weights"
    DELTA = "delta"


#: The sampling an accountant may assume under each participation.
SAMPLING_OF = {
    Participation.FIXED_EPOCH: Sampling.NONE,
    Participation.BMINSEP: Sampling.BMINSEP,
    Participation.MULTI_ATTRIBUTION: Sampling.MULTI_ATTRIBUTION,
    Participation.POISSON: Sampling.POISSON,
    Participation.CYCLIC_POISSON: Sampling.CYCLIC_POISSON,
}

#: Accountants that can analyse each sampling; the first is the default. Cyclic Poisson: 001 Prop.
# 2.1 (≤ b bands) or Generalized-MMCC (002 App. D); Poisson: MMCC (002 Alg. 1) or Monte Carlo over
# the exact likelihood of a banded encoder (≤ 12 bands); b-min-sep, balls-in-bins,
# multi-attribution: 004's Monte Carlo (Eq. 1, Thm 6.1).
ACCOUNTANTS_FOR = {
    Sampling.NONE: (Accountant.UNAMPLIFIED,),
    Sampling.CYCLIC_POISSON: (Accountant.CYCLIC_POISSON, Accountant.MMCC),
    Sampling.POISSON: (Accountant.MMCC, Accountant.MONTE_CARLO),
    Sampling.BMINSEP: (Accountant.MONTE_CARLO,),
    Sampling.BALLS_IN_BINS: (Accountant.MONTE_CARLO,),
    Sampling.MULTI_ATTRIBUTION: (Accountant.MONTE_CARLO,),
}


def accountants_for_participation(participation: str) -> tuple[Accountant, ...]:
    """Accountants a run with ``participation`` may use: its sampling's, and ``unamplified``
    wherever the pattern bounds participation deterministically (every participation but Poisson,
    which has no minimum separation)."""
    part = Participation(participation)
    amplified = ACCOUNTANTS_FOR[SAMPLING_OF[part]]
    if part == Participation.POISSON or Accountant.UNAMPLIFIED in amplified:
        return amplified
    return (Accountant.UNAMPLIFIED, *amplified)


def values(enum: type[StrEnum]) -> tuple[str, ...]:
    return tuple(member.value for member in enum)


class Backend(StrEnum):
    """What runs a simulation's clients: Flower's simulation engine (Ray), corrflow's in-process
    grid (Flower messages, one ClientApp call per client), or the cohort engine (a round's clients
    trained together on stacked weights, no messages; corrflow's numpy and nextword tasks)."""

    FLOWER = "flower"
    INPROCESS = "inprocess"
    COHORT = "cohort"
