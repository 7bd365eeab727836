"""Backbone factories: a `transformers` text encoder and a `timm` ViT, built from a ModelConfig.

Named backbones load from the local Hugging Face / timm cache only when asked for pretrained
weights; a missing download ends in one message naming what to fetch and where it goes.

Weights files are never unpickled blindly: each library reads ``*.safetensors`` first and falls back
to ``torch.load(weights_only=True)`` for ``.bin`` / ``.pth`` (transformers 5 ``modeling_utils.load_state_dict``,
timm ``_helpers._torch_load``, open_clip ``factory.load_state_dict``). A pickle that names code is refused,
and the refusal ends in one ValueError saying how to convert the file (``UnsafeWeightsError``).
"""

from __future__ import annotations

import pickle

import torch
from torch import nn

from mmgeo.models import bert_packed
from mmgeo.models.hub import missing_download, refused_pickle, unsafe_weights

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def word_level_tokenizer(vocab: list[str]):
    """A `transformers` fast tokenizer over a fixed word list: lower-cases, splits on whitespace and
    punctuation, wraps each caption as ``[CLS] ... [SEP]``; unknown words map to ``[UNK]``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS) + [w for w in vocab if w not in SPECIAL_TOKENS]
    ids = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def build_text_tower(cfg) -> tuple[nn.Module, object, int]:
    """-> (encoder, tokenizer, hidden size). The encoder maps (input_ids, attention_mask) to token states.

    A named backbone's weights (``text_pretrained``) come through ``AutoModel.from_pretrained``: transformers 5
    takes ``model.safetensors`` when present, else ``pytorch_model.bin`` with ``torch.load(weights_only=True)``
    (its defaults; a refused pickle raises UnsafeWeightsError). Remote code is never trusted."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer, BertConfig

    if cfg.text_backbone == "scratch":
        if not cfg.text_vocab:
            raise ValueError("a scratch text backbone needs `text_vocab` (the word list of the captions)")
        tokenizer = word_level_tokenizer(cfg.text_vocab)
        bert = BertConfig(vocab_size=len(tokenizer), hidden_size=cfg.text_hidden,
                          num_hidden_layers=cfg.text_layers, num_attention_heads=cfg.text_heads,
                          intermediate_size=4 * cfg.text_hidden, max_position_embeddings=cfg.max_text_len,
                          hidden_dropout_prob=cfg.text_dropout, attention_probs_dropout_prob=cfg.text_dropout,
                          pad_token_id=tokenizer.pad_token_id)
        encoder = AutoModel.from_config(bert, add_pooling_layer=False)
        return encoder, tokenizer, cfg.text_hidden
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.text_backbone, trust_remote_code=False)
        if cfg.text_pretrained:
            encoder = AutoModel.from_pretrained(cfg.text_backbone, add_pooling_layer=False, trust_remote_code=False)
        else:
            encoder = AutoModel.from_config(AutoConfig.from_pretrained(cfg.text_backbone, trust_remote_code=False),
                                            add_pooling_layer=False)
    except (OSError, pickle.UnpicklingError) as err:
        reason = refused_pickle(err)
        if reason:
            raise unsafe_weights("text backbone", cfg.text_backbone, reason) from err
        raise missing_download("text backbone", cfg.text_backbone, err) from err
    return encoder, tokenizer, encoder.config.hidden_size


def build_image_tower(cfg) -> nn.Module:
    """A timm ViT returning token features, classifier head removed; or, for ``image_backbone:
    "openclip:ARCH[/TAG]"``, an open_clip ViT (weights of TAG when ``image_pretrained``).

    timm's weights (``image_pretrained``; a Hub name, ``hf-hub:`` or ``local-dir:``) load through timm's
    ``load_pretrained``: ``.safetensors`` first, else ``torch.load(weights_only=True)`` (timm ``_torch_load``,
    no unsafe fallback); ``.npz`` with ``allow_pickle=False``. A refused pickle raises UnsafeWeightsError."""
    import timm

    if cfg.image_backbone.startswith("openclip:"):
        from mmgeo.models.openclip_adapter import OpenClipVisionTower

        return OpenClipVisionTower(cfg.image_backbone, cfg.image_pretrained, cfg.image_size)

    kwargs = {"img_size": cfg.image_size, "patch_size": cfg.patch_size, "num_classes": 0}
    for key, value in (("embed_dim", cfg.image_embed_dim), ("depth", cfg.image_depth), ("num_heads", cfg.image_heads)):
        if value:
            kwargs[key] = value
    kwargs.update(cfg.image_backbone_args)
    try:
        vit = timm.create_model(cfg.image_backbone, pretrained=cfg.image_pretrained, **kwargs)
    except (OSError, RuntimeError, pickle.UnpicklingError) as err:
        reason = refused_pickle(err)
        if reason:
            raise unsafe_weights("image backbone", cfg.image_backbone, reason) from err
        if not cfg.image_pretrained:
            raise
        repo = cfg.image_backbone if "/" in cfg.image_backbone else f"timm/{cfg.image_backbone}"  # timm's Hub home
        raise missing_download("image backbone weights for", repo, err) from err
    if not hasattr(vit, "patch_embed") or not hasattr(vit, "num_prefix_tokens"):
        raise ValueError(f"image backbone {cfg.image_backbone!r} is not a timm ViT (no patch_embed)")
    if not cfg.image_pretrained and getattr(vit, "pos_embed", None) is not None:
        _init_sincos_pos_embed(vit)
    if cfg.image_conv_stem:
        from mmgeo.layers.conv_stem import ConvStem

        proj = vit.patch_embed.proj  # the patchify conv: same grid, same width
        vit.patch_embed.proj = ConvStem(proj.in_channels, proj.out_channels, proj.stride[0], cfg.image_stem_full_res)
    return vit


@torch.no_grad()
def _init_sincos_pos_embed(vit: nn.Module) -> None:
    """Start a from-scratch ViT's patch position embeddings at 2-D sin-cos (MAE, He et al. 2022):
    "where" is known from step 0 instead of learned from noise; they stay trainable."""
    from timm.layers import build_sincos2d_pos_embed

    grid, dim = list(vit.patch_embed.grid_size), vit.pos_embed.shape[-1]
    if dim % 4:
        return  # sin-cos 2-D needs dim divisible by 4; keep timm's init
    table = build_sincos2d_pos_embed(grid, dim).to(vit.pos_embed.dtype)  # (h*w, C)
    vit.pos_embed[0, vit.pos_embed.shape[1] - table.shape[0]:] = table


def resolve_preprocessing(cfg, vit: nn.Module) -> None:
    """Fill the config's normalisation and interpolation from the backbone's own data config when not set."""
    import timm.data

    data_cfg = getattr(vit, "preprocess_cfg", None) or timm.data.resolve_data_config({}, model=vit)
    if cfg.image_mean is None:
        cfg.image_mean = tuple(float(x) for x in data_cfg["mean"])
    if cfg.image_std is None:
        cfg.image_std = tuple(float(x) for x in data_cfg["std"])
    if cfg.image_interpolation is None:
        cfg.image_interpolation = str(data_cfg.get("interpolation") or "bicubic")


def _to_rgb(image):
    return image.convert("RGB")


def image_transform(cfg):
    """PIL image -> normalised (3, image_size, image_size) tensor, from the model config alone.

    No flips or crops that move content: captions name positions, so geometry must be preserved.
    """
    from torchvision import transforms as T

    interp = T.InterpolationMode(cfg.image_interpolation)
    return T.Compose([
        T.Lambda(_to_rgb),
        T.Resize((cfg.image_size, cfg.image_size), interpolation=interp, antialias=True),
        T.ToTensor(),
        T.Normalize(cfg.image_mean, cfg.image_std),
    ])


def patch_tokens(vit: nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (patch tokens (B, S, C), pooled (B, C)) from a timm ViT (or a tower with its own ``patch_tokens``)."""
    if hasattr(vit, "patch_tokens"):
        return vit.patch_tokens(pixels)
    feats = vit.forward_features(pixels)  # (B, prefix + S, C)
    pooled = vit.forward_head(feats, pre_logits=True)  # (B, C)
    return feats[:, vit.num_prefix_tokens:], pooled


LENGTH_GROUP = 48  # captions per length group of ``token_states`` (a training batch of 192 runs in four groups)
MAX_LENGTH_GROUPS = 4


def token_states(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Text encoder states (B, T, C) of captions padded to T. A batch of at least 2 · ``LENGTH_GROUP`` captions is
    run in up to ``MAX_LENGTH_GROUPS`` groups of similar length (sorted by real tokens, stable), each cut to its
    own last real column, so the encoder does not compute (and backpropagate through) the padding of the longest
    caption for all of them; columns a group did not run are 0. Without gradients, a BERT encoder in eval mode
    runs over the real tokens alone (``bert_packed``). Real tokens' states are the one-group ones up to float
    rounding; padding positions are not: read them only through the mask, as everything here does."""
    if not torch.is_grad_enabled() and bert_packed.supports(encoder):
        return bert_packed.packed_bert_states(encoder, input_ids, attention_mask)  # (B, T, C)
    B, T = input_ids.shape
    groups = min(MAX_LENGTH_GROUPS, B // LENGTH_GROUP)
    if groups < 2:
        return encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, C)
    order = torch.argsort(attention_mask.sum(1), stable=True)  # (B,) shortest first
    parts = []
    for rows in torch.chunk(order, groups):
        mask = attention_mask[rows]  # (b, T)
        L = int(mask.any(0).nonzero().max()) + 1 if bool(mask.any()) else 1  # last column with a real token
        h = encoder(input_ids=input_ids[rows, :L], attention_mask=mask[:, :L]).last_hidden_state  # (b, L, C)
        parts.append(nn.functional.pad(h, (0, 0, 0, T - L)))  # (b, T, C)
    return torch.cat(parts)[torch.argsort(order)]  # (B, T, C) back in the batch's order
