"""Real text at the papers' scale: the differentially private vocabulary (planted single-user words
never appear; σ and the threshold recomputed independently), its provenance in the file and in a
run's report and total (ε, δ), distinct users in ``data stats``, accuracy without OOV buckets (a
constant predictor), streamed evaluation equal to the unbatched one, ``--data`` for the numpy
next-word client on SQLite and arXiv, refusals naming the flag, and drift in the learning
verdict."""

import json
import math

import numpy as np
import pytest
from scipy.stats import norm
from typer.testing import CliRunner

from corrflow.clients import nextword_client as nw
from corrflow.clients.tasks import get_task
from corrflow.config import RunConfig
from corrflow.data.dp_vocab import dataset_user_texts, dp_vocabulary, gaussian_sigma, threshold
from corrflow.data.federated import HELD_OUT_AUTHORS, TextSource, held_out_author
from corrflow.data.stackoverflow import Post, StackOverflowWriter
from corrflow.data.stats import dataset_stats
from corrflow.data.vocab import Vocabulary, build_vocabulary, count_words, read_provenance
from corrflow.errors import InvalidArgumentError
from corrflow.run.reading import participation_users
from corrflow.server.app import run_server
from corrflow.server.cli import app
from corrflow.server.inprocess import InProcessGrid

COMMON = [f"common{i}" for i in range(12)]


def _planted_file(path, users=300, heldout=30):
    """Every train user writes the common words and one word nobody else writes (``secretNNN``)."""
    rng = np.random.default_rng(7)
    w = StackOverflowWriter(path)
    for u in range(users):
        posts = [Post(" ".join(rng.permutation(COMMON)[:8]) + f" secret{u:03d}") for _ in range(3)]
        w.add_client(f"u{u:04d}", "train", posts)
    for u in range(heldout):
        w.add_client(f"h{u:04d}", "heldout", [Post(" ".join(rng.permutation(COMMON)[:8]))])
    w.add_client("u0000", "heldout", [Post("common0 common1")])  # TFF: one client in several splits
    return w.close()


def _last_json(res):
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- DP
# vocabulary


def test_dp_vocab_cli_keeps_no_single_user_word(tmp_path):
    """`data vocab FILE --epsilon 1 --delta 1e-6 --size 10000 --out V` on a
    file with planted single-user words writes none of them, keeps the words every user writes, and
    records how."""
    so = _planted_file(tmp_path / "so.sqlite")
    res = CliRunner().invoke(
        app,
        [
            "data",
            "vocab",
            str(so),
            "--epsilon",
            "1",
            "--delta",
            "1e-6",
            "--size",
            "10000",
            "--out",
            str(tmp_path / "v.txt"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = _last_json(res)
    v = Vocabulary.load(tmp_path / "v.txt")
    assert not [w for w in v.words if w.startswith("secret")]
    assert (
        set(v.words) == set(COMMON)
        and out["users"] == 300
        and out["candidates"] == 300 + len(COMMON)
    )
    assert (
        v.provenance["source"] == "dp"
        and v.provenance["epsilon"] == 1.0
        and v.provenance["delta"] == 1e-6
    )
    assert (
        (tmp_path / "v.txt")
        .read_text()
        .splitlines()[0]
        .startswith("#corrflow-vocab oov_buckets=1 source=dp ")
    )
    # the exact (non-private) count keeps every planted word: the private route is what removes them
    res = CliRunner().invoke(
        app,
        [
            "data",
            "vocab",
            str(so),
            "--no-privacy",
            "--size",
            "10000",
            "--out",
            str(tmp_path / "n.txt"),
        ],
    )
    assert res.exit_code == 0 and "--no-privacy" in res.output
    n = Vocabulary.load(tmp_path / "n.txt")
    assert (
        n.provenance == {"source": "non-private"}
        and sum(w.startswith("secret") for w in n.words) == 300
    )
    bad = CliRunner().invoke(
        app, ["data", "vocab", str(so), "--epsilon", "0", "--out", str(tmp_path / "x.txt")]
    )
    assert bad.exit_code == 2 and "--epsilon" in bad.output


def test_dp_vocab_noise_and_threshold_recomputed():
    """σ against dp-accounting's PLD of the Gaussian mechanism; ρ against the tail bound it must
    meet for every t ≤ Δ₀ (a user's t unique words each at 1/√t clear ρ with probability ≤ δ/2
    together)."""
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant

    eps, delta, cap = 1.0, 1e-6, 32
    sigma = gaussian_sigma(eps, delta / 2)
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dpa.GaussianDpEvent(sigma))
    assert acc.get_delta(eps) == pytest.approx(delta / 2, rel=1e-3)
    rho = threshold(sigma, delta, cap)
    worst = max(1 - norm.cdf((rho - 1 / math.sqrt(t)) / sigma) ** t for t in range(1, cap + 1))
    # tight at the maximising t
    assert worst <= delta / 2 * (1 + 1e-6) and worst >= delta / 2 * 0.999
    # counts: a word used by n users each keeping t words has n/√t before noise; the cap truncates a
    # user's set
    res = dp_vocabulary(
        [["a b c"], ["a b"], ["a"]] * 200,
        epsilon=eps,
        delta=delta,
        size=10,
        max_words_per_user=2,
        rng=np.random.default_rng(0),
    )
    # c: beyond the cap of 2
    assert res.vocabulary.words[0] == "a" and "c" not in res.vocabulary.words


def test_vocabulary_provenance_header():
    v = build_vocabulary(count_words(["a b b"]), 2, oov_buckets=3)
    assert (
        v.provenance == {"source": "non-private"}
        and v.header() == "#corrflow-vocab oov_buckets=3 source=non-private"
    )


def test_vocab_files_without_provenance(tmp_path):
    from corrflow.errors import DataFormatError

    (tmp_path / "tff.txt").write_text("the\nto\n")
    assert Vocabulary.load(tmp_path / "tff.txt").provenance == {
        "source": "public"
    }  # a user-supplied list
    (tmp_path / "old.txt").write_text("#corrflow-vocab oov_buckets=2\nthe\n")
    old = Vocabulary.load(tmp_path / "old.txt")
    assert old.oov_buckets == 2 and old.provenance == {"source": "unrecorded"}
    (tmp_path / "bad.txt").write_text("#corrflow-vocab oov_buckets=1 source=dp\nthe\n")
    with pytest.raises(DataFormatError, match="epsilon= and delta="):
        Vocabulary.load(tmp_path / "bad.txt")
    assert read_provenance(tmp_path / "old.txt")["words"] == 1


# ---------------------------------------------------------------------------------------------- a
# run on a file


def test_run_reports_the_dp_vocabulary_and_the_total(tmp_path):
    """A run with a DP vocabulary is calibrated to the rest of the budget and reports both and their
    sum."""
    so = _planted_file(tmp_path / "so.sqlite", users=200, heldout=10)
    texts, per_user = dataset_user_texts(so)
    assert per_user == 1
    res = dp_vocabulary(texts, epsilon=1.0, delta=1e-6, size=100)
    res.vocabulary.save(tmp_path / "v.txt")
    cfg = RunConfig(
        num_users=20,
        num_rounds=2,
        epochs=1,
        target_epsilon=4.0,
        delta=1e-5,
        client="nextword",
        data_path=str(so),
        vocab_path=str(tmp_path / "v.txt"),
        seq_len=10,
        state_dir=str(tmp_path / "r"),
    )
    task = get_task("nextword", data_path=str(so), vocab_path=str(tmp_path / "v.txt"), seq_len=10)
    run_server(InProcessGrid(task.handlers, 20), cfg, quiet=True)
    report = json.loads((tmp_path / "r" / "privacy_report.json").read_text())
    assert report["vocabulary"]["source"] == "dp" and report["vocabulary"]["epsilon"] == 1.0
    assert report["vocabulary"]["inside_guarantee"] is True
    assert report["delta"] == pytest.approx(1e-5 - 1e-6)  # training's δ
    assert report["planned"]["epsilon"] <= 3.0 + 1e-6 and report["planned"]["epsilon"] > 2.9
    total = report["total"]
    assert total["includes_vocabulary"] and total["epsilon"] == pytest.approx(
        report["realized"]["epsilon"] + 1.0
    )
    assert total["epsilon"] <= 4.0 + 1e-6 and total["delta"] <= 1e-5 * (1 + 1e-9)
    # a vocabulary that spends the whole target ε is refused, naming the setting
    from corrflow.errors import InvalidArgumentError
    from corrflow.planning.run import training_budget

    with pytest.raises(InvalidArgumentError, match="target-epsilon"):
        training_budget(cfg.replace(target_epsilon=0.5))


def test_simulate_data_cli_refuses_and_reports(tmp_path):
    """--users above the file's train clients exits 2 naming the flag and the count; a non-private
    vocabulary is named in the summary as outside the guarantee."""
    so = _planted_file(tmp_path / "so.sqlite", users=40, heldout=5)
    build_vocabulary(count_words(COMMON), 20).save(tmp_path / "n.txt")
    r = CliRunner()
    res = r.invoke(
        app,
        [
            "simulate",
            "--data",
            str(so),
            "--vocab",
            str(tmp_path / "n.txt"),
            "--client",
            "nextword",
            "--users",
            "41",
            "--rounds",
            "2",
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path / "a"),
        ],
    )
    assert res.exit_code == 2 and "--users" in res.output and "40 train clients" in res.output
    res = r.invoke(
        app,
        [
            "simulate",
            "--data",
            str(so),
            "--vocab",
            str(tmp_path / "n.txt"),
            "--client",
            "nextword",
            "--rounds",
            "2",
            "--noise-multiplier",
            "0.5",
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert res.exit_code in (0, 3), res.output
    assert (
        "vocabulary  12 words, non-private" in res.output and "outside the guarantee" in res.output
    )
    report = json.loads((tmp_path / "b" / "privacy_report.json").read_text())
    assert (
        report["vocabulary"]["inside_guarantee"] is False
        and report["total"]["includes_vocabulary"] is False
    )
    assert len(participation_users(report, tmp_path / "b")) == 40
    # the vocabulary's privacy cost is part of the run: resuming with another file at the same path
    # is refused
    (tmp_path / "n.txt").write_text((tmp_path / "n.txt").read_text() + "extra\n")
    res = r.invoke(
        app,
        [
            "simulate",
            "--data",
            str(so),
            "--vocab",
            str(tmp_path / "n.txt"),
            "--client",
            "nextword",
            "--rounds",
            "2",
            "--noise-multiplier",
            "0.5",
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert res.exit_code == 2 and "vocab_sha256" in res.output, res.output


def test_nextword_on_arxiv_holds_out_authors(tmp_path):
    """arXiv: 10% of authors by hashed id are held out; no training paper has one; the run's items
    are the training papers and its users their authors (multi-attribution)."""
    from corrflow.data.arxiv import ArxivSpec, generate_arxiv

    ax = tmp_path / "ax.jsonl"
    generate_arxiv(ax, ArxivSpec(users=200, seed=2))
    build_vocabulary(count_words(["the of a"]), 3).save(tmp_path / "v.txt")
    src = TextSource(str(ax), str(tmp_path / "v.txt"))
    train, held = src._arxiv
    authors = {a for p in train + held for a in p.authors}
    out = {a for a in authors if held_out_author(a)}
    assert abs(len(out) / len(authors) - HELD_OUT_AUTHORS) < 0.06
    assert not any(held_out_author(a) for p in train for a in p.authors) and held
    assert all(any(held_out_author(a) for a in p.authors) for p in held)
    graph = src.attribution()
    assert graph.item_ids[0] == "partition-0" and graph.num_items == len(train)
    assert src.user_sentences(0).shape[1] == 21 and len(src.held_out()) >= len(held)


# ----------------------------------------------------------------------------------------------
# stats and metrics


def test_stats_count_distinct_users_across_splits(tmp_path):
    so = _planted_file(tmp_path / "so.sqlite", users=10, heldout=4)
    stats = dataset_stats(so)
    assert (
        stats["users"] == 14
        and stats["users_in_several_splits"] == 1
        and stats["train_users"] == 10
    )
    assert stats["splits"]["train"]["users"] == 10 and stats["splits"]["heldout"]["users"] == 5
    # u0000: 3 + 1
    assert stats["examples_per_user"]["p100"] == 4 and stats["examples_per_user"]["p0"] == 1


def test_oov_buckets_are_not_accuracy(tmp_path):
    """A constant predictor of an OOV bucket scores 0, whatever the number of buckets (it scored 2%
    with 8 buckets when accuracy counted ids ≥ 4); a constant predictor of a real word scores that
    word's share."""
    v = Vocabulary(["a", "b", "c"], oov_buckets=8)
    sents = v.sequences(["a b zz c yy a", "b a xx ww", "c c c qq"], seq_len=8)
    targets = sents[:, 1:]
    bucket = int(v.lookup("zz"))
    assert 3 <= bucket < v.first_word and (targets == bucket).any()
    weights = nw.initial_weights(v.num_tokens, 0)
    weights[2][bucket] = 10.0  # bias: always predict the bucket
    _, acc = nw.evaluate_weights(weights, sents, v.first_word)
    assert acc == 0.0
    weights[2][:] = 0
    weights[2][v.lookup("c")] = 10.0
    _, acc = nw.evaluate_weights(weights, sents, v.first_word)
    real = targets[targets >= v.first_word]
    assert acc == pytest.approx(float((real == v.lookup("c")).mean()))


def test_streamed_evaluation_equals_one_pass():
    from corrflow.data.text_synth import user_sentences

    sents = np.concatenate([user_sentences(nw.task_for(0), u) for u in range(30)])
    rng = np.random.default_rng(1)
    w = [x + rng.normal(0, 0.3, x.shape).astype(np.float32) for x in nw.initial_weights(204, 0)]
    whole = nw.evaluate_weights(w, sents, chunk=10**9)
    assert nw.evaluate_weights(w, sents, chunk=7) == pytest.approx(whole, rel=1e-12)


def test_learning_verdict_flags_drift_from_the_best():
    from corrflow.planning.learnability import learning_section

    hist = [
        {"round": -1, "test_loss": 7.60},
        {"round": 0, "test_loss": 5.94},
        {"round": 1, "test_loss": 6.94},
    ]
    v = learning_section(hist, 0.1)
    assert (
        v["learned"] is True
        and v["drifted"] is True
        and v["best_test_loss"] == 5.94
        and v["best_round"] == 0
    )
    assert v["drift_above_best"] == pytest.approx(6.94 / 5.94 - 1) and "drifted" in v["verdict"]
    steady = learning_section([hist[0], hist[1], {"round": 1, "test_loss": 6.2}], 0.1)
    assert steady["drifted"] is False and "drifted" not in steady["verdict"]


def test_dispatching_client_app_trains_the_selected_task_on_the_nodes_data(tmp_path):
    """The ClientApp `flwr run .` binds trains the run config's client; a node's own
    data-path/vocab-path (node config) win over the server's."""
    from corrflow.clients import dispatch
    from corrflow.data.federated import data_paths

    assert data_paths(
        {"data-path": "s.sqlite", "vocab-path": "s.txt"}, {"data-path": "n.sqlite"}
    ) == ("n.sqlite", "s.txt")
    assert data_paths({"data-path": "s.sqlite", "vocab-path": "s.txt"}, {"partition-id": 0}) == (
        "s.sqlite",
        "s.txt",
    )
    assert data_paths({}, {}) == ("", "")
    so = _planted_file(tmp_path / "so.sqlite", users=12, heldout=3)
    build_vocabulary(count_words(COMMON), 20, source="public").save(tmp_path / "v.txt")
    cfg = RunConfig(
        num_users=12,
        num_rounds=2,
        epochs=1,
        noise_multiplier=0.5,
        client="nextword",
        data_path=str(so),
        vocab_path=str(tmp_path / "v.txt"),
        seq_len=10,
        state_dir=str(tmp_path / "r"),
    )
    s = run_server(InProcessGrid({"train": dispatch.train}, 12), cfg, quiet=True)
    assert s.next_round == 2 and s.metrics_history[-1]["rejected"] == 0
    report = json.loads((tmp_path / "r" / "privacy_report.json").read_text())
    assert (
        report["vocabulary"]["source"] == "public"
        and report["total"]["epsilon"] == report["realized"]["epsilon"]
    )


def test_a_node_says_once_that_it_trains_on_its_own_data_file(caplog):
    """The SuperNode's log names the file its node config gives (the deployment's proof that a
    device read its own data), once per process; a node trained on the server's path says
    nothing."""
    import logging
    from types import SimpleNamespace

    from corrflow.clients.nextword_client import _announce, node_data_paths

    _announce.cache_clear()
    server = {"data-path": "/srv/s.sqlite", "vocab-path": "/srv/v.txt"}
    plain = SimpleNamespace(node_id=5, node_config={"partition-id": 1})
    own = SimpleNamespace(
        node_id=7,
        node_config={"partition-id": 2, "data-path": "/dev2/d.sqlite", "vocab-path": "/dev2/v.txt"},
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert node_data_paths(server, plain) == ("/srv/s.sqlite", "/srv/v.txt")
        assert "own data file" not in caplog.text
        for _ in range(2):
            assert node_data_paths(server, own) == ("/dev2/d.sqlite", "/dev2/v.txt")
    assert (
        caplog.text.count(
            "partition-id 2 trains on the SuperNode's own data file /dev2/d.sqlite (node config "
            "data-path), vocabulary /dev2/v.txt"
        )
        == 1
    )


def test_a_node_with_its_own_data_file_trains_one_train_partition_of_it(tmp_path):
    """A node config naming the data file must count the file's train partitions (one user per node,
    as `corrflow data partition` writes it without --partitions); a manifest of several users per
    node is refused, naming the field, instead of training one user of the group in silence."""
    from types import SimpleNamespace

    from corrflow.clients.nextword_client import own_sentences
    from corrflow.data.partition import make_manifest

    so = _planted_file(tmp_path / "so.sqlite", users=6, heldout=2)
    build_vocabulary(count_words(COMMON), 20, source="public").save(tmp_path / "v.txt")
    src = TextSource(str(so), str(tmp_path / "v.txt"), seq_len=10)

    def node(**config):
        return SimpleNamespace(node_id=1, node_config=config)

    own = node(**{"partition-id": 4, "num-partitions": 6, "data-path": str(so)})
    np.testing.assert_array_equal(own_sentences(src, own), src.user_sentences(4))
    grouped = make_manifest(so, partitions=3)["partitions"][1]  # users 1 and 4 on one node
    assert len(grouped["users"]) == 2
    with pytest.raises(InvalidArgumentError, match="num-partitions.*6 in the node config"):
        own_sentences(src, node(**{"partition-id": 1, "num-partitions": 3, "data-path": str(so)}))
    # the server's path (simulation) or no count given: partition-id alone decides
    np.testing.assert_array_equal(
        own_sentences(src, node(**{"partition-id": 2, "num-partitions": 3})), src.user_sentences(2)
    )


def test_preflight_warning_names_the_uncertain_band(caplog):
    """Between THRESHOLD and 1.5 measured runs went both ways (real-format runs learned at
    0.49–1.29): 'may not'."""
    import logging

    from corrflow.factorization import Workload, factorize, participation_for
    from corrflow.planning.learnability import THRESHOLD, check_learnable

    fac = factorize("toeplitz", participation_for(20, 2), Workload.sgd_momentum(0.9, 0.25))
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        rho = check_learnable(fac, 0.6, [np.zeros(31_000)], 15.0)
    assert THRESHOLD < rho < 1.5 and "may not learn" in caplog.text


def test_held_out_evaluation_can_be_capped(tmp_path):
    so = _planted_file(tmp_path / "so.sqlite", users=5, heldout=30)
    build_vocabulary(count_words(COMMON), 20).save(tmp_path / "v.txt")
    src = TextSource(str(so), str(tmp_path / "v.txt"), seq_len=10)
    assert len(src.held_out()) == 31 and len(src.held_out(max_sequences=7)) == 7
    task = get_task(
        "nextword",
        data_path=str(so),
        vocab_path=str(tmp_path / "v.txt"),
        seq_len=10,
        eval_sequences=7,
    )
    assert np.isfinite(task.evaluate(task.initial_weights())["test_loss"])


def test_dp_vocab_on_arxiv_bounds_papers_per_author(tmp_path):
    """arXiv: a paper belongs to all its authors, so the contributing unit is the paper, each author
    bounded to k_u papers: σ scales by k_u and no word of a single paper (hence of a single author
    pair) appears."""
    ax = tmp_path / "ax.jsonl"
    with open(ax, "w") as f:
        for i in range(600):
            text = " ".join(COMMON) + f" secret{i:03d}"
            f.write(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "authors_parsed": [
                            [f"Last{i}", "A", ""],
                            [f"Last{(i + 1) % 600}", "B", ""],
                        ],
                        "title": "t",
                        "abstract": text,
                    }
                )
                + "\n"
            )
    res = CliRunner().invoke(
        app,
        [
            "data",
            "vocab",
            str(ax),
            "--epsilon",
            "1",
            "--delta",
            "1e-6",
            "--out",
            str(tmp_path / "v.txt"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = _last_json(res)
    v = Vocabulary.load(tmp_path / "v.txt")
    assert not [w for w in v.words if w.startswith("secret")] and set(COMMON) <= set(v.words)
    assert (
        out["sigma"] == pytest.approx(2 * gaussian_sigma(1.0, 5e-7))
        and v.provenance["max_items_per_user"] == "2"
    )
    assert out["threshold"] == pytest.approx(threshold(out["sigma"], 1e-6, 32, units_per_user=2))
