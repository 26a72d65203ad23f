"""A differentially private vocabulary: user-level DP top-k words by the weighted Gaussian mechanism
with a threshold.

Method (Gopi, Gulhane, Kulkarni, Shen, Shokouhi, Yekhanin 2020, "Differentially Private Set Union",
arXiv 2002.09745, §3 — the Gaussian weighted baseline, after Korolova, Kenthapadi, Mishra, Ntoulas
2009, "Releasing Search Queries and Clicks Privately", and Wilson et al. 2019, "Differentially
Private SQL with Bounded User Contribution", arXiv 1909.01917):

1. each user keeps at most Δ₀ = ``max_words_per_user`` distinct words (their own most frequent, ties
   by the word);
2. a user with t kept words adds 1/√t to each of them: a user's whole contribution has ℓ2 norm
   exactly 1;
3. every word that any user kept gets Gaussian noise N(0, σ²) on its weighted count, with σ the
   analytic Gaussian mechanism's for sensitivity 1 at (ε, δ/2) (Balle, Wang 2018, "Improving the
   Gaussian Mechanism for Differential Privacy", arXiv 1805.06530, Thm 8);
4. words whose noisy count exceeds ρ = max_{1≤t≤Δ₀} (1/√t + σ Φ⁻¹((1 − δ/2)^{1/t})) are released,
   the ``size`` largest noisy counts first (post-processing).

Why (ε, δ): for neighbouring data sets differing in one user, the counts of words both share differ
by a vector of ℓ2 norm ≤ 1 — the Gaussian mechanism, (ε, δ/2); a word only that user holds has count
exactly 1/√t, and the chance that any of its ≤ t such words clears ρ is 1 − Φ((ρ − 1/√t)/σ)^t ≤ δ/2
by the choice of ρ. Together (ε, δ). So a word used by a single user appears with probability at
most δ/2 over all such words of that user.

Multi-attribution (arXiv: a paper belongs to all its authors, 004 §6). The unit that contributes a
word set is the paper, and each author keeps at most k = ``units_per_user`` papers (greedy
contribution bounding on the public attribution graph, 004 §3.1). Removing an author removes ≤ k
papers, so the shared-word difference has ℓ2 norm ≤ k (σ scales by k) and each of the ≤ k·Δ₀ words
only that author's papers hold has count ≤ k; the threshold is then ρ = k + σ Φ⁻¹((1 −
δ/2)^{1/(k·Δ₀)}), the conservative form of the one above.

The noise comes from the operating system's entropy (never a seed: a seeded draw would let anyone
reproduce it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from corrflow.accounting.mechanisms import check_epsilon, gaussian_noise_multiplier
from corrflow.data.federated import TextSource, _sentences
from corrflow.data.stackoverflow import StackOverflowSQLite
from corrflow.data.stats import detect_format
from corrflow.data.vocab import Vocabulary
from corrflow.errors import require
from corrflow.participation.attribution import bound_contributions

#: Δ₀: distinct words one user may contribute (each with weight 1/√t). Larger keeps more of a
# prolific user's words but spreads their weight thinner (a word needs about √Δ₀ times more users
# to clear the threshold).
MAX_WORDS_PER_USER = 32


def gaussian_sigma(epsilon: float, delta: float) -> float:
    """σ of the analytic Gaussian mechanism (sensitivity 1) that is (ε, δ)-DP (Balle & Wang 2018,
    arXiv 1805.06530, Thm 8: δ(σ) = Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ), decreasing in σ): the
    accountants' certified root, rounded up, so the vocabulary's δ never exceeds what it reports."""
    check_epsilon(epsilon, "epsilon")
    require(0 < delta < 1, "delta", "a δ in (0, 1)", delta)

    return gaussian_noise_multiplier(epsilon, delta)


def threshold(
    sigma: float, delta: float, max_words_per_user: int, units_per_user: int = 1
) -> float:
    """ρ = max over t ≤ Δ₀ of 1/√t + σ Φ⁻¹((1 − δ/2)^{1/t}): a user's unique words clear it w.p. ≤
    δ/2. With k units per user (multi-attribution): k + σ Φ⁻¹((1 − δ/2)^{1/(kΔ₀)})."""
    from scipy.stats import norm  # lazy: scipy.stats's import slows every CLI start

    if units_per_user > 1:
        m = units_per_user * max_words_per_user
        return float(units_per_user + sigma * norm.isf(-np.expm1(np.log1p(-delta / 2) / m)))
    t = np.arange(1, max_words_per_user + 1, dtype=np.float64)
    # (1 − δ/2)^{1/t} in log space: Φ⁻¹(exp(log1p(−δ/2)/t)); isf of 1 − that keeps the precision
    # near 1.
    tail = -np.expm1(np.log1p(-delta / 2) / t)
    return float(np.max(1 / np.sqrt(t) + sigma * norm.isf(tail)))


@dataclass(frozen=True)
class DPVocabularyResult:
    vocabulary: Vocabulary
    sigma: float
    threshold: float
    candidates: int  # distinct words any user kept
    released: int  # words above the threshold (before the size cut)
    users: int


def user_word_sets(
    user_texts: Iterable[Iterable[str]], max_words_per_user: int
) -> Iterable[list[str]]:
    """Each user's kept words: their ``max_words_per_user`` most frequent distinct words (ties by
    the word)."""
    for texts in user_texts:
        counts: Counter = Counter()
        for text in texts:
            counts.update(text.split())
        yield [
            w
            for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:max_words_per_user]
        ]


def dp_vocabulary(
    user_texts: Iterable[Iterable[str]],
    *,
    epsilon: float,
    delta: float,
    size: int,
    oov_buckets: int = 1,
    max_words_per_user: int = MAX_WORDS_PER_USER,
    units_per_user: int = 1,
    rng: np.random.Generator | None = None,
) -> DPVocabularyResult:
    """The (ε, δ)-DP vocabulary of ``user_texts`` (one iterable of texts per contributing unit: a
    user, or with ``units_per_user`` = k > 1 one of a user's at most k bounded items) — the method
    of the module docstring. ``rng`` is for tests only; a real build draws from the OS's entropy."""
    require(size >= 1, "size", "at least 1", size)
    require(max_words_per_user >= 1, "max-words-per-user", "at least 1", max_words_per_user)
    require(units_per_user >= 1, "units_per_user", "at least 1", units_per_user)
    sigma = units_per_user * gaussian_sigma(epsilon, delta / 2)
    rho = threshold(sigma, delta, max_words_per_user, units_per_user)
    weights: Counter = Counter()
    users = 0
    for words in user_word_sets(user_texts, max_words_per_user):
        users += 1
        if words:
            w = 1.0 / math.sqrt(len(words))
            for word in words:
                weights[word] += w
    # a fixed order, so the noise draw does not depend on insertion order
    vocab_words = sorted(weights)
    counts = np.fromiter((weights[w] for w in vocab_words), np.float64, len(vocab_words))
    noisy = counts + (rng or np.random.default_rng()).normal(0.0, sigma, size=len(counts))
    above = np.flatnonzero(noisy > rho)
    order = above[np.argsort(-noisy[above], kind="stable")][:size]
    provenance = {
        "source": "dp",
        "epsilon": float(epsilon),
        "delta": float(delta),
        "method": "gaussian-weighted-threshold",
        "max_words_per_user": max_words_per_user,
        **({"max_items_per_user": units_per_user} if units_per_user > 1 else {}),
        "sigma": float(f"{sigma:.6g}"),
        "threshold": float(f"{rho:.6g}"),
    }
    vocab = Vocabulary([vocab_words[i] for i in order], oov_buckets, provenance)
    return DPVocabularyResult(vocab, sigma, rho, len(vocab_words), len(above), users)


def dataset_user_texts(path, max_papers_per_author: int = 2) -> tuple[Iterable[list[str]], int]:
    """(texts per contributing unit, units per user). StackOverflow: each ``train`` client's posts,
    one unit per user. arXiv: each training paper (held-out authors' papers excluded), after
    bounding every author to ``max_papers_per_author`` papers on the public attribution graph — k
    units per user."""

    if detect_format(path) == "stackoverflow-sqlite":
        return _sqlite_user_texts(path), 1

    papers = TextSource(str(path), "-").training_papers()
    graph = TextSource(str(path), "-").attribution()
    kept = bound_contributions(graph, max_papers_per_author).kept
    return ([*_sentences(papers[i].text)] for i in kept), max_papers_per_author


def _sqlite_user_texts(path) -> Iterable[list[str]]:

    with StackOverflowSQLite(path) as db:
        for client in db.client_ids("train"):
            yield [p.tokens for p in db.client_posts(client, "train")]
