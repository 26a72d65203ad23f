"""Federated datasets: TensorFlow Federated's StackOverflow SQLite and the arXiv metadata JSON lines
(loaders and seeded generators writing the same formats), vocabulary and next-word sequences,
statistics and partitioning over Flower nodes; plus the small on-the-fly tasks (regression,
synthetic text) the quick simulations use.
"""

from corrflow.data.arxiv import ArxivReader, ArxivSpec, arxiv_attribution, generate_arxiv
from corrflow.data.stackoverflow import (
    StackOverflowSpec,
    StackOverflowSQLite,
    generate_stackoverflow,
)
from corrflow.data.stats import dataset_stats
from corrflow.data.vocab import Vocabulary, build_vocabulary

__all__ = [
    "ArxivReader",
    "ArxivSpec",
    "StackOverflowSQLite",
    "StackOverflowSpec",
    "Vocabulary",
    "arxiv_attribution",
    "build_vocabulary",
    "dataset_stats",
    "generate_arxiv",
    "generate_stackoverflow",
]
