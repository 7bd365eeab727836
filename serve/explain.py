"""Attention heatmaps: which patches each caption word looks at (docs/design.md §2,
a_tj = softmax_j <q_t, k_j>/sqrt(d_a)).

Drawn with matplotlib's object API (a ``Figure`` and its own Agg canvas per request), never pyplot: requests
render concurrently in worker threads, and pyplot's global figure state is not thread-safe.
"""

from __future__ import annotations

import io
import math

import numpy as np

from mmgeo.eval.viz import token_attention
from mmgeo.models.vocab import unknown_spans

MAX_PANELS = 24  # words drawn at most (a caption rarely has more)


def panel_titles(tokenizer, ids: list[int], text: str) -> list[str]:
    """A title per token of ``text`` (``ids``, one per attention row): the token, "[CLS] (overview)", or for the
    unknown token the word typed, "circles (unknown)" (the model read none of it)."""
    typed = iter([text[a:b] for a, b in unknown_spans(tokenizer, text, words_only=False)])
    return [f"{next(typed, w)} (unknown)" if w == tokenizer.unk_token else "[CLS] (overview)" if w == "[CLS]" else w
            for w in tokenizer.convert_ids_to_tokens(ids)]


def explain_png(model, gallery, image_id: int, text: str, image=None) -> bytes:
    """PNG: one panel per caption token, the image with that token's attention over the patch grid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tok = model.tokenize([text])
    emb = model.encode_text([text])
    q, q_mask = emb.attn[0].cpu(), emb.mask[0].cpu()  # (H, T, d_a), (T,)
    k, k_mask = gallery.image_keys(image_id), gallery.image_mask(image_id)  # (H, L, d_a), (L,): stored patches
    kept = token_attention(q, q_mask, k, k_mask)  # (T_real, L)
    attn = kept.new_zeros(kept.shape[0], gallery.model_record["num_patches"])  # (T_real, S): pruned patches get 0
    attn[:, gallery.image_patches(image_id)] = kept
    words = panel_titles(model.tokenizer, tok["input_ids"][0][tok["attention_mask"][0].bool()].tolist(), text)
    panels = [(w, a) for w, a in zip(words, attn) if w != "[SEP]"]
    panels = panels[:MAX_PANELS]
    rows_, cols_ = model.patch_grid  # S = rows_ · cols_ keys per image
    if rows_ * cols_ != attn.shape[1]:
        raise ValueError(f"gallery keys have {attn.shape[1]} patches per image but the model's patch grid is "
                         f"{rows_}x{cols_}; rebuild the gallery with this model (python -m serve build)")
    pic = np.asarray(image.convert("RGB")) if image is not None else np.full((rows_, cols_, 3), 128, np.uint8)
    cols = min(6, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(2.0 * cols, 2.2 * rows), dpi=80)
    FigureCanvasAgg(fig)  # this figure's own canvas: no global state shared with other requests
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (word, a) in zip(axes.flat, panels):
        ax.imshow(pic, extent=(0, 1, 0, 1))
        heat = a.reshape(rows_, cols_).numpy()
        ax.imshow(heat, cmap="jet", alpha=0.5, extent=(0, 1, 0, 1), interpolation="nearest")
        ax.set_title(word, fontsize=9)
    fig.suptitle(f"image {image_id}: where each word looks", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
