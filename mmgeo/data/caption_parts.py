"""Sub-captions: a caption cut by rule into its object phrases, so training sees partial descriptions
(docs/design.md §9).

People search by naming part of a picture ("a purple circle in the top right"), and real captions (Flickr30K,
COCO) name parts too; a model trained only on captions that name every object learns that any attribute
identifies the image. ``partial_caption`` keeps one or two object phrases of a caption, a positive for the same
image; the caption negatives (``mmgeo.data.caption_edits``) then edit that sub-caption, so a replaced colour,
shape or place of the one named object is the hard negative. ``fewer_phrases`` leaves one phrase out of a
caption: true of its image but naming less of it, an image->text negative that teaches the image to prefer the
caption naming more of it (the tie-break a full caption needs among images that hold its objects and more).
``typed_caption`` writes a caption the way people type a search: a phrase placed from another ("A in the top left
with B below it") as "B below A" (``typed_relation``), else the objects alone, a count kept ("two shapes : A and
B", ``objects_only``), or, when the caption names two or more objects of one colour and noun, how many
(``plural_count``: "two yellow circles").

The rules read the caption text only — no parser, no scene graph — so they apply to free text:

    prefix          "there is / are ..." and "two shapes : ..." lose the words before the description; the
                    count such a prefix states is ``stated_count``
    split           at ",", ";", "and", "with", "while" when the next word opens a phrase: a determiner
                    ("a", "the", "two", ...) or a place preposition ("in", "at", "on") — "black and white" stays
    keep            a piece holds a lexicon noun (``caption_edits.NOUNS``); one without is glued to the one before
    anaphora        a piece that ends in "it" / "them" ("a blue square below it") refers to another object:
                    it keeps its words up to its first noun ("a blue square")

Limits: lexical rules: "a man with a hat" gives "a hat", a true but small part of the picture; a clause
without a determiner after "and" ("a man sits and reads") stays whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from mmgeo.data.caption_edits import ATTRIBUTES, NOUNS, plural

_SEPARATORS = {",", ";", "and", "with", "while"}
_OPENERS = {"a", "an", "the", "two", "three", "four", "five", "several", "some", "many", "another", "one",
            "in", "at", "on"}
_ANAPHORA = {"it", "them"}
_PUNCT = re.compile(r"\s*([,;:])\s*")


def caption_words(caption: str) -> list[str]:
    """The caption's words, punctuation (",", ";", ":") split off as words of its own, a final full stop dropped."""
    return _PUNCT.sub(r" \1 ", caption.strip().rstrip(".")).split()


def _strip_prefix(words: list[str]) -> list[str]:
    if ":" in words:
        words = words[len(words) - words[::-1].index(":"):]
    if [w.lower() for w in words[:2]] in (["there", "is"], ["there", "are"]):
        words = words[2:]
    return words


_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def stated_count(caption: str) -> int | None:
    """How many things the caption says its picture holds, when it opens by counting them before a colon ("two
    shapes : ..."), else None: such a caption names every object, so it is not true of a picture with more."""
    words = [w.lower() for w in caption_words(caption)]
    if len(words) > 2 and words[2] == ":" and words[0] in _NUMBERS:
        return _NUMBERS.index(words[0]) + 1
    return None


def _noun_at(piece: list[str]) -> int | None:
    return next((i for i, w in enumerate(piece) if w.lower() in NOUNS), None)


def _pieces(caption: str) -> tuple[list[str], list[list[str]]]:
    """(the prefix's words, the caption's object pieces as word lists, anaphora kept): the split of the module
    docstring before "below it" is cut."""
    words = caption_words(caption)
    body = _strip_prefix(words)
    prefix = words[:len(words) - len(body)]
    pieces: list[tuple[str | None, list[str]]] = [(None, [])]  # (separator before it, its words)
    for i, w in enumerate(body):
        nxt = body[i + 1].lower() if i + 1 < len(body) else ""
        if w.lower() in _SEPARATORS and nxt in _OPENERS and pieces[-1][1]:
            pieces.append((w, []))
        elif w.lower() in _SEPARATORS and not pieces[-1][1] and pieces[-1][0] is not None:
            pieces[-1] = (f"{pieces[-1][0]} {w}", [])  # ", and a ...": both separators before the piece
        else:
            pieces[-1][1].append(w)
    out: list[list[str]] = []
    for sep, piece in pieces:
        if out and _noun_at(piece) is None:
            out[-1] += [*sep.split(), *piece]  # no noun: not an object phrase of its own, glued back
        elif piece:
            out.append(piece)
    trimmed = []
    for piece in out:
        while len(piece) > 1 and piece[-1] in (",", ";"):  # "two dogs play , and a child ...": no trailing comma
            piece = piece[:-1]
        trimmed.append(piece)
    return prefix, trimmed


def _anaphoric(piece: list[str]) -> bool:
    return piece[-1].lower() in _ANAPHORA and _noun_at(piece) is not None


def object_phrases(caption: str) -> list[str]:
    """The caption's object phrases in order (module docstring); one phrase when it names one thing."""
    phrases = []
    for piece in _pieces(caption)[1]:
        if _anaphoric(piece):
            piece = piece[:_noun_at(piece) + 1]  # "a blue square below it" -> "a blue square"
        phrases.append(" ".join(piece))
    return [p for p in phrases if p]


_DETERMINERS = (_OPENERS - {"in", "at", "on"}) | set(_NUMBERS)  # the openers that are no place preposition


def _object_words(piece: list[str]) -> list[str]:
    """A piece's object alone: from the determiner nearest before its noun to the noun ("in the top left a big
    red circle" -> "a big red circle", "a man in a red shirt" -> "a man")."""
    noun = _noun_at(piece)
    start = next((i for i in range(noun, -1, -1) if piece[i].lower() in _DETERMINERS), 0)
    return piece[start:noun + 1]


def _placed(pieces: list[list[str]]) -> list[list[str]]:
    """The pieces after the first that place their object from the first one ("a blue square below it")."""
    return [p for p in pieces[1:] if _anaphoric(p)] if pieces and _noun_at(pieces[0]) is not None else []


def typed_relation(caption: str, rng: np.random.Generator) -> str | None:
    """A relation as people type it: one phrase that places its object from the first one ("A in the top left
    with B below it" -> "B below A"), each object alone (``_object_words``); None when no phrase ends in "it" /
    "them"."""
    pieces = _pieces(caption)[1]
    placed = _placed(pieces)
    if not placed:
        return None
    piece = placed[int(rng.integers(len(placed)))]
    noun = _noun_at(piece)
    return " ".join(_object_words(piece) + piece[noun + 1:-1] + _object_words(pieces[0]))


def objects_only(caption: str) -> str | None:
    """The caption's objects alone (``_object_words``), a count prefix kept ("two shapes : A in the top left and
    B in the center" -> "two shapes : A and B"): objects named without where they are, as people type them;
    None when that changes nothing."""
    prefix, pieces = _pieces(caption)
    nouns = [" ".join(_object_words(p)) for p in pieces if _noun_at(p) is not None]
    if not nouns:
        return None
    body = nouns[0] if len(nouns) == 1 else " , ".join(nouns[:-1]) + " and " + nouns[-1]
    out = " ".join([*prefix, body]) if stated_count(caption) is not None else body
    return None if out == " ".join(caption_words(caption)) else out


def typed_caption(caption: str, rng: np.random.Generator, captions: Sequence[str] = (),
                  relations: float = 0.0, plurals: float = 0.0) -> str | None:
    """What people type for the picture the caption describes: ``typed_relation`` when the caption places an
    object from another, else ``objects_only``; None when neither rule changes it. With ``relations`` > 0, that
    share of the calls types a relation from one of the picture's ``captions`` that places an object (when one
    does), whichever caption was drawn: one template in five of the shapes world places objects. With ``plurals``
    > 0, that share of the calls whose caption names two or more objects of one kind types how many
    (``plural_count``: "two yellow circles"), before either."""
    counted = plural_count(caption, rng) if plurals else None
    if counted is not None and rng.random() < plurals:  # no draw when off, or when no kind is named twice
        return counted
    placing = [c for c in captions if _placed(_pieces(c)[1])] if relations else []
    if placing and rng.random() < relations:  # no draw when off, or when no caption places an object
        return typed_relation(placing[int(rng.integers(len(placing)))], rng)
    return typed_relation(caption, rng) or objects_only(caption)


def plural_count(caption: str, rng: np.random.Generator | None = None) -> str | None:
    """How many objects of one kind the caption names, as people type it: "a big yellow circle in the top left and
    a small yellow circle at the bottom" -> "two yellow circles" (the same colour words and noun, sizes and places
    aside); None when no kind is named twice. Several such kinds: one drawn by ``rng`` (None: the first). A caption
    that names every object of its picture (the shapes world's) gives the picture's count of that kind."""
    kinds: dict[tuple[tuple[str, ...], str], int] = {}
    for piece in _pieces(caption)[1]:
        noun = _noun_at(piece)
        if noun is None or NOUNS[piece[noun].lower()][1] != "s":
            continue
        colors = tuple(w.lower() for w in _object_words(piece) if w.lower() in ATTRIBUTES["color"])
        kind = (colors, piece[noun].lower())
        kinds[kind] = kinds.get(kind, 0) + 1
    many = [k for k, n in kinds.items() if 1 < n <= len(_NUMBERS)]
    if not many:
        return None
    colors, noun = many[int(rng.integers(len(many)))] if rng is not None and len(many) > 1 else many[0]
    return " ".join([_NUMBERS[kinds[(colors, noun)] - 1], *colors, plural(noun)])


def with_plurals(vocabulary: Sequence[str]) -> list[str]:
    """A word-level vocabulary with the plural of each of its singular lexicon nouns added (what ``plural_count``
    writes), sorted."""
    return sorted(set(vocabulary) | {plural(w) for w in vocabulary if NOUNS.get(w, ("", ""))[1] == "s"})


def partial_caption(caption: str, rng: np.random.Generator, max_objects: int = 2) -> str | None:
    """A sub-caption: 1..``max_objects`` of the caption's object phrases (fewer than all, in caption order)
    joined by "and"; None when the caption names fewer than two phrases."""
    phrases = object_phrases(caption)
    if len(phrases) < 2:
        return None
    k = int(rng.integers(1, min(max_objects, len(phrases) - 1) + 1))
    keep = np.sort(rng.choice(len(phrases), size=k, replace=False))
    return " and ".join(phrases[i] for i in keep)


def without_colors(caption: str) -> str:
    """The caption with its colour words left out ("a small red square on the left" -> "a small square on the
    left"): still true of its image, and of every image holding such an object in any colour, so it asks for the
    shape and the place apart from the colour. Colour words are ``caption_edits.ATTRIBUTES["color"]``'s."""
    return " ".join(w for w in caption.split() if w.lower() not in ATTRIBUTES["color"])


def fewer_phrases(caption: str, rng: np.random.Generator, n: int = 1) -> list[str]:
    """Up to ``n`` distinct copies of the caption with one of its object phrases left out: the others in caption
    order, listed as "A , B and C" (two: "A and B", as ``partial_caption`` joins them), so that the way a copy is
    written does not tell it from a caption; none when the caption names fewer than two phrases."""
    phrases = object_phrases(caption)
    if len(phrases) < 2 or n < 1:
        return []
    dropped = rng.choice(len(phrases), size=min(n, len(phrases)), replace=False)
    kept = [[p for i, p in enumerate(phrases) if i != d] for d in dropped]
    out = [" , ".join(k[:-1]) + " and " + k[-1] if len(k) > 1 else k[0] for k in kept]
    return list(dict.fromkeys(out))  # two equal phrases give one text
