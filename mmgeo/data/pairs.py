"""Training pairs: one (image, caption, caption negatives) per item, batched for a contrastive step.

``open_split`` opens a split as the training data config describes it; ``CaptionPairs`` draws, per item and
epoch, the caption (and its rule-based negatives) reproducibly; ``Collate`` tokenises a batch of them.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from mmgeo.data import build_dataset
from mmgeo.data.caption_edits import EDIT_KINDS, caption_negatives
from mmgeo.data.caption_groups import phrase_words, true_of, true_pairs
from mmgeo.data.caption_parts import fewer_phrases, partial_caption, stated_count, typed_caption, without_colors


class CaptionTruth(NamedTuple):
    """What the text rules read of one pair, for ``Collate`` (``CaptionPairs(caption_truth=True)``)."""

    caption: list[frozenset[str]]  # its caption's object phrases (caption_groups.phrase_words)
    image: list[frozenset[str]]  # the object phrases of all its image's captions
    negatives: list[list[frozenset[str]]]  # each negative's object phrases
    objects: int  # how many objects its image's fullest caption names
    negative_counts: list[int | None]  # the count each negative states ("two shapes : ..."), else None


def open_split(data, split: str, size: int | None, image_size: int):
    """The dataset of ``split`` described by the data config ``data`` (``name``, ``seed``, ``root``, ``format``,
    ``max_pixels``); synthetic images are drawn ``image_size`` px wide (the model's input size). For
    ``webdataset`` the train split is a ShardSource (streamed by ``mmgeo.data.shard_stream``), val the first
    ``size`` samples of ``data.val_shards`` in order."""
    if data.name == "webdataset":
        from mmgeo.data.shard_stream import ShardSource

        if split == "train":
            return ShardSource(data.shards, data.samples_per_epoch, data.shuffle_buffer, data.max_pixels)
        if not data.val_shards:
            raise ValueError("data.name: webdataset validates on data.val_shards (a shard pattern, read in order); "
                             "set it, or data.val_size: 0 and aids.diagnostics_every_n_steps: 0 for no validation")
        return build_dataset("webdataset", split, size=size, shards=data.val_shards, max_pixels=data.max_pixels)
    return build_dataset(data.name, split, seed=data.seed, image_size=image_size, size=size, root=data.root,
                         data_format=data.format, max_pixels=data.max_pixels)


class CaptionPairs(Dataset):
    """(pixels, caption, negatives) of one image, keyed by ``(i, epoch, step)`` from ResumableBatchSampler; the
    caption is one of the image's five, drawn from (seed, epoch, i): a fresh but reproducible choice each
    epoch. ``negatives``: up to ``caption_negatives`` rule-based edits of that caption (NegCLIP-style,
    ``mmgeo.data.caption_edits``; ``vocabulary`` keeps a word-level tokenizer's words; ``negative_weights``
    makes some edit kinds likelier). With
    ``hard_negatives`` the image's one-change variant (``dataset.variant(i)``) comes along, so the two
    sit in the same batch as each other's hardest negative. ``partial_captions``: the share of items whose
    caption is cut to one or two of its object phrases (``mmgeo.data.caption_parts``) before its negatives
    are made, so a partial description is a positive and its edits the negatives; ``colorless_sub_captions``: the
    share of those sub-captions whose colour words are then left out (``caption_parts.without_colors``);
    ``typed_captions``: the share of the other items whose caption is written the way people type
    (``caption_parts.typed_caption``: "B below A", or the objects without their places), ``typed_relations`` of
    them a relation taken from whichever of the image's captions places one, ``typed_plurals`` of those whose
    caption names two or more objects of one kind how many ("two yellow circles", ``caption_parts.plural_count``).
    ``caption_truth``: each pair carries the phrases of its caption, of its negatives and of all its image's
    captions, so ``Collate`` can tell which captions and edits are true of which images of the batch
    (``mmgeo.data.caption_groups``).
    ``fewer_phrase_negatives``: up to this many copies of the caption with one object phrase left out
    (``caption_parts.fewer_phrases``) join its negatives after the edits, flagged so that they stay image->text
    negatives only: true of the image, they ask it to prefer the caption that names more of it."""

    def __init__(self, dataset, transform, seed: int, hard_negatives: bool = False, caption_negatives: int = 0,
                 negative_kinds=EDIT_KINDS, vocabulary=None, partial_captions: float = 0.0,
                 negative_weights: dict[str, float] | None = None, caption_truth: bool = False,
                 fewer_phrase_negatives: int = 0, colorless_sub_captions: float = 0.0, typed_captions: float = 0.0,
                 typed_relations: float = 0.0, typed_plurals: float = 0.0):
        for name, share in (("partial_captions", partial_captions), ("colorless_sub_captions", colorless_sub_captions),
                            ("typed_captions", typed_captions), ("typed_relations", typed_relations),
                            ("typed_plurals", typed_plurals)):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"data.{name}={share} must be a share between 0 and 1")
        if hard_negatives and not hasattr(dataset, "variant"):
            raise ValueError(f"{type(dataset).__name__} cannot make hard-negative variants (only the synthetic "
                             "shapes world can); set data.hard_negatives: false")
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self.hard_negatives, self.caption_negatives = hard_negatives, caption_negatives
        self.negative_kinds, self.vocabulary = tuple(negative_kinds), vocabulary
        self.negative_weights = dict(negative_weights or {})  # checked by caption_negatives (and the config)
        self.partial_captions, self.caption_truth = partial_captions, caption_truth
        self.fewer_phrase_negatives, self.colorless_sub_captions = fewer_phrase_negatives, colorless_sub_captions
        self.typed_captions, self.typed_relations = typed_captions, typed_relations
        self.typed_plurals = typed_plurals

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        i, epoch, step = key
        samples = [self.dataset[i]] + ([self.dataset.variant(i)] if self.hard_negatives else [])
        return self.item(samples, i, epoch, step)

    def item(self, samples: list, i: int, epoch: int, step: int) -> dict:
        """The item of ``samples`` ((image, captions), and its variant with hard negatives) of sample ``i``: the
        one path of map-style data and of shard streams (``mmgeo.data.shard_stream``)."""
        rng = np.random.default_rng([self.seed, epoch, i])
        pairs, truth, partial, fewer = [], [], [], []
        for image, captions in samples:
            caption = whole = captions[rng.integers(len(captions))]
            if self.partial_captions and rng.random() < self.partial_captions:  # no draw when off: runs replay
                caption = partial_caption(caption, rng) or caption
                if self.colorless_sub_captions and caption != whole and rng.random() < self.colorless_sub_captions:
                    caption = without_colors(caption) or caption
            elif self.typed_captions and rng.random() < self.typed_captions:  # no draw when off
                caption = typed_caption(caption, rng, captions, self.typed_relations, self.typed_plurals) or caption
            partial.append(caption != whole)
            negatives = caption_negatives(caption, rng, self.caption_negatives, self.negative_kinds,
                                          self.vocabulary, self.negative_weights) if self.caption_negatives else []
            drops = fewer_phrases(caption, rng, self.fewer_phrase_negatives) if self.fewer_phrase_negatives else []
            fewer.append([False] * len(negatives) + [True] * len(drops))
            negatives = negatives + drops
            pairs.append((self.transform(image), caption, negatives))
            if self.caption_truth:
                named = [phrase_words(c) for c in captions]
                truth.append(CaptionTruth(phrase_words(caption), [p for c in named for p in c],
                                          [phrase_words(n) for n in negatives], max(map(len, named)),
                                          [stated_count(n) for n in negatives]))
        item = {"pairs": pairs, "partial": partial, "fewer": fewer, "index": i, "epoch": epoch, "step": step}
        return {**item, "truth": truth} if self.caption_truth else item


class Collate:
    """Items -> one batch: pixels (B, 3, H, W), the B captions then every negative caption tokenised together
    (``input_ids`` / ``attention_mask`` (B + N_neg, T)); ``num_captions`` = B; ``partial`` (B,) whether each caption
    is a sub-caption, ``negative_source`` (N_neg,) the pair each negative was made from, ``negative_fewer`` (N_neg,)
    bool whether it is the caption with a phrase left out (an image->text negative only); with items that carry
    caption truth (``CaptionPairs(caption_truth=True)``), ``positives`` (B, B) bool: caption i true of image j, i ≠
    j, and ``negative_truth`` (N_neg, B) bool: negative n true of image j by the text rules, never of its own source
    (the edit was made to be false of it) and of none when the rule cannot see the edit (its object phrases are the
    caption's, e.g. a flipped relation to "it"); ``negative_whole`` (N_neg, B) bool: negative n names as many
    objects as image j's fullest caption does, so read as a whole description of j it leaves none of j's out;
    ``negative_counted`` (N_neg, B) bool: negative n states no count ("two shapes : ..."), or the number of objects
    image j's fullest caption names."""

    def __init__(self, tokenize):
        self.tokenize = tokenize

    def __call__(self, batch):
        pairs = [pair for item in batch for pair in item["pairs"]]
        pixels = torch.stack([p for p, _, _ in pairs])  # (B, 3, H, W)
        steps = {(item["epoch"], item["step"]) for item in batch}
        if len(steps) != 1:
            raise RuntimeError(f"one batch mixes (epoch, step) {sorted(steps)}: the batch sampler is broken")
        epoch, step = steps.pop()
        texts = [c for _, c, _ in pairs] + [n for _, _, negs in pairs for n in negs]
        source = [i for i, (_, _, negs) in enumerate(pairs) for _ in negs]  # the pair each negative edits
        partial = [p for item in batch for p in item["partial"]]
        fewer = [f for item in batch for flags in item["fewer"] for f in flags]
        extra = {"partial": torch.tensor(partial, dtype=torch.bool),  # (B,) whether each caption is a sub-caption
                 "negative_source": torch.tensor(source, dtype=torch.long),  # (N_neg,)
                 "negative_fewer": torch.tensor(fewer, dtype=torch.bool)}  # (N_neg,)
        if "truth" in batch[0]:
            truth = [t for item in batch for t in item["truth"]]
            images = [t.image for t in truth]
            extra["positives"] = true_pairs([t.caption for t in truth], images)  # (B, B)
            edits = [(t.caption, n) for t in truth for n in t.negatives]
            seen = true_of([n for _, n in edits], images)  # (N_neg, B)
            seen[torch.arange(len(edits)), extra["negative_source"]] = False  # each edit was made false of its source
            blind = torch.tensor([Counter(c) == Counter(n) for c, n in edits], dtype=torch.bool)  # (N_neg,)
            extra["negative_truth"] = seen & ~blind[:, None]  # an edit the rule cannot see is true of nothing
            objects = torch.tensor([t.objects for t in truth])  # (B,) objects each image's captions name
            named = torch.tensor([len(n) for _, n in edits], dtype=torch.long)  # (N_neg,) objects each edit names
            extra["negative_whole"] = named[:, None] == objects[None, :]  # (N_neg, B)
            stated = torch.tensor([-1 if c is None else c for t in truth for c in t.negative_counts],
                                  dtype=torch.long)  # (N_neg,) the count an edit states, -1 for none
            extra["negative_counted"] = (stated[:, None] < 0) | (stated[:, None] == objects[None, :])  # (N_neg, B)
        return {**self.tokenize(texts), **extra, "pixels": pixels, "num_captions": torch.tensor(len(pairs)),
                "index": torch.tensor([item["index"] for item in batch]),  # (B_items,) dataset indices
                "epoch": torch.tensor(epoch), "step": torch.tensor(step)}
