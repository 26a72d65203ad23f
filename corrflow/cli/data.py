"""``corrflow data``: generate federated datasets in the real on-disk formats, summarise, build a
vocabulary and partition them over Flower nodes (docs "Conventions": ``--json`` prints one object
last; exit 2 on bad input)."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from corrflow.accounting.mechanisms import check_epsilon
from corrflow.cli.common import AsJson, emit, fail
from corrflow.cli.options import Verbosity
from corrflow.data.arxiv import ArxivReader, ArxivSpec, generate_arxiv
from corrflow.data.dp_vocab import dataset_user_texts, dp_vocabulary
from corrflow.data.partition import make_manifest, write_manifest
from corrflow.data.stackoverflow import (
    StackOverflowSpec,
    StackOverflowSQLite,
    generate_stackoverflow,
)
from corrflow.data.stats import dataset_stats, detect_format
from corrflow.data.vocab import Vocabulary, build_vocabulary, count_words
from corrflow.errors import CorrflowError, DataFormatError, InvalidArgumentError
from corrflow.paths import writable_file
from corrflow.planning.resources import check_disk
from corrflow.progress import Progress

data_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Federated datasets: TFF StackOverflow SQLite and arXiv metadata JSON lines.",
)


def _peak_rss_mib() -> float:
    """The process's peak resident memory in MiB."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / (1 << 20)


@data_app.command("generate")
def generate(
    kind: Annotated[str, typer.Argument(help="stackoverflow or arxiv")],
    users: Annotated[int, typer.Option(help="users: StackOverflow accounts, or arXiv authors")],
    out: Annotated[
        Path, typer.Option(help="output file (.sqlite for stackoverflow, .jsonl for arxiv)")
    ],
    seed: Annotated[
        int, typer.Option(help="generator seed (the output is a pure function of it)")
    ] = 0,
    verbose: Verbosity = None,
    as_json: AsJson = False,
) -> None:
    """Write a synthetic dataset of KIND (stackoverflow: TFF's SQLite; arxiv: the metadata
    snapshot's JSON lines) in the real format, streaming to disk in bounded memory."""

    try:
        if kind not in ("stackoverflow", "arxiv"):
            raise InvalidArgumentError("KIND", "stackoverflow or arxiv", kind)
        if users < 1:
            raise InvalidArgumentError("--users", "a positive integer", users)
        writable_file(out, "--out")
        check_disk(users * GENERATED_BYTES_PER_USER[kind], out.parent, "--users")
        started = time.perf_counter()
        with Progress(
            f"generating {kind}", total=users, quiet=verbose is False, unit="users"
        ) as bar:
            if kind == "stackoverflow":
                spec = StackOverflowSpec(users=users, seed=seed)
                counts = generate_stackoverflow(out, spec, progress=bar)
            else:
                spec = ArxivSpec(users=users, seed=seed)
                counts = generate_arxiv(out, spec, progress=bar)
        emit(
            {
                "kind": kind,
                "path": str(out),
                "counts": counts,
                "spec": spec.to_dict(),
                "seconds": round(time.perf_counter() - started, 2),
                "peak_rss_mib": round(_peak_rss_mib(), 1),
                "bytes": out.stat().st_size,
            },
            as_json,
        )
    except CorrflowError as exc:
        fail(exc)


@data_app.command("stats")
def stats(
    path: Annotated[
        Path, typer.Argument(help="a TFF StackOverflow SQLite file or arXiv JSON-lines file")
    ],
    skip_malformed: Annotated[
        bool, typer.Option(help="skip (and count) malformed rows instead of failing")
    ] = False,
    min_authors: Annotated[
        int, typer.Option(help="arXiv: drop papers with fewer authors (004 §7.3 uses 2)")
    ] = 1,
    as_json: AsJson = False,
) -> None:
    """Users, examples, tokens and the quantiles of examples per user and users per example."""
    try:
        emit(
            dataset_stats(
                path, on_error="skip" if skip_malformed else "raise", min_authors=min_authors
            ),
            as_json,
        )
    except CorrflowError as exc:
        fail(exc)


#: A dataset file argument (every `corrflow data` command that reads one).
DatasetFile = Annotated[
    Path, typer.Argument(help="a TFF StackOverflow SQLite file or arXiv JSON-lines file")
]
VocabOut = Annotated[
    Path,
    typer.Option(help="vocabulary file to write (a provenance header, then one word per line)"),
]
VocabSize = Annotated[int, typer.Option(help="most frequent words kept (000 §5.3: 10000)")]
VocabEpsilon = Annotated[
    float,
    typer.Option(
        help="ε of the differentially private vocabulary (the default route); a run using it "
        "takes this ε out of its --target-epsilon"
    ),
]
VocabDelta = Annotated[
    float, typer.Option(help="δ of the private vocabulary (taken out of the run's --delta)")
]
MaxWordsPerUser = Annotated[
    int,
    typer.Option(
        help="Δ₀: distinct words one user may contribute (each with weight 1/√Δ₀: fewer words, "
        "more weight each)"
    ),
]
MaxPapersPerAuthor = Annotated[
    int,
    typer.Option(
        help="arXiv: papers one author may contribute (k_u; each author's removal then changes "
        "≤ k_u papers)"
    ),
]
NoPrivacy = Annotated[
    bool,
    typer.Option(
        "--no-privacy",
        help="count the private data WITHOUT privacy: the vocabulary is published with the model "
        "outside any guarantee, and runs say so",
    ),
]
Public = Annotated[
    bool,
    typer.Option(
        "--public",
        help="FILE is public data: count it without privacy and mark the vocabulary public",
    ),
]
OovBuckets = Annotated[int, typer.Option(help="out-of-vocabulary buckets")]
VocabSplit = Annotated[
    str, typer.Option(help="StackOverflow split counted (train only: no test leakage)")
]


@data_app.command("vocab")
def vocab(
    path: DatasetFile,
    out: VocabOut,
    size: VocabSize = 10_000,
    epsilon: VocabEpsilon = 1.0,
    delta: VocabDelta = 1e-6,
    max_words_per_user: MaxWordsPerUser = 32,
    max_papers_per_author: MaxPapersPerAuthor = 2,
    no_privacy: NoPrivacy = False,
    public: Public = False,
    oov_buckets: OovBuckets = 1,
    split: VocabSplit = "train",
    as_json: AsJson = False,
) -> None:
    """Build the vocabulary of FILE's training split. Default: user-level differentially private top
    words (weighted Gaussian with a threshold; Gopi et al. 2020, "Differentially Private Set Union",
    arXiv 2002.09745): no word only one user wrote appears, except with probability ≤ δ/2.
    --no-privacy counts exactly (outside the guarantee); --public marks a public corpus. The file's
    header records which, and runs report it."""
    try:
        if no_privacy and public:
            raise InvalidArgumentError("--public", "at most one of --no-privacy and --public")
        if size < 1:
            raise InvalidArgumentError("--size", "at least 1 word", size)
        if oov_buckets < 1:
            raise InvalidArgumentError("--oov-buckets", "at least 1", oov_buckets)
        writable_file(out, "--out")
        fmt = detect_format(path)
        if fmt == "stackoverflow-sqlite" and split != "train":
            raise InvalidArgumentError(
                "--split",
                "train (the vocabulary is counted on the training split only: counting the test or "
                "held-out split would leak the evaluation data into the model's vocabulary)",
                split,
            )
        if no_privacy or public:
            v, info = _counted_vocabulary(path, fmt, split, size, oov_buckets, public)
        else:
            v, info = _private_vocabulary(
                path, size, oov_buckets, epsilon, delta, max_words_per_user, max_papers_per_author
            )
        try:
            v.save(out)
        except OSError as exc:  # a mount gone read-only or full between the check and the write
            raise InvalidArgumentError(
                "--out", f"a writable file ({exc.strerror or exc})", str(out)
            ) from None
        emit(
            {
                "path": str(out),
                "words": len(v.words),
                "oov_buckets": oov_buckets,
                "num_tokens": v.num_tokens,
                "provenance": v.provenance,
                **info,
            },
            as_json,
        )
    except CorrflowError as exc:
        fail(exc)


def _counted_vocabulary(
    path: Path, fmt: str, split: str, size: int, oov_buckets: int, public: bool
) -> tuple[Vocabulary, dict]:
    """The top words counted exactly (a public corpus, or --no-privacy, which warns), with the
    coverage they reach."""
    if fmt == "stackoverflow-sqlite":
        with StackOverflowSQLite(path) as db:
            counts = count_words(p.tokens for _, p in db.iter_posts(split))
    else:
        counts = count_words(p.text.lower() for p in ArxivReader(path))
    if not counts:  # an empty vocabulary would only fail every run that loads it
        raise DataFormatError(path, None, f"training examples ({split} split) to count", "none")
    v = build_vocabulary(counts, size, oov_buckets, source="public" if public else "non-private")
    covered, total = sum(counts[w] for w in v.words), sum(counts.values())
    info = {"distinct_words_seen": len(counts), "token_coverage": covered / total if total else 0.0}
    if not public:
        typer.echo(
            "warning: --no-privacy: this vocabulary is counted from the private data without "
            "privacy; it ships with the model outside the run's (ε, δ), and runs report it so",
            err=True,
        )
    return v, info


def _private_vocabulary(
    path: Path,
    size: int,
    oov_buckets: int,
    epsilon: float,
    delta: float,
    max_words_per_user: int,
    max_papers_per_author: int,
) -> tuple[Vocabulary, dict]:
    """The user-level differentially private top words (Gopi et al. 2020), with what the
    mechanism saw and released."""
    check_epsilon(epsilon, "--epsilon")
    if not 0 < delta < 1:
        raise InvalidArgumentError("--delta", "a δ in (0, 1)", delta)
    if max_words_per_user < 1:
        raise InvalidArgumentError("--max-words-per-user", "at least 1", max_words_per_user)
    if max_papers_per_author < 1:
        raise InvalidArgumentError("--max-papers-per-author", "at least 1", max_papers_per_author)
    texts, per_user = dataset_user_texts(path, max_papers_per_author)
    res = dp_vocabulary(
        texts,
        epsilon=epsilon,
        delta=delta,
        size=size,
        oov_buckets=oov_buckets,
        max_words_per_user=max_words_per_user,
        units_per_user=per_user,
    )
    v = res.vocabulary
    info = {
        "users": res.users,
        "candidates": res.candidates,
        "above_threshold": res.released,
        "sigma": res.sigma,
        "threshold": res.threshold,
    }
    if len(v.words) < size:
        typer.echo(
            f"note: {len(v.words)} of the {size} words requested cleared the privacy threshold "
            f"(noisy user count > {res.threshold:.3g}); a larger ε or more users give more",
            err=True,
        )
    return v, info


#: Bytes a generated dataset takes per user, about twice the measured mean (StackOverflow ≈ 2.1 KB,
# arXiv ≈ 0.6 KB at the default specs), so a size that cannot fit on disk is refused up front.
GENERATED_BYTES_PER_USER = {"stackoverflow": 4096, "arxiv": 1024}


@data_app.command("partition")
def partition(
    path: Annotated[
        Path, typer.Argument(help="a TFF StackOverflow SQLite file or arXiv JSON-lines file")
    ],
    out: Annotated[Path, typer.Option(help="manifest JSON to write")],
    partitions: Annotated[
        int | None,
        typer.Option(
            help="nodes (default for StackOverflow: one per user; required for arXiv silos)"
        ),
    ] = None,
    split: Annotated[str, typer.Option(help="StackOverflow split")] = "train",
    seed: Annotated[int, typer.Option(help="arXiv: seed of the example → silo hash")] = 0,
    as_json: AsJson = False,
) -> None:
    """Assign users (or papers) to Flower partitions and print each SuperNode's --node-config."""
    try:
        manifest = make_manifest(path, partitions, split=split, seed=seed)
        write_manifest(manifest, out)
        parts = manifest["partitions"]
        key = "users" if parts and "users" in parts[0] else "items"
        sizes = [len(p[key]) for p in parts]
        emit(
            {
                "manifest": str(out),
                "format": manifest["format"],
                "num_partitions": manifest["num_partitions"],
                f"{key}_per_partition_min": min(sizes),
                f"{key}_per_partition_max": max(sizes),
                "node_config_example": parts[0]["node_config"],
            },
            as_json,
        )
    except CorrflowError as exc:
        fail(exc)
