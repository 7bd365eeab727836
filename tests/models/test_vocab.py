"""Words a model cannot read: found with their place in the text, each suggested its closest known word."""

from mmgeo.models.towers import word_level_tokenizer
from mmgeo.models.vocab import closest_known, unknown_spans, vocabulary_hint

TOK = word_level_tokenizer(["a", "two", "red", "blue", "circle", "square", "left", "of"])


def test_unknown_words_are_found_where_they_stand_and_punctuation_is_not_a_word():
    text = "Two RED Circles, left of squares!"
    assert [text[a:b] for a, b in unknown_spans(TOK, text)] == ["Circles", "squares"]
    assert unknown_spans(TOK, "a red circle") == []


def test_the_closest_known_word_is_suggested_only_when_close():
    assert closest_known(TOK, "Circles") == "circle" and closest_known(TOK, "blu") == "blue"
    assert closest_known(TOK, "zebra") is None


def test_the_hint_rewrites_every_unknown_word_or_none():
    assert vocabulary_hint(TOK, "two blu circles, circles") == {
        "unknown_words": ["blu", "circles"], "did_you_mean": "two blue circle, circle"}
    assert vocabulary_hint(TOK, "a red zebra circles") == {"unknown_words": ["zebra", "circles"],
                                                            "did_you_mean": None}
    assert vocabulary_hint(TOK, "a red circle") == {"unknown_words": [], "did_you_mean": None}


def test_a_tokenizer_without_an_unknown_token_reports_nothing():
    class Bpe:  # open_clip's tokenizer: a callable with no unk_token_id
        def __call__(self, texts):
            raise AssertionError("not called")

    assert vocabulary_hint(Bpe(), "anything at all") == {"unknown_words": [], "did_you_mean": None}
    assert vocabulary_hint(None, "anything") == {"unknown_words": [], "did_you_mean": None}

