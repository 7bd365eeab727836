"""Rule-based caption edits that make text hard negatives for training (docs/design.md §9).

NegCLIP (Yuksekgonul et al., "When and why vision-language models behave like bags-of-words, and what
to do about it?", ICLR 2023) trains CLIP with captions whose words were swapped (nouns, adjectives,
phrases) so that the contrast hinges on word order and binding; SugarCREPE (Hsieh et al., NeurIPS 2023)
names the edit types (replace / swap of objects, attributes, relations). NegCLIP parses with spaCy and
SugarCREPE writes its negatives with an LLM; here the same kinds of edit come from small word lexicons over
the raw text only — no parser, no scene graph — so they apply to any free-text caption (Flickr30K, COCO)
as well as to the shapes world's:

    swap_attribute     two words of one attribute class trade places  ("blue shirt .. red dress" -> "red shirt ..")
    swap_noun          two nouns of the same number trade places      ("a purple circle .. a yellow square" ->
                                                                       "a purple square .. a yellow circle")
    replace_attribute  one colour / size / material / age word changes ("a big dog" -> "a small dog")
    replace_noun       one noun becomes another of its group           ("a dog" -> "a cat", "circle" -> "diamond")
    flip_relation      one spatial word or phrase flips                 ("left" -> "right", "in front of" -> "behind")
    add_axis           a relation on one axis gains the other          ("below it" -> "below and to the left of it")

Spacing, punctuation and case are kept (case goes with the position: a sentence-initial "Blue" swapped
with "red" gives "Red ... blue"); an indefinite article right before a changed word follows it
("an orange hat" -> "a blue hat"). Swaps keep the caption's multiset of words (up to that a/an choice):
the negative is the same bag of words, only bound differently — the point of NegCLIP's negatives.
Limits: lexical rules mis-fire on ambiguous words ("orange" the fruit, "left" the verb); such noise is
tolerated by the method. ``add_axis`` is false only where a relation on one axis means the other is level, as in
the shapes world's grammar ("with B below it": the same column); free text ("a cat above the sofa") does not say
so, so it is not among ``EDIT_KINDS`` (the default draw) and a config names it to use it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

import numpy as np

EDIT_KINDS = ("swap_attribute", "swap_noun", "replace_attribute", "replace_noun", "flip_relation")  # the default
ALL_EDIT_KINDS = (*EDIT_KINDS, "add_axis")  # every kind a config may name

# attribute class -> {word: canonical value}; words with the same value are synonyms and never swapped.
_COLORS = {w: w for w in "red orange yellow green blue purple pink brown black white gray silver gold tan beige "
           "maroon teal turquoise navy violet".split()} | {"grey": "gray", "golden": "gold"}
ATTRIBUTES: dict[str, dict[str, str]] = {
    "color": _COLORS,
    "size": {"big": "large", "large": "large", "huge": "large", "giant": "large", "small": "small",
             "little": "small", "tiny": "small", "tall": "tall", "short": "short", "long": "long"},
    "material": {w: w for w in "wooden metal plastic glass stone brick leather denim wool cotton paper".split()},
    "age": {"young": "young", "younger": "young", "old": "old", "older": "old", "elderly": "old"},
}
# replace_attribute draws from these values instead of "any other value" (antonyms make real negatives).
_OPPOSITE = {"large": ("small",), "small": ("large",), "tall": ("short",), "short": ("tall", "long"),
             "long": ("short",), "young": ("old",), "old": ("young",)}

# noun group -> singular nouns; replace_noun stays inside a group, swap_noun pairs any two nouns.
_NOUN_GROUPS = {
    "shape": "circle square triangle diamond",
    "person": "man woman boy girl child kid baby person guy lady gentleman toddler teenager player worker biker "
              "cyclist rider skier snowboarder surfer skateboarder swimmer runner dancer musician singer guitarist "
              "drummer officer policeman soldier student teacher doctor nurse chef cook vendor clown performer "
              "climber hiker tourist fisherman farmer",
    "animal": "dog puppy cat kitten horse cow sheep bird duck goat pig bull elephant camel bear fish chicken monkey "
              "deer giraffe zebra lion tiger",
    "clothing": "shirt t-shirt dress hat cap helmet jacket coat sweater hoodie vest skirt shoe boot sneaker glove "
                "scarf tie suit uniform costume apron backpack bag purse bikini swimsuit outfit jersey sweatshirt",
    "vehicle": "car truck bus bike bicycle motorcycle boat train plane airplane van taxi tractor scooter skateboard "
               "surfboard snowboard cart wagon kayak canoe",
    "object": "ball frisbee kite umbrella sign flag bottle cup table chair bench guitar drum microphone camera phone "
              "book newspaper box basket rope stick toy balloon bat racket net ladder fence wall door window tent "
              "pole bucket sculpture statue poster banner hose",
    "place": "street road sidewalk beach park field lake river pool mountain hill city stage room kitchen "
             "restaurant store shop market bridge house yard playground forest building tree rock wave",
    "food": "pizza cake sandwich apple banana hotdog burger",
    "body": "hand arm head face leg foot mouth",
}
_IRREGULAR = {"man": "men", "woman": "women", "child": "children", "person": "people", "foot": "feet",
              "sheep": "sheep", "fish": "fish", "deer": "deer", "policeman": "policemen", "fisherman": "fishermen",
              "gentleman": "gentlemen"}
_PLURAL_ONLY = {"clothing": "jeans pants shorts sunglasses glasses trousers overalls"}


def plural(noun: str) -> str:
    """The plural of a lexicon noun ("circle" -> "circles", "man" -> "men")."""
    if noun in _IRREGULAR:
        return _IRREGULAR[noun]
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _noun_lexicon() -> dict[str, tuple[str, str]]:
    """word -> (group, number), number "s" (singular) or "p" (plural)."""
    lex = {}
    for group, words in _NOUN_GROUPS.items():
        for w in words.split():
            lex.setdefault(plural(w), (group, "p"))
            lex[w] = (group, "s")  # sheep / fish / deer: taken as singular
    for group, words in _PLURAL_ONLY.items():
        lex.update({w: (group, "p") for w in words.split()})
    return lex


NOUNS: dict[str, tuple[str, str]] = _noun_lexicon()  # a few hundred dict entries: negligible at import
_NOUNS_BY_KEY: dict[tuple[str, str], tuple[str, ...]] = {}
for _w, _key in NOUNS.items():
    _NOUNS_BY_KEY[_key] = (*_NOUNS_BY_KEY.get(_key, ()), _w)
_ATTR_CLASS = {w: cls for cls, words in ATTRIBUTES.items() for w in words}

# spatial words and phrases -> their flip (one- and three-word entries; phrases are matched first).
RELATIONS = {"left": "right", "right": "left", "top": "bottom", "bottom": "top", "above": "below",
             "below": "above", "upper": "lower", "lower": "upper", "over": "under", "under": "over",
             "inside": "outside", "outside": "inside", "behind": "in front of", "in front of": "behind",
             "on top of": "underneath", "underneath": "on top of", "beneath": "above"}
_PHRASES = {tuple(k.split()): v for k, v in RELATIONS.items() if " " in k}

_WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")
_NO_AN = ("uni", "use", "usu", "one", "eu")  # vowel letter, consonant sound: "a uniform"


def _match_case(src: str, new: str) -> str:
    if len(src) > 1 and src.isupper():
        return new.upper()
    return new[:1].upper() + new[1:] if src[:1].isupper() else new


def _article(word: str) -> str:
    w = word.lower()
    return "an" if (w[:1] in "aeiou" and not w.startswith(_NO_AN)) or w.startswith(("hour", "honest")) else "a"


class _Caption:
    """The caption's word spans, looked up once, shared by every edit of one caption."""

    def __init__(self, text: str, vocabulary: Collection[str] | None = None):
        self.text, self.vocabulary = text, vocabulary
        self.spans = [m.span() for m in _WORD.finditer(text)]
        self.words = [text[a:b].lower() for a, b in self.spans]

    def adjacent(self, i: int) -> bool:
        """Words i and i+1 are separated by whitespace only."""
        return i + 1 < len(self.spans) and self.text[self.spans[i][1]:self.spans[i + 1][0]].isspace()

    def attributes(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, w in enumerate(self.words):
            if w in _ATTR_CLASS:
                out.setdefault(_ATTR_CLASS[w], []).append(i)
        return out

    def nouns(self) -> list[int]:
        """Positions of lexicon nouns that head their phrase ("water" in "water bottle" is skipped)."""
        return [i for i, w in enumerate(self.words)
                if w in NOUNS and not (self.adjacent(i) and self.words[i + 1] in NOUNS)]

    def relations(self) -> list[tuple[int, int]]:
        """Word ranges [i, j) of spatial words / phrases; a phrase hides the single words inside it."""
        out, i, n = [], 0, len(self.words)
        while i < n:
            three = tuple(self.words[i:i + 3])
            if three in _PHRASES and self.adjacent(i) and self.adjacent(i + 1):
                out.append((i, i + 3))
                i += 3
                continue
            if self.words[i] in RELATIONS:
                out.append((i, i + 1))
            i += 1
        return out

    def allowed(self, new: str) -> bool:
        """``new`` uses only words of the vocabulary (if one was given)."""
        return self.vocabulary is None or all(w in self.vocabulary for w in new.split())

    def rewrite(self, changes: dict[tuple[int, int], str]) -> str:
        """Replace word ranges [i, j) with new text (case from the old first word), fixing a/an before them."""
        edits = []
        for (i, j), new in changes.items():
            start, end = self.spans[i][0], self.spans[j - 1][1]
            edits.append((start, end, _match_case(self.text[start:end], new)))
            if i > 0 and self.words[i - 1] in ("a", "an") and self.adjacent(i - 1):
                a, b = self.spans[i - 1]
                edits.append((a, b, _match_case(self.text[a:b], _article(new))))
        edits.sort()
        parts, pos = [], 0
        for start, end, new in edits:
            parts += [self.text[pos:start], new]
            pos = end
        return "".join(parts) + self.text[pos:]


def _pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


def _pick_weighted(rng: np.random.Generator, kinds: Sequence[str], weights: Mapping[str, float]) -> str:
    w = np.array([float(weights.get(k, 1.0)) for k in kinds])  # (len(kinds),)
    return kinds[int(rng.choice(len(kinds), p=w / w.sum()))]


def _swap_attribute(c: _Caption, rng: np.random.Generator) -> str | None:
    pairs = [(i, j) for cls, pos in c.attributes().items() for a, i in enumerate(pos) for j in pos[a + 1:]
             if ATTRIBUTES[cls][c.words[i]] != ATTRIBUTES[cls][c.words[j]]]
    if not pairs:
        return None
    i, j = _pick(rng, pairs)
    return c.rewrite({(i, i + 1): c.words[j], (j, j + 1): c.words[i]})


def _swap_noun(c: _Caption, rng: np.random.Generator) -> str | None:
    pos = c.nouns()
    pairs = [(i, j) for a, i in enumerate(pos) for j in pos[a + 1:]
             if c.words[i] != c.words[j] and NOUNS[c.words[i]][1] == NOUNS[c.words[j]][1]]
    if not pairs:
        return None
    i, j = _pick(rng, pairs)
    return c.rewrite({(i, i + 1): c.words[j], (j, j + 1): c.words[i]})


def _replace_attribute(c: _Caption, rng: np.random.Generator) -> str | None:
    pos = [i for i, w in enumerate(c.words) if w in _ATTR_CLASS]
    if not pos:
        return None
    i = _pick(rng, pos)
    values = ATTRIBUTES[_ATTR_CLASS[c.words[i]]]
    old = values[c.words[i]]
    targets = _OPPOSITE.get(old) or tuple(v for v in dict.fromkeys(values.values()) if v != old)
    words = [w for w, v in values.items() if v in targets and c.allowed(w)]
    return c.rewrite({(i, i + 1): _pick(rng, words)}) if words else None


def _replace_noun(c: _Caption, rng: np.random.Generator) -> str | None:
    pos = c.nouns()
    if not pos:
        return None
    i = _pick(rng, pos)
    words = [w for w in _NOUNS_BY_KEY[NOUNS[c.words[i]]] if w != c.words[i] and c.allowed(w)]
    return c.rewrite({(i, i + 1): _pick(rng, words)}) if words else None


def _flip_relation(c: _Caption, rng: np.random.Generator) -> str | None:
    spans = [(i, j) for i, j in c.relations() if c.allowed(RELATIONS[" ".join(c.words[i:j])])]
    if not spans:
        return None
    i, j = _pick(rng, spans)
    return c.rewrite({(i, j): RELATIONS[" ".join(c.words[i:j])]})


_VERTICAL = ("above", "below")
_HORIZONTAL = (("to", "the", "left", "of"), ("to", "the", "right", "of"))


def _add_axis(c: _Caption, rng: np.random.Generator) -> str | None:
    """A vertical relation word with no horizontal phrase after it gains one ("below" -> "below and to the left
    of"); a horizontal phrase with no vertical word before it gains one ("to the left of" -> "above and to the
    left of"). The new axis's direction is drawn."""
    w, n = c.words, len(c.words)

    def phrase_at(i: int, words: tuple[str, ...]) -> bool:
        return tuple(w[i:i + len(words)]) == words and all(c.adjacent(k) for k in range(i, i + len(words) - 1))

    def horizontal_at(i: int) -> bool:
        return any(phrase_at(i, h) for h in _HORIZONTAL)

    spans: list[tuple[int, int, tuple[str, ...]]] = []  # (i, j, texts the words [i, j) may become)
    for i in range(n):
        if w[i] in _VERTICAL and not (i + 1 < n and w[i + 1] == "and" and horizontal_at(i + 2)):
            spans.append((i, i + 1, tuple(f"{w[i]} and {' '.join(h)}" for h in _HORIZONTAL)))
        elif horizontal_at(i) and not (i >= 2 and w[i - 1] == "and" and w[i - 2] in _VERTICAL):
            spans.append((i, i + 4, tuple(f"{v} and {' '.join(w[i:i + 4])}" for v in _VERTICAL)))
    spans = [(i, j, new) for i, j, options in spans if (new := [o for o in options if c.allowed(o)])]
    if not spans:
        return None
    i, j, options = _pick(rng, spans)
    return c.rewrite({(i, j): _pick(rng, options)})


_EDITS = {"swap_attribute": _swap_attribute, "swap_noun": _swap_noun, "replace_attribute": _replace_attribute,
          "replace_noun": _replace_noun, "flip_relation": _flip_relation, "add_axis": _add_axis}


def check_kinds(kinds: Sequence[str]) -> None:
    """Raise ValueError naming the kinds that are not edit kinds (``ALL_EDIT_KINDS``)."""
    bad = [k for k in kinds if k not in _EDITS]
    if bad:
        raise ValueError(f"unknown caption edit kind(s) {bad}; choose from {list(ALL_EDIT_KINDS)}")


def edit_caption(caption: str, kind: str, rng: np.random.Generator,
                 vocabulary: Collection[str] | None = None) -> str | None:
    """One ``kind`` edit of ``caption`` (see the module docstring), or None when the kind does not apply.

    ``vocabulary`` (lower-case words), when given, limits the words an edit may bring in — e.g. the
    shapes world's ``ShapesWorld.vocabulary()``, so that a negative is not told apart by an unknown word.
    """
    check_kinds([kind])
    return _EDITS[kind](_Caption(caption, vocabulary), rng)


def check_kind_weights(weights: Mapping[str, float], kinds: Sequence[str] = EDIT_KINDS) -> None:
    """Raise ValueError unless ``weights`` maps some of ``kinds`` to positive finite numbers."""
    check_kinds(list(weights))
    outside = [k for k in weights if k not in kinds]
    if outside:
        raise ValueError(f"edit kind weight(s) for {outside}, which are not among the kinds drawn from {list(kinds)}; "
                         "add them to the kinds or drop their weights")
    bad = {k: w for k, w in weights.items() if not (isinstance(w, (int, float)) and 0 < w < float("inf"))}
    if bad:
        raise ValueError(f"edit kind weights must be positive numbers, got {bad}")


def caption_negatives(caption: str, rng: np.random.Generator, n: int = 1,
                      kinds: Sequence[str] = EDIT_KINDS, vocabulary: Collection[str] | None = None,
                      weights: Mapping[str, float] | None = None) -> list[str]:
    """Up to ``n`` distinct edited captions, each different from ``caption`` (NegCLIP-style text negatives).

    Each draw picks an edit kind among those that still apply: uniformly, or in proportion to ``weights``
    (kind -> relative weight, 1 for a kind not named; e.g. ``{"replace_noun": 3}`` makes noun replacements
    three times as likely as each other kind). Fewer than ``n`` come back when the caption offers fewer
    distinct edits (none for a caption without lexicon words). Deterministic given the state of ``rng``
    (no weights: the same draws as before weights existed); ``vocabulary`` as in :func:`edit_caption`.
    """
    check_kinds(kinds)
    if weights:
        check_kind_weights(weights, kinds)
    c, pool, out = _Caption(caption, vocabulary), list(kinds), []
    for _ in range(4 * n):
        if len(out) >= n or not pool:
            break
        kind = _pick_weighted(rng, pool, weights) if weights else _pick(rng, pool)
        neg = _EDITS[kind](c, rng)
        if neg is None:
            pool.remove(kind)  # depends on the words only: it will never apply to this caption
        elif neg != caption and neg not in out:
            out.append(neg)
    return out
