"""The words of a query that a model's tokenizer cannot represent, and the known word each most likely means.

A scratch model's word-level vocabulary holds only the words of its training captions (the embedded default's: 48,
no plurals), so a word outside it becomes the unknown token and the query silently loses it ("two yellow circles"
is searched as "two yellow [UNK]"). Search reports these words and a query of known words to try instead.
Limits: a tokenizer without an unknown token (open_clip's byte-level BPE) represents every word, so nothing is
reported; a word-piece vocabulary reports a word only when one of its pieces is missing.
"""
from __future__ import annotations

import difflib
import functools

MATCH_CUTOFF = 0.8  # difflib similarity a known word needs to be suggested ("circles" -> "circle": 0.92)


def unknown_spans(tokenizer, text: str, words_only: bool = True) -> list[tuple[int, int]]:
    """(start, end) in ``text`` of each word the tokenizer turns into its unknown token, in order (``words_only``:
    punctuation alone is not a word, a lost "!" changes nothing; False: every unknown token's span)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not getattr(tokenizer, "is_fast", False):  # offsets need a fast (Rust) tokenizer
        return []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(a, b) for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
            if token == unk and (not words_only or any(c.isalnum() for c in text[a:b]))]


@functools.lru_cache(maxsize=4)  # one per served model: a word-piece vocabulary has ~30,000 entries
def known_words(tokenizer) -> tuple[str, ...]:
    """The vocabulary's whole words: no word pieces ("##s"), no special tokens ("[CLS]")."""
    return tuple(w for w in tokenizer.get_vocab() if w.isalpha())


def closest_known(tokenizer, word: str) -> str | None:
    """The vocabulary's whole word most like ``word`` (similarity >= ``MATCH_CUTOFF``), or None."""
    match = difflib.get_close_matches(word.lower(), known_words(tokenizer), n=1, cutoff=MATCH_CUTOFF)
    return match[0] if match else None


def vocabulary_hint(tokenizer, text: str) -> dict:
    """{"unknown_words": the words of ``text`` the model cannot read (each once), "did_you_mean": ``text`` with each
    replaced by its closest known word — None when there is no unknown word or one has no close match}."""
    spans = unknown_spans(tokenizer, text)
    unknown = list(dict.fromkeys(text[a:b] for a, b in spans))
    known = {w: closest_known(tokenizer, w) for w in unknown}
    if not spans or None in known.values():
        return {"unknown_words": unknown, "did_you_mean": None}
    out = text
    for a, b in reversed(spans):
        out = out[:a] + known[text[a:b]] + out[b:]
    return {"unknown_words": unknown, "did_you_mean": out}
