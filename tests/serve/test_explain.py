"""GET /explain's panels: a title per token, the word typed where the model read none of it."""

from mmgeo.models.towers import word_level_tokenizer
from serve.explain import panel_titles

TOK = word_level_tokenizer(["two", "red", "left", "of"])


def test_the_heatmap_titles_an_unknown_token_with_the_word_typed():
    text = "two red Circles ! left of squares"
    ids = TOK(text)["input_ids"]
    assert panel_titles(TOK, ids, text) == ["[CLS] (overview)", "two", "red", "Circles (unknown)", "! (unknown)",
                                            "left", "of", "squares (unknown)", "[SEP]"]
    assert panel_titles(TOK, TOK("two red")["input_ids"], "two red") == ["[CLS] (overview)", "two", "red", "[SEP]"]
