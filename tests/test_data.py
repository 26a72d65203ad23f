"""Federated text datasets: real-format loaders (TFF SQLite, arXiv JSON lines), generators,
vocabulary, stats, partitioning and the ``corrflow data`` CLI."""

import json
import sqlite3

import numpy as np
import pytest

from corrflow.data.arxiv import (
    ArxivReader,
    ArxivSpec,
    arxiv_attribution,
    generate_arxiv,
    normalize_author,
    split_authors,
)
from corrflow.data.lexicon import Lexicon
from corrflow.data.partition import load_manifest, make_manifest, node_config, write_manifest
from corrflow.data.stackoverflow import (
    Post,
    StackOverflowSpec,
    StackOverflowSQLite,
    generate_stackoverflow,
    synthetic_user,
)
from corrflow.data.stats import dataset_stats
from corrflow.data.tfexample import ProtoError, decode_example, encode_example
from corrflow.data.vocab import BOS, EOS, PAD, Vocabulary, build_vocabulary, count_words
from corrflow.errors import DataFormatError, InvalidArgumentError

# ----------------------------------------------------------------------------------------------
# tf.train.Example


def test_example_codec_round_trip_and_known_bytes():
    feats = {
        "tokens": "how do i",
        "tags": b"python|numpy",
        "score": np.array([-3, 0, 300], np.int64),
        "w": np.array([1.5, -2.0], np.float32),
        "empty": [],
    }
    back = decode_example(encode_example(feats))
    assert (
        back["tokens"] == [b"how do i"]
        and back["tags"] == [b"python|numpy"]
        and back["empty"] == []
    )
    np.testing.assert_array_equal(back["score"], [-3, 0, 300])
    np.testing.assert_array_equal(back["w"], [1.5, -2.0])
    # Hand-assembled wire bytes of Example{features{feature{key:"a" value{int64_list{value:[1]}}}}}
    entry = b"\x0a\x01a" + b"\x12\x05" + b"\x1a\x03\x0a\x01\x01"
    assert (
        encode_example({"a": np.array([1], np.int64)})
        == b"\x0a" + bytes([len(entry) + 2]) + b"\x0a" + bytes([len(entry)]) + entry
    )
    with pytest.raises(ProtoError):
        decode_example(encode_example(feats)[:-3])


def test_example_codec_matches_tensorflow():
    tf = pytest.importorskip("tensorflow")
    ex = tf.train.Example(
        features=tf.train.Features(
            feature={
                "tokens": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a b c"])),
                "score": tf.train.Feature(int64_list=tf.train.Int64List(value=[7, -1])),
                "f": tf.train.Feature(float_list=tf.train.FloatList(value=[0.25])),
            }
        )
    )
    ours = decode_example(ex.SerializeToString())
    assert (
        ours["tokens"] == [b"a b c"]
        and ours["score"].tolist() == [7, -1]
        and ours["f"].tolist() == [0.25]
    )
    parsed = tf.train.Example.FromString(
        encode_example(
            {
                "tokens": "a b c",
                "score": np.array([7, -1], np.int64),
                "f": np.array([0.25], np.float32),
            }
        )
    )
    assert parsed == ex


# ----------------------------------------------------------------------------------------------
# StackOverflow


def _tiny_tff_sqlite(path, extra_rows=()):
    """Hand-written file in TFF's schema (as tff.simulation.datasets.stackoverflow ships it)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,
                               serialized_example_proto BLOB NOT NULL);
        CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL,
                                      num_examples INTEGER NOT NULL);""")
    rows = [
        (
            "train",
            "00000001",
            Post(
                "how do i sort a list",
                "sorting",
                ("python", "list"),
                "question",
                3,
                "2010-01-01 00:00:00 UTC",
            ),
        ),
        ("train", "00000001", Post("use sorted", type="answer", score=5)),
        ("train", "00000002", Post("the list is empty")),
        ("heldout", "00000003", Post("sort the list")),
        ("test", "00000001", Post("a later post")),
    ]
    db.executemany(
        "INSERT INTO examples VALUES (?, ?, ?)", [(s, c, p.to_proto()) for s, c, p in rows]
    )
    db.executemany("INSERT INTO examples VALUES (?, ?, ?)", list(extra_rows))
    db.executemany(
        "INSERT INTO client_metadata VALUES (?, ?, ?)",
        [
            ("00000001", "train", 2),
            ("00000002", "train", 1),
            ("00000003", "heldout", 1),
            ("00000001", "test", 1),
        ],
    )
    db.commit()
    db.close()
    return rows


def test_tiny_handwritten_sqlite_loads(tmp_path):
    path = tmp_path / "so.sqlite"
    rows = _tiny_tff_sqlite(path)
    with StackOverflowSQLite(path) as db:
        assert db.splits() == ["heldout", "test", "train"]
        assert db.client_ids("train") == ["00000001", "00000002"]
        assert db.num_examples("train") == {"00000001": 2, "00000002": 1}
        posts = db.client_posts("00000001", "train")
        assert posts == [rows[0][2], rows[1][2]]
        assert (
            posts[0].tags == ("python", "list")
            and posts[0].score == 3
            and posts[0].type == "question"
        )
        assert [c for c, _ in db.iter_posts("train")] == ["00000001", "00000001", "00000002"]
        with pytest.raises(
            DataFormatError, match=r"split one of \['heldout', 'test', 'train'\].*'validation'"
        ):
            db.client_ids("validation")


def test_sqlite_malformed_inputs(tmp_path):
    missing = tmp_path / "missing.sqlite"
    db = sqlite3.connect(missing)
    db.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT)")
    db.commit()
    db.close()
    with pytest.raises(DataFormatError, match="missing.sqlite:table client_metadata"):
        StackOverflowSQLite(missing)
    db = sqlite3.connect(missing)
    db.execute(
        "CREATE TABLE client_metadata (client_id TEXT, split_name TEXT, num_examples INTEGER)"
    )
    db.commit()
    db.close()
    with pytest.raises(
        DataFormatError, match=r"table examples.*missing \['serialized_example_proto'\]"
    ):
        StackOverflowSQLite(missing)
    (tmp_path / "text.sqlite").write_text("not a database at all, just text" * 10)
    with pytest.raises(DataFormatError, match="an SQLite database"):
        StackOverflowSQLite(tmp_path / "text.sqlite")
    bad = tmp_path / "bad.sqlite"
    _tiny_tff_sqlite(
        bad,
        extra_rows=[
            ("train", "00000002", b"\x0a\x05garbage"),
            ("train", "00000002", encode_example({"title": "no tokens"})),
        ],
    )
    with (
        StackOverflowSQLite(bad) as db,
        pytest.raises(
            DataFormatError,
            match=r"bad.sqlite:examples row 6 \(client 00000002\)",
        ),
    ):
        db.client_posts("00000002")
    with StackOverflowSQLite(bad, on_error="skip") as db:
        assert len(db.client_posts("00000002")) == 1 and db.skipped == 2


def test_generated_stackoverflow_round_trip_and_shape(tmp_path):
    spec = StackOverflowSpec(users=400, seed=3)
    path = tmp_path / "gen.sqlite"
    counts = generate_stackoverflow(path, spec)
    assert not (tmp_path / "gen.sqlite.partial").exists()
    with StackOverflowSQLite(path) as db:
        total = sum(len(db.client_ids(s)) for s in db.splits())
        assert total == 400 and sum(c["clients"] for c in counts.values()) == 400
        cid = db.client_ids("train")[5]
        split, posts = synthetic_user(spec, int(cid))
        assert split == "train" and db.client_posts(cid) == posts  # regenerable per user
    stats = dataset_stats(path)
    assert stats["users"] == 400 and stats["examples"] == sum(
        c["examples"] for c in counts.values()
    )
    # Pareto(α) posts per user with minimum m: median ≈ m·2^(1/α), P(X ≥ 10) ≈ (m/10)^α.
    per_user = stats["examples_per_user"]
    assert per_user["p0"] == spec.posts_min
    assert abs(per_user["p50"] - np.floor(spec.posts_min * 2 ** (1 / spec.posts_alpha))) <= 1
    with StackOverflowSQLite(path) as db:
        n = np.array([v for s in db.splits() for v in db.num_examples(s).values()])
    tail = (n >= 10).mean()
    expected = (spec.posts_min / 10) ** spec.posts_alpha
    assert abs(tail - expected) < 4 * np.sqrt(expected * (1 - expected) / len(n))
    mean_len = stats["tokens"] / stats["examples"]
    lognormal_mean = spec.tokens_median * np.exp(spec.tokens_sigma**2 / 2)
    assert abs(mean_len / lognormal_mean - 1) < 0.03  # log-normal mean = median·e^{σ²/2}
    shares = np.array([c["clients"] for c in counts.values()]) / 400
    assert np.allclose(shares, spec.split_fractions, atol=0.06)


def test_generator_zipf_and_topic_skew():
    spec = StackOverflowSpec(users=60, seed=1)
    user_words = [" ".join(p.tokens for p in synthetic_user(spec, i)[1]).split() for i in range(60)]
    counts = count_words(" ".join(w) for w in user_words)
    freq = np.array(sorted(counts.values(), reverse=True), dtype=float)
    ranks = np.arange(1, len(freq) + 1)
    slope = np.polyfit(np.log(ranks[5:300]), np.log(freq[5:300]), 1)[0]
    assert -1.4 < slope < -0.7  # Zipf-like rank/frequency

    # Per-user topic skew (Dirichlet mixtures): a user's tokens concentrate on one topic's words far
    # more than with near-uniform mixtures (the control), where the ratio only reflects sampling
    # noise.
    def concentration(alpha):
        spec = StackOverflowSpec(users=600, seed=1, topic_concentration=alpha)
        lex = spec.lexicon
        index = {w: i for i, w in enumerate(lex.words)}
        member = np.zeros((lex.topics, lex.size), bool)
        for t, words in enumerate(lex.topic_words):
            member[t, words] = True
        ratios = []
        for i in range(600):
            ids = [index[w] for p in synthetic_user(spec, i)[1] for w in p.tokens.split()]
            share = member[:, ids].sum(axis=1)
            if len(ids) >= 150 and share.sum():
                ratios.append(share.max() / share.mean())
        return np.median(ratios)

    assert concentration(spec.topic_concentration) > 1.4 * concentration(1000.0)


# ----------------------------------------------------------------------------------------------
# vocabulary


def test_vocabulary_ids_sequences_and_file(tmp_path):
    counts = count_words(["b a a c", "a b d", "e"])
    v = build_vocabulary(counts, size=3, oov_buckets=2)
    assert v.words == ["a", "b", "c"]  # by count, ties by word (c, d, e all 1)
    assert v.first_word == 5 and v.num_tokens == 8
    seq = v.encode("a zz b", seq_len=5)
    assert seq.tolist() == [BOS, 5, v.lookup("zz"), 6, EOS, PAD] and 3 <= v.lookup("zz") < 5
    assert v.encode("a a a a a a a", seq_len=4).tolist() == [BOS, 5, 5, 5, 5]  # truncated: no EOS
    assert v.sequences(["a"] * 300, seq_len=4).shape == (256, 5)
    v.save(tmp_path / "v.txt")
    w = Vocabulary.load(tmp_path / "v.txt")
    assert w.words == v.words and w.oov_buckets == 2 and w.lookup("zz") == v.lookup("zz")
    (tmp_path / "bad.txt").write_text("a\nb c\n")
    with pytest.raises(DataFormatError, match="bad.txt:2"):
        Vocabulary.load(tmp_path / "bad.txt")


# ----------------------------------------------------------------------------------------------
# arXiv

TINY_ARXIV = [
    {
        "id": "0704.0001",
        "submitter": "Pavel Nadolsky",
        "authors": "C. Bal\\'azs, E. L. Berger, P. M. Nadolsky, C.-P. Yuan",
        "title": (
            "Calculation of prompt diphoton production cross sections at Tevatron and\n"
            "  LHC energies"
        ),
        "abstract": (
            "  A fully differential calculation in perturbative quantum chromodynamics is "
            "presented."
        ),
        "categories": "hep-ph",
        "update_date": "2008-11-13",
        "authors_parsed": [
            ["Balázs", "C.", ""],
            ["Berger", "E. L.", ""],
            ["Nadolsky", "P. M.", ""],
            ["Yuan", "C. -P.", ""],
        ],
    },
    {
        "id": "0704.0002",
        "authors": "Ileana Streinu and Louis Theran",
        "title": "Sparsity-certifying Graph Decompositions",
        "abstract": "We describe a new algorithm.",
        "categories": "math.CO cs.CG",
    },
    {
        "id": "0704.0003",
        "authors": "Hongjun Pan",
        "title": "The evolution of the Earth-Moon system",
        "abstract": "The evolution.",
        "categories": "physics.gen-ph",
        "authors_parsed": [["Pan", "Hongjun", ""]],
    },
    {
        "id": "0704.0004",
        "authors": "Louis Theran and C. Balazs",
        "title": "t",
        "abstract": "a",
        "categories": "math.CO",
        "authors_parsed": [["Theran", "Louis", ""], ["Balazs", "C.", ""]],
    },
]


def _write_jsonl(path, records, extra_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def test_tiny_arxiv_file_loads_and_builds_the_graph(tmp_path):
    path = tmp_path / "arxiv.jsonl"
    _write_jsonl(path, TINY_ARXIV)
    papers = list(ArxivReader(path))
    assert [p.id for p in papers] == ["0704.0001", "0704.0002", "0704.0003", "0704.0004"]
    assert papers[0].authors == ("balazs|c", "berger|e l", "nadolsky|p m", "yuan|c p")
    assert papers[1].authors == ("streinu|ileana", "theran|louis")  # from the free-text field
    assert papers[0].title.endswith("at Tevatron and LHC energies") and papers[1].categories == (
        "math.CO",
        "cs.CG",
    )
    g = arxiv_attribution(papers)
    assert g.num_items == 4 and g.num_users == 7
    per_user = dict(zip(g.user_ids, g.items_per_user(), strict=True))
    # same person across the two fields
    assert per_user["balazs|c"] == 2 and per_user["theran|louis"] == 2
    reader = ArxivReader(path, min_authors=2)
    assert len(list(reader)) == 3 and reader.filtered == 1
    assert normalize_author("Müller-Lüdenscheidt", "J.-P.", "Jr") == "muller ludenscheidt jr|j p"
    assert normalize_author("Smith", "John", key="initial") == "smith|j"
    # a name wholly outside the Latin script keeps its letters (it was dropped from the paper's
    # authors, escaping its bound); one with no letter at all refuses the line
    assert normalize_author("谭九鼎") == "谭九鼎|"
    assert normalize_author("Иванов", "И.") == "иванов|и"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        json.dumps({"id": "1", "authors": "J. Smith and 谭九鼎", "title": "t", "abstract": "a"})
        + "\n"
        + json.dumps({"id": "2", "authors_parsed": [["Smith", "J.", ""], ["--", "", ""]]})
        + "\n"
    )
    with pytest.raises(DataFormatError, match=r"mixed.jsonl.*2.*letter or digit"):
        list(ArxivReader(mixed))
    skipping = ArxivReader(mixed, on_error="skip")
    assert [p.authors for p in skipping] == [("smith|j", "谭九鼎|")] and skipping.skipped == 1
    assert split_authors("A. B. Smith (MIT), C. Jones and D. Lee") == [
        ("Smith", "A. B."),
        ("Jones", "C."),
        ("Lee", "D."),
    ]


def test_arxiv_malformed_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(
        path,
        TINY_ARXIV[:1],
        extra_lines=[
            '{"id": "x", "authors": ',
            "",
            '["a list"]',
            '{"authors": "A B"}',
            '{"id": "y", "authors_parsed": [1]}',
            '{"id": "z", "title": "no authors"}',
        ],
    )
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: expected a JSON object"):
        list(ArxivReader(path))
    reader = ArxivReader(path, on_error="skip")
    assert [p.id for p in reader] == ["0704.0001"] and reader.skipped == 5
    for line, text, msg in [
        (1, '["a list"]', "a JSON object"),
        (1, '{"authors": "A B"}', "'id'"),
        (1, '{"id": "y", "authors_parsed": [1]}', "authors_parsed"),
        (1, '{"id": "z", "title": 3, "authors": "A B"}', "'title'"),
    ]:
        (tmp_path / "one.jsonl").write_text(text + "\n")
        with pytest.raises(DataFormatError, match=f"one.jsonl:{line}: .*{msg}"):
            list(ArxivReader(tmp_path / "one.jsonl"))


def test_generated_arxiv_round_trip_and_shape(tmp_path):
    spec = ArxivSpec(users=3000, seed=2)
    path = tmp_path / "gen.jsonl"
    out = generate_arxiv(path, spec)
    stats = dataset_stats(path)
    assert stats["users"] == 3000 == out["users"] and stats["examples"] == out["papers"]
    papers = list(ArxivReader(path))
    sizes = np.array([len(p.authors) for p in papers])
    pmf = spec.team_size_pmf()
    observed = np.bincount(np.minimum(sizes, 8), minlength=9)[1:8] / len(sizes)
    se = np.sqrt(pmf[1:8] * (1 - pmf[1:8]) / len(sizes))
    assert np.all(np.abs(observed - pmf[1:8]) < 5 * se + 1e-3)  # the team-size mixture, body
    assert sizes.max() >= spec.big_collab_min  # and its long tail
    assert stats["examples_per_user"]["p50"] == 2  # arXiv's median k_u = 2 (004 §3.5)
    # prolific authors
    assert stats["examples_per_user"]["p100"] > 10 * stats["examples_per_user"]["p50"]
    assert stats["repeat_coauthorship_fraction"] > 0.2
    # Without repeat co-authorship, repeated pairs are rare.
    generate_arxiv(tmp_path / "norepeat.jsonl", ArxivSpec(users=3000, seed=2, repeat_p=0.0))
    assert (
        dataset_stats(tmp_path / "norepeat.jsonl")["repeat_coauthorship_fraction"]
        < 0.5 * stats["repeat_coauthorship_fraction"]
    )
    # seeded: the same spec gives the same bytes (a smaller population shows it as well)
    small = ArxivSpec(users=300, seed=2)
    generate_arxiv(tmp_path / "small.jsonl", small)
    generate_arxiv(tmp_path / "again.jsonl", small)
    assert (tmp_path / "small.jsonl").read_bytes() == (tmp_path / "again.jsonl").read_bytes()


# ----------------------------------------------------------------------------------------------
# partitioning


def test_partition_manifest_and_node_config(tmp_path):
    from flwr.common.config import parse_config_args

    so = tmp_path / "so.sqlite"
    _tiny_tff_sqlite(so)
    m = make_manifest(so)
    assert m["num_partitions"] == 2 and [p["users"] for p in m["partitions"]] == [
        ["00000001"],
        ["00000002"],
    ]
    cfg = parse_config_args([m["partitions"][1]["node_config"]])
    assert cfg == {"partition-id": 1, "num-partitions": 2, "data-path": str(so.resolve())}
    assert parse_config_args([node_config(0, 1, tmp_path / 'a "quoted" dir' / "x.sqlite")])[
        "data-path"
    ] == str((tmp_path / 'a "quoted" dir' / "x.sqlite").resolve())
    with pytest.raises(InvalidArgumentError, match="partitions"):
        make_manifest(so, partitions=5)
    ax = tmp_path / "a.jsonl"
    generate_arxiv(ax, ArxivSpec(users=300))
    m = make_manifest(ax, partitions=3)
    items = [i for p in m["partitions"] for i in p["items"]]
    assert sorted(items) == sorted(p.id for p in ArxivReader(ax)) and all(
        p["items"] for p in m["partitions"]
    )
    assert make_manifest(ax, partitions=3) == m
    write_manifest(m, tmp_path / "m.json")
    assert load_manifest(tmp_path / "m.json") == m
    with pytest.raises(InvalidArgumentError, match="partitions"):
        make_manifest(ax)


# ---------------------------------------------------------------------------------------------- CLI


def test_data_cli(tmp_path):
    from typer.testing import CliRunner

    from corrflow.server.cli import app

    r = CliRunner()
    so, ax = tmp_path / "so.sqlite", tmp_path / "ax.jsonl"
    res = r.invoke(
        app, ["data", "generate", "stackoverflow", "--users", "50", "--out", str(so), "--json"]
    )
    assert res.exit_code == 0, res.output
    gen = json.loads(res.stdout.strip().splitlines()[-1])
    stats = json.loads(
        r.invoke(app, ["data", "stats", str(so), "--json"]).stdout.strip().splitlines()[-1]
    )
    assert stats["users"] == 50 and stats["examples"] == sum(
        c["examples"] for c in gen["counts"].values()
    )
    assert gen["peak_rss_mib"] > 0
    res = r.invoke(
        app,
        [
            "data",
            "vocab",
            str(so),
            "--no-privacy",
            "--out",
            str(tmp_path / "v.txt"),
            "--size",
            "100",
            "--json",
        ],
    )
    assert json.loads(res.stdout.strip().splitlines()[-1])["words"] == 100
    assert (
        r.invoke(app, ["data", "generate", "arxiv", "--users", "40", "--out", str(ax)]).exit_code
        == 0
    )
    out = json.loads(
        r.invoke(app, ["data", "stats", str(ax), "--json"]).stdout.strip().splitlines()[-1]
    )
    assert out["users"] == 40 and set(out["users_per_example"]) >= {"p50", "p90", "p100"}
    res = r.invoke(
        app,
        [
            "data",
            "partition",
            str(ax),
            "--partitions",
            "2",
            "--out",
            str(tmp_path / "m.json"),
            "--json",
        ],
    )
    assert (
        res.exit_code == 0
        and json.loads(res.stdout.strip().splitlines()[-1])["num_partitions"] == 2
    )
    assert (
        r.invoke(
            app, ["data", "generate", "reddit", "--users", "3", "--out", str(tmp_path / "x")]
        ).exit_code
        == 2
    )
    (tmp_path / "bad.jsonl").write_text('{"id": \n')
    res = r.invoke(app, ["data", "stats", str(tmp_path / "bad.jsonl")])
    assert res.exit_code == 2 and "bad.jsonl:1" in res.output


# ----------------------------------------------------------------------------------------------
# n-gram structure


def _bigram_vs_unigram(
    train: list[list], test: list[list], min_count: int = 5
) -> tuple[float, float]:
    """Accuracy of count-based predictors of the next word: the most frequent successor of the
    previous word (bigram) and the most frequent word (unigram), on test positions whose previous
    word was seen ≥ min_count times in training (so the bigram row is estimated, not guessed)."""
    from collections import Counter, defaultdict

    succ: dict = defaultdict(Counter)
    uni: Counter = Counter()
    for seq in train:
        uni.update(seq[1:])
        for a, b in zip(seq, seq[1:], strict=False):
            succ[a][b] += 1
    top = uni.most_common(1)[0][0]
    hits_bi = hits_uni = total = 0
    for seq in test:
        for a, b in zip(seq, seq[1:], strict=False):
            if sum(succ[a].values()) >= min_count:
                total += 1
                hits_bi += succ[a].most_common(1)[0][0] == b
                hits_uni += top == b
    assert total > 1000
    return hits_bi / total, hits_uni / total


def test_stackoverflow_text_has_learnable_bigram_structure():
    """Bigram counts beat the unigram baseline by at least half the generator's ceiling follow·w₁·(1
    − topic- specific rows) (0.29 at the defaults; the rest is lost to estimation noise on a
    20k-word vocabulary)."""
    spec = StackOverflowSpec(users=400, seed=3)
    posts = [p.tokens.split() for i in range(400) for p in synthetic_user(spec, i)[1]]
    bi, uni = _bigram_vs_unigram(posts[: len(posts) * 3 // 4], posts[len(posts) * 3 // 4 :])
    assert bi - uni >= 0.5 * spec.lexicon.bigram_ceiling(), (bi, uni)
    # the control: without the Markov order (follow = 0) the bigram predictor has nothing to learn
    flat = StackOverflowSpec(users=400, seed=3, lexicon=Lexicon(follow=0.0))
    posts = [p.tokens.split() for i in range(400) for p in synthetic_user(flat, i)[1]]
    bi0, uni0 = _bigram_vs_unigram(posts[: len(posts) * 3 // 4], posts[len(posts) * 3 // 4 :])
    assert bi0 - uni0 < 0.05, (bi0, uni0)


def test_arxiv_abstracts_have_learnable_bigram_structure(tmp_path):
    spec = ArxivSpec(users=300, seed=2)
    generate_arxiv(tmp_path / "a.jsonl", spec)
    texts = [p.abstract.lower().rstrip(".").split() for p in ArxivReader(tmp_path / "a.jsonl")]
    cut = len(texts) * 3 // 4
    bi, uni = _bigram_vs_unigram(texts[:cut], texts[cut:])
    assert bi - uni >= 0.5 * spec.lexicon.bigram_ceiling(), (bi, uni)


def test_in_memory_text_bigram_reaches_its_ceiling():
    """The clients' in-memory text (text_synth): bigram counts reach most of follow·w₁·(1 − oov),
    far above the unigram baseline; the topic-specific rows cost at most topic_specific of the
    ceiling."""
    from corrflow.data.text_synth import SPECIAL, TextTask, bigram_ceiling, user_sentences

    task = TextTask(vocab=200)
    seqs = [
        [int(w) for w in s if w >= SPECIAL] for u in range(1500) for s in user_sentences(task, u)
    ]
    bi, uni = _bigram_vs_unigram(seqs[: len(seqs) * 4 // 5], seqs[len(seqs) * 4 // 5 :])
    ceiling = bigram_ceiling(task)
    assert bi >= (1 - task.topic_specific) * ceiling - 0.03 and uni < 0.1 * ceiling, (
        bi,
        uni,
        ceiling,
    )


@pytest.mark.parametrize(
    "task, digest",
    [
        (
            dict(vocab=200, seed=0, seq_len=20),
            "eee0ee2b55ebc5b628efda6703531da5b01d5a5755a9d4971021e4d5b8ab2c09",
        ),
        (
            dict(vocab=500, seed=3),
            "98f2b60dfe245461ea86eb3c05026e6554d9700d3977f1d9ac63d44fadddf429",
        ),
    ],
)
def test_synthetic_users_are_the_same_text_alone_or_together(task, digest):
    """A user's sentences come from its own generator: built alone (the per-client path), in a
    batch (the cohort engine) or in any order, the same arrays — those the generator has always
    written (SHA-256 recorded from the one-user-at-a-time implementation)."""
    import hashlib

    from corrflow.data.text_synth import TextTask, user_sentences, users_sentences

    text = TextTask(**task)
    users = [*range(100), 1_000_000, 1_000_199]
    together = users_sentences(text, users)
    backwards = users_sentences(text, users[::-1])[::-1]
    h = hashlib.sha256()
    for u, a, b in zip(users, together, backwards, strict=True):
        alone = user_sentences(text, u)
        assert a.dtype == alone.dtype == np.int32
        assert np.array_equal(a, alone) and np.array_equal(b, alone)
        h.update(np.ascontiguousarray(alone).tobytes())
        h.update(str(alone.shape).encode())
    assert h.hexdigest() == digest


def test_a_git_history_becomes_arxiv_lines_with_every_coauthor(tmp_path):
    """benchmarks/commit_text.py (the real commit text of the evidence page): each commit is a
    paper of its author and every Co-authored-by trailer, read back by corrflow's arXiv reader."""
    import subprocess
    import sys
    from pathlib import Path

    repo = tmp_path / "repo"
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def git(*args, author="Ada Lovelace"):
        subprocess.run(
            ["git", "-C", str(repo), "-c", f"user.name={author}", "-c", "user.email=a@b.c", *args],
            check=True,
            capture_output=True,
            env=env,
        )

    repo.mkdir()
    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "Add the noise ring\n\nRows are written in place.")
    git(
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "Fix the sampler seed\n\nCo-authored-by: 谭九鼎 <t@x.y>\n"
        "Co-authored-by: Ada Lovelace <a@b.c>",
        author="Grace Hopper 🇺🇸",
    )
    out = tmp_path / "commits.jsonl"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "commit_text.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(repo), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert (summary["commits"], summary["authors"], summary["multi_author_commits"]) == (2, 3, 1)
    papers = list(ArxivReader(out))
    assert [p.authors for p in papers] == [
        ("hopper|grace", "谭九鼎|", "lovelace|ada"),
        ("lovelace|ada",),
    ]
    assert papers[0].text == "Fix the sampler seed" and papers[1].text.endswith("in place.")
    # the StackOverflow format: one client per author, the co-authored commit left out
    so = tmp_path / "commits.sqlite"
    proc = subprocess.run(
        [sys.executable, str(script), str(repo), str(so), "--format", "stackoverflow"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and json.loads(proc.stdout)["left_out_multi_author"] == 1
    with StackOverflowSQLite(so) as db:
        posts = [
            p.tokens
            for split in db.splits()
            for c in db.client_ids(split)
            for p in db.client_posts(c, split)
        ]
    assert posts == ["add the noise ring rows are written in place ."]
    bad = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "none"), str(out)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "REPO" in bad.stderr
