import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corrflow.errors import InvalidArgumentError
from corrflow.participation import (
    AttributionGraph,
    MultiAttributionSampler,
    bound_contributions,
    load_attribution,
)


def test_load_csv_and_jsonl(tmp_path):
    (tmp_path / "a.csv").write_text("item,user\np1,alice\np1,bob\np2,bob\np1,alice\n")
    g = load_attribution(tmp_path / "a.csv")
    assert (
        g.item_ids == ["p1", "p2"]
        and g.user_ids == ["alice", "bob"]
        and g.item_users == [[0, 1], [1]]
    )
    lines = [{"item": "x", "users": ["u1", "u2"]}, {"item": "y", "users": ["u2"]}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    g2 = load_attribution(tmp_path / "a.jsonl")
    assert g2.items_per_user().tolist() == [1, 2]


@pytest.mark.parametrize(
    "name, text, where",
    [
        ("bad.csv", "paper,author\np,a\n", "item,user"),
        ("bad2.csv", "item,user\np,\n", "bad2.csv:2"),
        ("bad.jsonl", '{"item": "a", "users": ["x"]}\n{"item": "b", "users": []}\n', "bad.jsonl:2"),
        ("bad2.jsonl", '{"item": "a", "users": ["x"]}\nnot json\n', "bad2.jsonl:2"),
        ("bad.txt", "x", ".csv or .jsonl"),
    ],
)
def test_malformed_attribution_names_file_and_line(tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    with pytest.raises(InvalidArgumentError, match=where.replace(".", r"\.")):
        load_attribution(tmp_path / name)


def test_empty_user_list_rejected():
    with pytest.raises(InvalidArgumentError, match="at least one user"):
        AttributionGraph(["a"], ["u"], [[]])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), k=st.integers(1, 4))
def test_bounding_caps_hold(seed, k):
    rng = np.random.default_rng(seed)
    pairs = [
        (f"i{i}", f"u{u}") for i in range(120) for u in rng.integers(0, 25, size=rng.integers(1, 4))
    ]
    g = AttributionGraph.from_pairs(pairs)
    rep = bound_contributions(g, k, seed=seed)
    counts = np.zeros(g.num_users, dtype=int)
    for i in rep.kept:
        counts[g.item_users[i]] += 1
    assert counts.max() <= k
    assert rep.dropped == g.num_items - len(rep.kept)
    # Greedy is maximal: every dropped item has a user at the cap.
    for i in set(range(g.num_items)) - set(rep.kept):
        assert any(counts[u] >= k for u in g.item_users[i])


def test_bounded_graph_feeds_multi_attribution_sampler():
    g = AttributionGraph.from_pairs(
        [(f"p{i}", f"a{(i * 7) % 30}") for i in range(90)]
        + [(f"p{i}", f"a{(i * 11) % 30}") for i in range(0, 90, 3)]
    )
    rep = bound_contributions(g, 2)
    s = MultiAttributionSampler([g.item_users[i] for i in rep.kept], g.num_users, 3, 0.3, seed=1)
    assert sum(len(s.sample()) for _ in range(10)) > 0
