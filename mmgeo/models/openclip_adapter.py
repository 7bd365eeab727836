"""Any open_clip model behind eval.py's interface: zero-shot baselines under the same protocol (docs/design.md §6).

    model = load_openclip("openclip:ViT-B-32/laion2b_s34b_b79k")   # "openclip:ARCH" alone = random init
    model.encode_text(captions), model.encode_image(pil_images), model.score(t, i, mode="global")

Global score only (``geometric=False``, ``default_mode="global"``); preprocessing is open_clip's own
eval transform for the model. Pretrained weights come from the local cache only when offline; a
missing download ends in one MissingDownloadError naming the Hugging Face repo to fetch.

Weights (a TAG, a file path as TAG, or ``local-dir:``) load through open_clip's ``load_checkpoint``:
``.safetensors`` with safetensors, anything else with ``torch.load(weights_only=True)`` (we pass
``weights_only=True`` explicitly), ``.npz`` with numpy's default ``allow_pickle=False``. A pickle that
names code is refused with UnsafeWeightsError. ``open_clip.load_openai_model`` (TorchScript; its state-dict
fallback calls torch.load without passing weights_only) is never called, here or by open_clip's create_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmgeo.models.embedding import Embedding, check_texts
from mmgeo.models.hub import missing_download, refused_pickle, unsafe_weights

PREFIX = "openclip:"


@dataclass
class OpenClipInfo:
    name: str  # "openclip:ARCH[/TAG]"
    arch: str  # open_clip model name, e.g. ViT-B-32
    pretrained: str | None  # open_clip pretrained tag (None = random init)
    image_size: int  # input side of the vision tower


def parse_spec(spec: str) -> tuple[str, str | None]:
    """"openclip:ViT-B-32/laion2b_s34b_b79k" -> ("ViT-B-32", "laion2b_s34b_b79k"); no tag -> None."""
    if not spec.startswith(PREFIX):
        raise ValueError(f"open_clip model specs look like 'openclip:ARCH[/TAG]', got {spec!r}")
    body = spec[len(PREFIX):]
    if body.startswith(("hf-hub:", "local-dir:")):
        return body, None
    arch, _, tag = body.partition("/")
    return arch, tag or None


def create_openclip(arch: str, pretrained: str | None = None, **kwargs) -> tuple[nn.Module, object]:
    """open_clip.create_model_and_transforms (weights read with ``weights_only=True``), offline errors turned
    into MissingDownloadError, refused pickles into UnsafeWeightsError. -> (model, eval transform)."""
    import open_clip

    if arch not in open_clip.list_models() and not arch.startswith(("hf-hub:", "local-dir:")):
        raise ValueError(f"unknown open_clip architecture {arch!r}; see open_clip.list_models() "
                         "(e.g. ViT-B-32, ViT-B-16, RN50)")
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=pretrained, weights_only=True,
                                                                     **kwargs)
    except Exception as err:
        reason = refused_pickle(err)
        if reason:
            raise unsafe_weights("open_clip weights", pretrained or arch, reason) from err
        if not isinstance(err, RuntimeError):
            raise
        if pretrained and "download" in str(err).lower():
            cfg = open_clip.get_pretrained_cfg(arch, pretrained) or {}
            repo = (cfg.get("hf_hub") or f"{arch}/{pretrained}").rstrip("/")
            raise missing_download(f"open_clip weights {arch}/{pretrained} from", repo, err) from err
        if pretrained and pretrained not in open_clip.list_pretrained_tags_by_model(arch):
            tags = open_clip.list_pretrained_tags_by_model(arch)
            raise ValueError(f"open_clip has no pretrained tag {pretrained!r} for {arch}; known: {tags}") from err
        raise
    return model, preprocess


class OpenClipRetriever(nn.Module):
    """An open_clip model with mmgeo's retrieval interface (global score only)."""

    geometric = False
    default_mode = "global"

    def __init__(self, spec: str, device: str | torch.device = "cpu"):
        super().__init__()
        import open_clip

        arch, tag = parse_spec(spec)
        self.model, self.preprocess = create_openclip(arch, tag)
        self.tokenizer = open_clip.get_tokenizer(arch)
        size = self.model.visual.image_size
        self.cfg = OpenClipInfo(spec, arch, tag, int(size[0] if isinstance(size, (tuple, list)) else size))
        self.to(device).eval()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def encode_text(self, texts: list[str], batch_size: int = 256) -> Embedding:
        check_texts(texts)
        parts = [self.model.encode_text(self.tokenizer(list(texts[i:i + batch_size])).to(self.device))
                 for i in range(0, len(texts), batch_size)]
        return Embedding(F.normalize(torch.cat(parts).float(), dim=-1))  # (N, D)

    @torch.inference_mode()
    def encode_image(self, images, batch_size: int = 256) -> Embedding:
        """PIL images (open_clip's eval transform) or a preprocessed (N, 3, H, W) tensor."""
        if not isinstance(images, torch.Tensor):
            images = torch.stack([self.preprocess(im) for im in images])  # (N, 3, H, W)
        parts = [self.model.encode_image(images[i:i + batch_size].to(self.device))
                 for i in range(0, len(images), batch_size)]
        return Embedding(F.normalize(torch.cat(parts).float(), dim=-1))  # (N, D)

    def score(self, text: Embedding, image: Embedding, mode: str = "global") -> torch.Tensor:
        """Cosine similarities (N_text, N_image); open_clip models have the global score only."""
        if mode != "global":
            raise ValueError(f"open_clip models have the global score only; got mode={mode!r}")
        return text.pooled @ image.pooled.T


def load_openclip(spec: str, device: str | torch.device = "cpu") -> OpenClipRetriever:
    return OpenClipRetriever(spec, device)


class _Grid:
    """Stands in for timm's ``patch_embed`` where GeoRetriever reads the patch grid."""

    def __init__(self, grid_size: tuple[int, int]):
        self.grid_size = tuple(grid_size)


class OpenClipVisionTower(nn.Module):
    """An open_clip ViT (``model.visual``) as GeoRetriever's image tower: patch tokens + pooled [CLS] out.

    The CLIP projection is dropped (``proj=None``): tokens and pooled vector share the tower width and
    GeoRetriever's own heads map them. ``preprocess_cfg`` (mean / std / interpolation) is open_clip's own.
    """

    def __init__(self, spec: str, pretrained: bool, image_size: int):
        super().__init__()
        arch, tag = parse_spec(spec)
        if pretrained and not tag:
            raise ValueError(f"image_backbone {spec!r} names no open_clip weights; use 'openclip:ARCH/TAG' "
                             "(e.g. openclip:ViT-B-16/laion2b_s34b_b88k) or image_pretrained: false")
        model, _ = create_openclip(arch, tag if pretrained else None, force_image_size=image_size)
        visual = model.visual
        if not hasattr(visual, "transformer") or not hasattr(visual, "grid_size"):
            raise ValueError(f"open_clip {arch!r} has no ViT image tower (patch grid); pick a ViT-* architecture")
        visual.proj, visual.output_tokens = None, True
        self.visual = visual
        self.num_features = visual.transformer.width  # C
        self.patch_embed = _Grid(visual.grid_size)
        self.preprocess_cfg = dict(getattr(visual, "preprocess_cfg", {}))

    def patch_tokens(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (patch tokens (B, S, C), pooled (B, C))."""
        pooled, tokens = self.visual(pixels)
        return tokens, pooled
