"""Parser and checker for the shapes world's caption grammar (mmgeo.data.shapes, docs/design.md §5, §9).

``parse`` reads any of the five templates into a ``ParsedCaption`` (template, mentioned objects,
count word) that ``render`` writes back word for word; ``describes(caption, scene)`` says whether a
caption is a correct *and complete* description of a scene: a bijection between mentioned and scene
objects under which every stated size, colour, shape, cell, relation and the count hold. The relation
template places its first object on the grid and every other one relative to it ("above and to the
left of it"), so it constrains positions only relatively; the checker reads it that way.

The relation semantics are written here independently of the generator, so the checker catches a
generator (or an edit) that says something false.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from mmgeo.data.shapes import CELL_PHRASES, COLORS, COUNT_WORDS, SHAPES, SIZE_WORDS, ShapeObject

TEMPLATES = ("list", "there_is", "where_first", "relations", "count")
SIZE_OF_WORD = {w: size for size, words in SIZE_WORDS.items() for w in words}
CELL_OF_PHRASE = {p: cell for cell, phrases in CELL_PHRASES.items() for p in phrases}
_PHRASE_TOKENS = sorted(((tuple(p.split()), p) for p in CELL_OF_PHRASE), key=lambda t: -len(t[0]))
# relation words -> (sign of row(a) - row(anchor), sign of col(a) - col(anchor)); "above" = smaller row
_VERTICAL = {"above": -1, "below": 1, "": 0}
_HORIZONTAL = {"to the left of": -1, "to the right of": 1, "": 0}
RELATIONS = {(f"{v} and {h}" if v and h else v or h): (dv, dh)
             for v, dv in _VERTICAL.items() for h, dh in _HORIZONTAL.items() if v or h}


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


def relation_words(obj: ShapeObject, anchor: ShapeObject) -> str:
    """Where ``obj`` lies relative to ``anchor`` in the grammar's words ("" when they share a cell)."""
    signs = (_sign(obj.cell[0] - anchor.cell[0]), _sign(obj.cell[1] - anchor.cell[1]))
    return next((words for words, s in RELATIONS.items() if s == signs), "")


@dataclass(frozen=True)
class Mention:
    """One mentioned object: "a {size_word} {color} {shape}" and either a cell phrase or a relation; a typed query
    may leave the size unsaid (``size_word`` None: "a red circle", any size)."""

    size_word: str | None
    color: str
    shape: str
    where: str | None = None  # a phrase of CELL_PHRASES: the object's cell
    relation: str | None = None  # a key of RELATIONS: position relative to the first mention

    @property
    def size(self) -> str | None:
        return SIZE_OF_WORD[self.size_word] if self.size_word is not None else None

    @property
    def noun(self) -> str:
        return " ".join(w for w in ("a", self.size_word, self.color, self.shape) if w is not None)


@dataclass(frozen=True)
class ParsedCaption:
    template: str  # one of TEMPLATES
    mentions: tuple[Mention, ...]
    count_word: str | None = None  # count template only

    def render(self) -> str:
        """The caption text, exactly as ShapesWorld writes it."""
        ms = self.mentions
        if self.template == "where_first":
            return _join([f"{m.where} {m.noun}" for m in ms])
        if self.template == "relations":
            first = f"{ms[0].noun} {ms[0].where}"
            rest = [f"{m.noun} {m.relation} it" for m in ms[1:]]
            return first if not rest else first + " with " + _join(rest)
        body = _join([f"{m.noun} {m.where}" for m in ms])
        if self.template == "there_is":
            return "there is " + body
        if self.template == "count":
            return f"{self.count_word} {'shape' if self.count_word == 'one' else 'shapes'} : {body}"
        return body

    def with_mentions(self, mentions: tuple[Mention, ...]) -> ParsedCaption:
        """Same template with other mentions; the count word follows their number."""
        count = COUNT_WORDS[len(mentions) - 1] if self.template == "count" else None
        return replace(self, mentions=tuple(mentions), count_word=count)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else " , ".join(parts[:-1]) + " and " + parts[-1]


def _noun(toks: list[str], i: int) -> tuple[tuple[str, str, str], int] | None:
    w = toks[i:i + 4]
    if len(w) == 4 and w[0] == "a" and w[1] in SIZE_OF_WORD and w[2] in COLORS and w[3] in SHAPES:
        return (w[1], w[2], w[3]), i + 4
    return None


def _phrase(toks: list[str], i: int) -> tuple[str, int] | None:
    for words, phrase in _PHRASE_TOKENS:  # longest first
        if tuple(toks[i:i + len(words)]) == words:
            return phrase, i + len(words)
    return None


def _part(toks: list[str], i: int, kind: str) -> tuple[Mention, int] | None:
    """One object at token ``i``: kind "noun_where", "where_noun" or "noun_relation" ("... it")."""
    if kind == "where_noun":
        got = _phrase(toks, i)
        nn = got and _noun(toks, got[1])
        return nn and (Mention(*nn[0], where=got[0]), nn[1])
    nn = _noun(toks, i)
    if not nn:
        return None
    if kind == "noun_where":
        got = _phrase(toks, nn[1])
        return got and (Mention(*nn[0], where=got[0]), got[1])
    end = toks.index("it", nn[1]) if "it" in toks[nn[1]:] else -1
    relation = " ".join(toks[nn[1]:end])
    return (Mention(*nn[0], relation=relation), end + 1) if end > 0 and relation in RELATIONS else None


def _parts(toks: list[str], i: int, kind: str, stop: str | None = None) -> tuple[list[Mention], int] | None:
    """A list joined as "p1 , p2 , ... and pn"; stops at the end or at the token ``stop``."""
    mentions, seps = [], []
    while True:
        got = _part(toks, i, kind)
        if not got:
            return None
        mentions.append(got[0])
        i = got[1]
        if i == len(toks) or toks[i] == stop:
            break
        if toks[i] not in (",", "and"):
            return None
        seps.append(toks[i])
        i += 1
    if seps and (seps[-1] != "and" or any(s != "," for s in seps[:-1])):
        return None
    return mentions, i


def parse(caption: str) -> ParsedCaption | None:
    """The caption's structure, or None when it is not a sentence of the shapes-world grammar."""
    toks = caption.split()
    if not toks:
        return None
    if toks[:2] == ["there", "is"]:
        got = _parts(toks, 2, "noun_where")
        return got and got[1] == len(toks) and ParsedCaption("there_is", tuple(got[0])) or None
    if toks[0] in COUNT_WORDS and toks[1:3] in (["shape", ":"], ["shapes", ":"]):
        if (toks[1] == "shape") != (toks[0] == "one"):
            return None
        got = _parts(toks, 3, "noun_where")
        return got and got[1] == len(toks) and ParsedCaption("count", tuple(got[0]), toks[0]) or None
    if _phrase(toks, 0):
        got = _parts(toks, 0, "where_noun")
        return got and got[1] == len(toks) and ParsedCaption("where_first", tuple(got[0])) or None
    got = _parts(toks, 0, "noun_where", stop="with")
    if not got:
        return None
    mentions, i = got
    if i == len(toks):
        return ParsedCaption("list", tuple(mentions))
    if len(mentions) != 1:  # "with" follows the first object only
        return None
    rest = _parts(toks, i + 1, "noun_relation")
    return rest and rest[1] == len(toks) and ParsedCaption("relations", (mentions[0], *rest[0])) or None


def holds(m: Mention, obj: ShapeObject, anchor: ShapeObject) -> bool:
    """Whether ``obj`` is what ``m`` says: its size, colour, shape, and its cell or its relation to ``anchor``."""
    if (m.size, m.color, m.shape) != (obj.size, obj.color, obj.shape):
        return False
    if m.where is not None:
        return CELL_OF_PHRASE[m.where] == obj.cell
    dv, dh = RELATIONS[m.relation]
    return (dv, dh) == (_sign(obj.cell[0] - anchor.cell[0]), _sign(obj.cell[1] - anchor.cell[1]))


def align(parsed: ParsedCaption, scene: list[ShapeObject]) -> tuple[int, ...] | None:
    """Scene index of each mention under a bijection satisfying the caption, or None if none exists."""
    if len(parsed.mentions) != len(scene):
        return None
    if parsed.template == "count" and COUNT_WORDS.index(parsed.count_word) + 1 != len(scene):
        return None
    for perm in itertools.permutations(range(len(scene))):  # at most 4! = 24
        anchor = scene[perm[0]]
        if all(holds(m, scene[k], anchor) for m, k in zip(parsed.mentions, perm)):
            return perm
    return None


def describes(caption: str, scene: list[ShapeObject]) -> bool:
    """True when ``caption`` is a correct and complete description of ``scene`` (module docstring)."""
    parsed = parse(caption)
    return parsed is not None and align(parsed, scene) is not None
