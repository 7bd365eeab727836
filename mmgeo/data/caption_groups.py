"""Caption-neighbour batches: images whose captions read alike share a batch, and a caption true of another
image in its batch is not that image's negative (docs/design.md §9).

In random batches another image almost never differs from a caption's image in one attribute only (the same
colour, size and place, another shape), so text→image contrast never has to look at shape; only the caption
negatives teach it. ``caption_neighbours`` finds, for each image, the images whose captions are nearest in
TF-IDF cosine (``caption_features``: words and word pairs inside one object phrase, over all the image's captions);
``grouped_order`` turns an epoch's permutation into groups of ``group`` near neighbours, so each batch is made of
such groups. A sub-caption ("a big purple circle in the top right") is then often true of a neighbour too:
``caption_true_of`` says, from text alone, when a caption is true of an image — every object phrase of the
caption is, as a set of words, inside one object phrase of one of the image's captions
(``mmgeo.data.caption_parts``), naming the same place when it names one — and the loss drops those pairs from the
negatives. Measured on the shapes world, neither helped one-object queries (docs/design.md §9); both are off by
default (the edit terms use ``caption_true_of`` too). ``superset_neighbours`` groups an image instead with images
its whole caption is true of (they hold its objects and more): the pairs a whole caption must rank its own image
first in, which random batches almost never hold.

Limits: text rules only. Synonyms ("big" / "large") are different words, so a true caption worded otherwise
than all of the image's captions stays a negative (as in any random batch); neighbours are computed once per
run over the whole train split (map-style data; not for streamed shards).
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import torch

from mmgeo.data.caption_edits import RELATIONS
from mmgeo.data.caption_parts import caption_words, object_phrases

_DETERMINERS = {"a", "an", "the"}
# words that say where: a phrase naming a place is true only of a phrase naming the same one ("in the middle" is
# not "in the bottom middle", though its words are a subset); the prepositions of the relation phrases are left out.
PLACE_WORDS = frozenset(w for k in RELATIONS for w in k.split() if w not in ("in", "of", "on")) | {
    "middle", "center", "centre"}
_DENSE_LIMIT = 1 << 25  # N × V entries up to which the TF-IDF matrix is held dense (128 MB of float32)


def phrase_words(caption: str) -> list[frozenset[str]]:
    """The caption's object phrases, each as its set of lower-case words without determiners."""
    return [frozenset(w.lower() for w in p.split() if w.lower() not in _DETERMINERS) for p in object_phrases(caption)]


def _inside(p: frozenset[str], q: frozenset[str]) -> bool:
    """Phrase ``p`` says part of what ``q`` says: its words are among ``q``'s, and its place words (``PLACE_WORDS``),
    if any, are all of ``q``'s — fewer place words name another place, not less of the same one."""
    place = p & PLACE_WORDS
    return p <= q and (not place or place == q & PLACE_WORDS)


def caption_true_of(caption: list[frozenset[str]], image: list[frozenset[str]]) -> bool:
    """True when every phrase of ``caption`` (``phrase_words``) lies inside one phrase of ``image`` (the
    ``phrase_words`` of all the image's captions; ``_inside``)."""
    return bool(caption) and all(any(_inside(p, q) for q in image) for p in caption)


def true_of(captions: list[list[frozenset[str]]], images: list[list[frozenset[str]]]) -> torch.Tensor:
    """(N, B) bool: [n, j] when caption n is true of image j (``caption_true_of``), every pair — computed at once
    on word-incidence matrices (a training batch asks ~12,000 pairs; one by one they took most of the data
    worker's time): ``_inside`` for every pair of phrases as one product of 0/1 matrices over the caption phrases'
    words and a comparison of place-word counts, then any over each image's phrases and all over each caption's, as
    counts. Counts are small integers, exact in float32."""
    N, B = len(captions), len(images)
    phrases = [p for c in captions for p in c]  # P caption phrases
    targets = [q for image in images for q in image]  # Q image phrases
    if not phrases or not targets:
        return torch.zeros(N, B, dtype=torch.bool)
    column = {w: i for i, w in enumerate(sorted(set().union(*phrases)))}  # V: only a caption phrase's words decide
    p, q = _incidence(phrases, column), _incidence(targets, column)  # (P, V), (Q, V)
    subset = (p @ q.T) == p.sum(1, keepdim=True)  # (P, Q): every word of p is one of q's
    p_place = torch.tensor([len(x & PLACE_WORDS) for x in phrases])  # (P,) place words of each caption phrase
    q_place = torch.tensor([len(x & PLACE_WORDS) for x in targets])  # (Q,)
    # (P, Q): p names no place, or as many as q (with subset, p's place words are among q's: then they are q's)
    same_place = (p_place[:, None] == 0) | (p_place[:, None] == q_place[None, :])
    inside = (subset & same_place).float()  # (P, Q)
    by_image = _one_hot([j for j, image in enumerate(images) for _ in image], B)  # (Q, B)
    by_caption = _one_hot([n for n, c in enumerate(captions) for _ in c], N)  # (P, N)
    held = ((inside @ by_image) > 0).float()  # (P, B): the phrase lies inside one of image j's phrases
    needed = torch.tensor([len(c) for c in captions], dtype=torch.float32)  # (N,)
    return ((by_caption.T @ held) == needed[:, None]) & (needed[:, None] > 0)  # (N, B)


def _incidence(phrases: list[frozenset[str]], column: dict[str, int]) -> torch.Tensor:
    """(len(phrases), V) float32 0/1: which of the words in ``column`` each phrase holds (others are left out)."""
    out = torch.zeros(len(phrases), len(column))
    cells = [(i, column[w]) for i, p in enumerate(phrases) for w in p if w in column]
    if cells:
        rows, cols = zip(*cells)
        out[list(rows), list(cols)] = 1
    return out


def _one_hot(index: list[int], n: int) -> torch.Tensor:
    """(len(index), n) float32: row i is one at column index[i]."""
    return torch.nn.functional.one_hot(torch.tensor(index, dtype=torch.long), n).float()


def true_pairs(captions: list[list[frozenset[str]]], images: list[list[frozenset[str]]]) -> torch.Tensor:
    """(B, B) bool: [i, j] when caption i is true of image j, i ≠ j (the diagonal is each pair's own positive)."""
    return true_of(captions, images).fill_diagonal_(False)


def caption_features(captions: list[str]) -> Counter:
    """Bag of an image's captions: each lower-case word, and each pair of words inside one object phrase
    ("green|circle", "circle|right"), so images whose objects carry the same attributes come nearer than images
    that merely use the same words."""
    bag = Counter(w.lower() for c in captions for w in caption_words(c))
    for c in captions:
        for phrase in phrase_words(c):
            words = sorted(phrase)
            bag.update(f"{a}|{b}" for i, a in enumerate(words) for b in words[i + 1:])
    return bag


def caption_neighbours(captions: list[list[str]], k: int, chunk: int = 1024, progress=None) -> np.ndarray:
    """(N, k) int64: for each item the k other items whose captions are nearest in TF-IDF cosine over
    ``caption_features`` (idf = log(N / df)), nearest first. ``progress(n)`` is called per chunk."""
    N = len(captions)
    if not 0 < k < N:
        raise ValueError(f"need 0 < k < N neighbours, got k={k} for {N} items")
    bags = [caption_features(caps) for caps in captions]
    vocab: dict[str, int] = {}
    rows, cols, vals = [], [], []
    for n, bag in enumerate(bags):
        for w, c in bag.items():
            rows.append(n)
            cols.append(vocab.setdefault(w, len(vocab)))
            vals.append(float(c))
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    df = torch.bincount(cols_t, minlength=len(vocab)).double()  # (V,) items holding each word
    tfidf = torch.tensor(vals, dtype=torch.float64) * torch.log(N / df)[cols_t]
    norm = torch.zeros(N, dtype=torch.float64).index_add_(0, rows_t, tfidf ** 2).sqrt().clamp_min(1e-12)
    values = (tfidf / norm[rows_t]).float()  # (nnz,) of the unit rows
    X = torch.sparse_coo_tensor(torch.stack([rows_t, cols_t]), values, (N, len(vocab)), check_invariants=False)
    if N * len(vocab) <= _DENSE_LIMIT:
        X = X.to_dense()  # (N, V): a small vocabulary (the shapes world's) is fastest as one BLAS product
    else:
        with warnings.catch_warnings():  # CSR is marked beta; it is the fast sparse @ dense on CPU (COO is not)
            warnings.simplefilter("ignore", UserWarning)
            X = X.coalesce().to_sparse_csr()  # (N, V)
    out = np.empty((N, k), dtype=np.int64)
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        dense = torch.zeros(stop - start, len(vocab))  # (c, V)
        sub = (rows_t >= start) & (rows_t < stop)
        dense.index_put_((rows_t[sub] - start, cols_t[sub]), values[sub], accumulate=True)
        sims = (X @ dense.T).T  # (c, N) cosine of the chunk's items against all
        sims[torch.arange(stop - start), torch.arange(start, stop)] = -float("inf")  # not its own neighbour
        out[start:stop] = sims.topk(k, dim=1).indices.numpy()
        if progress is not None:
            progress(stop - start)
    return out


def superset_neighbours(captions: list[list[str]], k: int, progress=None) -> np.ndarray:
    """(N, k) int64: for each item up to k other items that its fullest caption (most object phrases) is true of
    (``caption_true_of`` against all their captions' phrases): by text rules they hold its objects and more, the
    images a whole caption must rank below its own. Rows with fewer are padded with the item itself, which
    ``grouped_order`` passes over. ``progress(n)`` is called per item."""
    N = len(captions)
    phrases = [[phrase_words(c) for c in caps] for caps in captions]
    owned = [(i, q) for i, caps in enumerate(phrases) for q in {q for c in caps for q in c}]  # each image phrase
    owner = np.array([i for i, _ in owned], dtype=np.int64)  # (phrases,) the image each phrase is of
    rows: dict[str, list[int]] = {}  # word -> the image phrases holding it, ascending (an inverted index)
    for row, (_, q) in enumerate(owned):
        for w in q:
            rows.setdefault(w, []).append(row)
    postings = {w: np.array(r, dtype=np.int64) for w, r in rows.items()}
    cache: dict[frozenset[str], np.ndarray] = {}  # caption phrase -> ascending items with a phrase holding it

    def items_holding(p: frozenset[str]) -> np.ndarray:
        if p not in cache:
            lists = sorted((postings.get(w, owner[:0]) for w in p), key=len)
            held = lists[0] if lists else np.arange(len(owned))
            for other in lists[1:]:
                held = np.intersect1d(held, other, assume_unique=True)
            if p & PLACE_WORDS:  # the same place, not a narrower one (``_inside``)
                held = held[[_inside(p, owned[row][1]) for row in held]]
            cache[p] = np.unique(owner[held])
        return cache[p]

    out = np.tile(np.arange(N, dtype=np.int64)[:, None], (1, k))  # (N, k)
    for i, caps in enumerate(phrases):
        whole = max(caps, key=len, default=[])
        if whole:
            found = items_holding(whole[0])
            for p in whole[1:]:
                found = np.intersect1d(found, items_holding(p), assume_unique=True)
            found = found[found != i][:k]
            out[i, :len(found)] = found
        if progress is not None:
            progress(1)
    return out


def grouped_order(perm: np.ndarray, neighbours: np.ndarray, group: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of the same items made of consecutive groups of ``group``: each anchor (taken in ``perm``'s
    order, if not yet placed) with its nearest not-yet-placed listed neighbours. Groups left short (every listed
    neighbour already placed) are pooled in order and cut into mixed groups; the full groups are shuffled
    (``rng``) and the one short remainder, if any, comes last — batches of a multiple of ``group`` items hold
    whole groups."""
    N = len(perm)
    placed = np.zeros(N, dtype=bool)
    full, loose = [], []
    for a in perm:
        if placed[a]:
            continue
        members = [int(a)]
        placed[a] = True
        for b in neighbours[a]:
            if len(members) == group:
                break
            if not placed[b]:
                members.append(int(b))
                placed[b] = True
        (full if len(members) == group else loose).append(members)
    loose_items = [i for g in loose for i in g]
    full += [loose_items[k:k + group] for k in range(0, len(loose_items) - group + 1, group)]
    tail = loose_items[len(loose_items) // group * group:]
    order = [full[i] for i in rng.permutation(len(full))] + [tail]
    return np.fromiter((i for g in order for i in g), dtype=np.int64, count=N)  # (N,)


def dataset_neighbours(dataset, k: int, progress: bool = True, by: str = "tfidf") -> np.ndarray:
    """``caption_neighbours`` (``by`` "tfidf") or ``superset_neighbours`` ("superset") of a map-style dataset's
    images (``dataset.captions(i)`` when it has one, which skips the pixels; else ``dataset[i][1]``), with
    progress bars."""
    if by not in ("tfidf", "superset"):
        raise ValueError(f"caption groups by {by!r}: use tfidf or superset")
    from tqdm.auto import tqdm

    read = getattr(dataset, "captions", None) or (lambda i: dataset[i][1])
    captions = [read(i) for i in tqdm(range(len(dataset)), desc="caption groups: read captions", unit="img",
                                     disable=not progress)]
    with tqdm(total=len(captions), desc=f"caption groups: {by} neighbours", unit="img", disable=not progress) as bar:
        if by == "superset":
            return superset_neighbours(captions, k, progress=bar.update)
        return caption_neighbours(captions, k, progress=bar.update)
