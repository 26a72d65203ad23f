"""arXiv-style multi-author data (004 §6–7.3: one paper belongs to all its authors): the arXiv
metadata snapshot's JSON-lines format, author normalisation to stable user ids, the example → users
attribution graph, and a seeded generator writing the same format.

One line per paper, as in the public metadata snapshot::

    {"id": "0704.0001", "authors": "C. Balázs, E. L. Berger and C.-P. Yuan", "title": "...",
    "abstract": "...", "categories": "hep-ph hep-ex", "authors_parsed": [["Balázs", "C.", ""],
    ["Berger", "E. L.", ""], ...], ...}

Author ids come from ``authors_parsed`` when present (else from splitting ``authors``): accents and
LaTeX accent macros removed, lower case, punctuation dropped, ``last|first``; a name written wholly
outside the Latin script keeps its own letters. A paper with an author whose last name keeps no
letter or digit is refused (or skipped), never attributed to its other authors alone.

Merging two people under one id only makes the per-user bound cover both (safe); splitting one
person under two ids would weaken it, which is why ``key="initial"`` (last name + first initial,
more merging) is offered for messy sources.
"""

from __future__ import annotations

import json
import logging
import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from corrflow.data.lexicon import Lexicon, synthetic_word
from corrflow.errors import DataFormatError, require
from corrflow.fileio import atomic_file
from corrflow.participation.attribution import AttributionGraph

log = logging.getLogger(__name__)

_LATEX_ACCENT = re.compile(r"\\[`'^\"~=.uvHcdbtk]\s*\{?([A-Za-z])\}?|\\([a-zA-Z]+)\s*|[{}]")
_NOT_WORD = re.compile(r"[^a-z0-9 ]+")


@dataclass(frozen=True)
class Paper:
    id: str
    authors: tuple[str, ...]  # normalised author ids (distinct, in paper order)
    title: str
    abstract: str
    categories: tuple[str, ...]

    @property
    def text(self) -> str:
        return f"{self.title} {self.abstract}".strip()


def _clean(name: str) -> str:
    name = _LATEX_ACCENT.sub(lambda m: m.group(1) or "", name)
    name = unicodedata.normalize("NFKD", name)
    name = (
        "".join(c for c in name if not unicodedata.combining(c))
        .lower()
        .replace("-", " ")
        .replace(".", " ")
    )
    latin = " ".join(_NOT_WORD.sub("", name).split())
    if latin:
        return latin
    # a name written wholly outside the Latin script (谭九鼎, Иванов): its own letters and digits,
    # lower-cased — dropping it would leave that author's papers unattributed to them
    return " ".join("".join(c for c in name if c.isalnum() or c.isspace()).split())


def normalize_author(last: str, first: str = "", suffix: str = "", key: str = "full") -> str:
    """Stable author id ``last|first`` (``key="initial"``: ``last|f``); suffixes like Jr are kept in
    the last name."""
    require(key in ("full", "initial"), "key", "'full' or 'initial'", key)
    last_c = " ".join(p for p in (_clean(last), _clean(suffix)) if p)
    first_c = _clean(first)
    if key == "initial":
        first_c = first_c[:1]
    return f"{last_c}|{first_c}"


def split_authors(authors: str) -> list[tuple[str, str]]:
    """(last, first) pairs from the free-text ``authors`` field ("A. B. Smith, C. Jones and D.
    Lee")."""
    text = re.sub(r"\([^)]*\)", " ", authors)  # affiliations in parentheses
    parts = [p.strip() for p in re.split(r",|\band\b|;", text) if p.strip()]
    out = []
    for p in parts:
        tokens = p.split()
        out.append((tokens[-1], " ".join(tokens[:-1])))
    return out


class ArxivReader:
    """Stream papers from a JSON-lines file. ``on_error="raise"`` (default) stops at the first bad
    line naming file and line; ``"skip"`` drops it, counts it in ``skipped`` and logs one warning.
    ``min_authors`` filters (and counts in ``filtered``) papers with fewer authors — 004 §7.3 drops
    single-author papers."""

    def __init__(
        self,
        path: str | os.PathLike,
        on_error: str = "raise",
        min_authors: int = 1,
        key: str = "full",
    ):
        self.path = Path(path)
        require(on_error in ("raise", "skip"), "on_error", "'raise' or 'skip'", on_error)
        require(min_authors >= 1, "min_authors", "at least 1", min_authors)
        if not self.path.is_file():
            raise DataFormatError(self.path, None, "an existing JSON-lines file")
        self.on_error, self.min_authors, self.key = on_error, min_authors, key
        self.skipped = self.filtered = 0

    def _bad(self, line: int, expected: str, got) -> None:
        if self.on_error == "raise":
            raise DataFormatError(self.path, line, expected, got)
        if not self.skipped:
            log.warning(
                "%s:%d: skipping a malformed line (expected %s); the count is in 'skipped'",
                self.path,
                line,
                expected,
            )
        self.skipped += 1

    def _paper(self, obj: dict, line: int) -> Paper | None:
        pid = obj.get("id")
        if not isinstance(pid, str) or not pid.strip():
            return self._bad(line, "a non-empty string 'id'", obj.get("id"))
        parsed = obj.get("authors_parsed")
        if parsed is not None:
            if not isinstance(parsed, list) or not all(
                isinstance(a, list) and a and all(isinstance(x, str) for x in a) for a in parsed
            ):
                return self._bad(
                    line,
                    "'authors_parsed' as a list of [last, first, suffix] string lists",
                    str(parsed)[:60],
                )
            names = [normalize_author(*(a + ["", ""])[:3], key=self.key) for a in parsed]
        elif isinstance(obj.get("authors"), str):
            names = [
                normalize_author(last, first, key=self.key)
                for last, first in split_authors(obj["authors"])
            ]
        else:
            return self._bad(line, "'authors_parsed' or a string 'authors'", None)
        if not names or not all(n.split("|")[0] for n in names):
            # an author left out of a paper's authors would escape their contribution bound:
            # the paper is refused (or skipped), never attributed to the others alone
            return self._bad(
                line, "authors whose last names have a letter or digit", obj.get("authors")
            )
        authors = tuple(dict.fromkeys(names))
        for name in ("title", "abstract", "categories"):
            if not isinstance(obj.get(name, ""), str):
                return self._bad(line, f"a string {name!r}", obj.get(name))
        if len(authors) < self.min_authors:
            self.filtered += 1
            return None
        return Paper(
            pid.strip(),
            authors,
            " ".join(obj.get("title", "").split()),
            " ".join(obj.get("abstract", "").split()),
            tuple(obj.get("categories", "").split()),
        )

    def __iter__(self) -> Iterator[Paper]:
        with open(self.path, "rb") as f:  # bytes: a line of invalid UTF-8 is that line's error
            for line, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    self._bad(line, f"UTF-8 text ({exc.reason} at byte {exc.start})", raw[:60])
                    continue
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    self._bad(line, f"a JSON object ({exc.msg})", text.strip()[:60])
                    continue
                if not isinstance(obj, dict):
                    self._bad(line, "a JSON object", text.strip()[:60])
                    continue
                paper = self._paper(obj, line)
                if paper is not None:
                    yield paper


def arxiv_attribution(papers) -> AttributionGraph:
    """The public example → users graph (004 §3.1): item = paper id, users = its author ids."""
    return AttributionGraph.from_pairs((p.id, a) for p in papers for a in p.authors)


# --------------------------------------------------------------------------------------------------
# generator

_FIRST = (
    "Ada",
    "Alan",
    "Ana",
    "Bo",
    "Carla",
    "Chen",
    "David",
    "Elena",
    "Emma",
    "Farid",
    "Grace",
    "Hana",
    "Igor",
    "Ines",
    "Jan",
    "Jia",
    "Karl",
    "Kenji",
    "Lara",
    "Lei",
    "Maria",
    "Mei",
    "Nadia",
    "Noah",
    "Olga",
    "Omar",
    "Pablo",
    "Priya",
    "Quinn",
    "Rosa",
    "Ravi",
    "Sara",
    "Sven",
    "Tariq",
    "Uma",
    "Vera",
    "Wei",
    "Xin",
    "Yara",
    "Yusuf",
    "Zoe",
    "Aiko",
    "Bruno",
    "Dana",
    "Erik",
    "Fatima",
    "Gustav",
    "Helena",
    "Ivan",
    "Julia",
    "Kofi",
    "Lina",
    "Marco",
    "Nina",
    "Oscar",
    "Paula",
    "Rui",
    "Sofia",
    "Tomas",
)
_CATEGORIES = (
    "cs.LG",
    "cs.CL",
    "cs.CV",
    "cs.CR",
    "stat.ML",
    "math.OC",
    "math.PR",
    "quant-ph",
    "hep-th",
    "hep-ph",
    "astro-ph.GA",
    "cond-mat.str-el",
    "physics.optics",
    "q-bio.NC",
    "econ.EM",
    "math.ST",
    "cs.DS",
    "cs.IT",
    "eess.SP",
    "gr-qc",
)


@dataclass(frozen=True)
class ArxivSpec:
    """Parameters of the arXiv-style generator. A paper has 1 + Poisson(authors_mean − 1) authors,
    or with probability ``big_collab_p`` a Pareto(big_collab_alpha)-tailed collaboration of
    ``big_collab_min`` or more (capped at ``authors_max``). Each author slot is, with probability
    ``repeat_p``, one of the lead author's recent collaborators (repeat co-authorship); otherwise,
    while some of the ``users`` authors have not published yet, a newcomer with probability
    ``newcomer_p``; otherwise an author drawn by Pareto(productivity_alpha) productivity (the long
    tail of prolific authors). Generation stops once every author has a paper, so the data have
    exactly ``users`` users."""

    users: int = 1000
    seed: int = 0
    productivity_alpha: float = 1.5
    newcomer_p: float = 0.5
    authors_mean: float = 3.0
    big_collab_p: float = 0.02
    big_collab_min: int = 10
    big_collab_alpha: float = 1.2
    authors_max: int = 200
    repeat_p: float = 0.4
    memory: int = 8  # recent collaborators remembered per author
    abstract_words: tuple[int, int] = (60, 160)
    lexicon: Lexicon = field(default_factory=Lexicon)

    def __post_init__(self) -> None:
        require(self.users >= 2, "users", "at least 2", self.users)
        require(self.authors_mean >= 1, "authors_mean", "≥ 1", self.authors_mean)
        require(0 <= self.repeat_p < 1, "repeat_p", "a probability below 1", self.repeat_p)
        require(0 < self.newcomer_p <= 1, "newcomer_p", "a probability above 0", self.newcomer_p)
        require(
            self.big_collab_alpha > 0 and self.big_collab_min >= 1,
            "big_collab_alpha",
            "alpha > 0 and big_collab_min ≥ 1",
        )

    def team_size_pmf(self, cap: int | None = None) -> np.ndarray:
        """P(team = j) for j = 0..cap before de-duplication (index 0 unused): the mixture the
        generator draws."""
        from scipy.stats import poisson

        cap = min(self.authors_max, cap or self.authors_max)
        j = np.arange(cap + 1)
        body = np.where(j >= 1, poisson.pmf(j - 1, self.authors_mean - 1), 0.0)
        body[cap] += poisson.sf(cap - 1, self.authors_mean - 1)
        # P(X ≥ j)
        surv = np.minimum(1.0, (self.big_collab_min / np.maximum(j, 1)) ** self.big_collab_alpha)
        tail = np.zeros(cap + 1)
        tail[1:cap] = surv[1:cap] - surv[2 : cap + 1]
        tail[cap] = surv[cap]
        return (1 - self.big_collab_p) * body + self.big_collab_p * tail

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lexicon"] = asdict(self.lexicon)
        return d


def author_name(index: int) -> tuple[str, str]:
    """(last, first) of synthetic author ``index``: the last name is unique per index, so ids never
    collide."""
    return synthetic_word(1000 + index).capitalize(), _FIRST[index % len(_FIRST)]


def generate_arxiv(path: str | os.PathLike, spec: ArxivSpec, progress=None) -> dict:
    """Write arXiv metadata JSON lines until all ``spec.users`` authors have published (temp file
    renamed into place). Memory is O(users · memory) for the productivity CDF and collaborator
    rings, never O(papers)."""
    rng = np.random.default_rng([spec.seed, 21])
    n = spec.users
    authors = _Authors(rng, spec)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    links = papers = 0
    with atomic_file(path, "w") as f:
        while authors.newcomer() is not None:
            if rng.random() < spec.big_collab_p:
                k = int(
                    spec.big_collab_min * (1.0 - rng.random()) ** (-1.0 / spec.big_collab_alpha)
                )
            else:
                k = 1 + int(rng.poisson(spec.authors_mean - 1))
            team = authors.team(min(k, spec.authors_max, n))
            links += len(team)
            record = _paper_record(rng, spec, team, papers)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            papers += 1
            if progress is not None:
                progress(int(authors.seen.sum()) if papers % 1000 == 0 else None)
    return {"papers": papers, "users": n, "links": links}


class _Authors:
    """The generator's authors: a heavy-tailed productivity (drawn by its CDF), newcomers joining
    in index order, and each author's ring of up to ``spec.memory`` remembered collaborators."""

    def __init__(self, rng: np.random.Generator, spec: ArxivSpec):
        self.rng, self.spec, self.n = rng, spec, spec.users
        productivity = (1.0 - rng.random(self.n)) ** (-1.0 / spec.productivity_alpha)
        self.cdf = np.cumsum(productivity)
        self.cdf /= self.cdf[-1]
        self.ring = np.full((self.n, spec.memory), -1, dtype=np.int32)
        self.ring_pos = np.zeros(self.n, dtype=np.int16)
        self.seen = np.zeros(self.n, dtype=bool)
        self.unseen_next = 0  # newcomers join in index order (productivity is random per index)

    def newcomer(self) -> int | None:
        while self.unseen_next < self.n and self.seen[self.unseen_next]:
            self.unseen_next += 1
        return self.unseen_next if self.unseen_next < self.n else None

    def draw(self, lead: int | None) -> int:
        rng, ring = self.rng, self.ring
        if lead is not None and rng.random() < self.spec.repeat_p:
            known = ring[lead][ring[lead] >= 0]
            if known.size:
                return int(known[rng.integers(known.size)])
        if rng.random() < self.spec.newcomer_p and (a := self.newcomer()) is not None:
            return a
        return int(np.searchsorted(self.cdf, rng.random(), side="right").clip(0, self.n - 1))

    def team(self, k: int) -> list[int]:
        """A paper's k authors (fewer when 10·k draws find no more), the lead first; each then
        remembers the others."""
        lead = self.draw(None)
        team = [lead]
        members = {lead}
        for _ in range(10 * k):
            if len(team) == k:
                break
            a = self.draw(lead)
            if a not in members:
                members.add(a)
                team.append(a)
        self.seen[team] = True
        memory = self.spec.memory
        for a in team:  # everyone remembers (up to `memory` of) the others
            for b in team[: memory + 1]:
                if b != a:
                    self.ring[a, self.ring_pos[a]] = b
                    self.ring_pos[a] = (self.ring_pos[a] + 1) % memory
        return team


def _paper_record(rng: np.random.Generator, spec: ArxivSpec, team: list[int], p: int) -> dict:
    """Paper number ``p``'s metadata line: a title and abstract from the lead author's topic, its
    categories and the authors in arXiv's formats."""
    lex = spec.lexicon
    topic = team[0] % lex.topics
    n_abstract = int(rng.integers(*spec.abstract_words))
    draws = lex.sample(rng, topic, 10 + n_abstract)
    words = lex.word_array[
        lex.chain(rng, draws, np.array([topic, topic]), np.array([10, n_abstract]))
    ]
    names = [author_name(a) for a in team]
    cats = [_CATEGORIES[topic % len(_CATEGORIES)]]
    if rng.random() < 0.3:
        cats.append(_CATEGORIES[int(rng.integers(len(_CATEGORIES)))])
    return {
        "id": f"{(7 + p // 99_999 // 12) % 100:02d}{p // 99_999 % 12 + 1:02d}.{p % 99_999 + 1:05d}",
        "submitter": " ".join(reversed(names[0])),
        "authors": ", ".join(f"{first} {last}" for last, first in names[:-1])
        + (" and " if len(names) > 1 else "")
        + f"{names[-1][1]} {names[-1][0]}",
        "title": " ".join(words[:10]).capitalize(),
        "categories": " ".join(dict.fromkeys(cats)),
        "abstract": " ".join(words[10:]).capitalize() + ".",
        "authors_parsed": [[last, first, ""] for last, first in names],
    }
