"""ModelConfig: everything needed to rebuild a model, saved inside each checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

IMAGE_ARGS_OWNED = {  # timm.create_model arguments the fields set -> what to give instead
    "img_size": "image_size", "patch_size": "patch_size", "num_classes": "none (the tower has no classifier)",
    "embed_dim": "image_embed_dim", "depth": "image_depth", "num_heads": "image_heads",
    "pretrained": "image_pretrained"}


@dataclass
class ModelConfig:
    # --- text tower (M_Q's backbone) ---
    text_backbone: str = "scratch"  # transformers model id or local path; "scratch" = tiny BERT from the fields below
    text_pretrained: bool = True  # for a named backbone: load its weights (from the local cache) or random-init
    text_vocab: list[str] | None = None  # word-level vocabulary of a scratch backbone (specials are added)
    text_hidden: int = 128  # scratch BERT: hidden size
    text_layers: int = 2  # scratch BERT: transformer layers
    text_heads: int = 4  # scratch BERT: attention heads
    text_dropout: float = 0.1  # scratch BERT: hidden and attention-probability dropout (BERT's 0.1)
    max_text_len: int = 64  # tokens per caption incl. [CLS]/[SEP]; longer captions are truncated with a warning
    # --- image tower (M_K's backbone) ---
    image_backbone: str = "vit_tiny_patch16_224"  # timm ViT name
    image_pretrained: bool = False  # load timm's pretrained weights (must be in the local cache)
    image_size: int = 64  # input side in pixels
    patch_size: int = 8  # ViT patch side; the key grid is (image_size / patch_size)²
    image_embed_dim: int = 128  # ViT width (0 = the backbone's own)
    image_depth: int = 4  # ViT blocks (0 = the backbone's own)
    image_heads: int = 4  # ViT attention heads (0 = the backbone's own)
    image_conv_stem: bool = False  # replace the patchify conv by a conv stem (Xiao et al. 2021); scratch ViTs
    image_stem_full_res: bool = False  # conv stem: one stride-1 3×3 conv at the input resolution first
    image_mean: tuple[float, float, float] | None = None  # normalisation mean; None = the backbone's data config
    image_std: tuple[float, float, float] | None = None  # normalisation std; None = the backbone's data config
    image_interpolation: str | None = None  # resize interpolation; None = the backbone's data config
    image_backbone_args: dict = field(default_factory=dict)  # more keyword arguments of timm.create_model for the
    # backbone, e.g. {"init_values": 1.0} to start a RoPE ViT's layer scale at 1 (timm drops None values); not those
    # the fields above set
    # --- attention space and scores ---
    score: str = "geometric"  # "geometric" (geometric + global scores) or "global" (CLIP baseline)
    num_heads: int = 2  # H: heads of the attention space
    d_a: int = 32  # attention-space dimension per head (queries and keys)
    d_e: int = 32  # value dimension per head (û, v̂)
    query_hidden: int = 256  # hidden width of the position-aware text MLP
    phrase_window: int = 0  # ±w neighbouring token states next to each token's own, for its query and value
    # (mmgeo.layers.PhraseWindow: the words of its phrase, so attributes bind to their object); 0 = own state only
    pos_dim: int = 16  # sinusoidal features of the relative token position
    key_hidden: int = 128  # channels of the conv / channel-attention key head
    spatial_gate: bool = False  # add a spatial gate after the channel gate in the key head
    gated_value: bool = False  # P_V gated (σ(W_g p) ⊙ W_v p) instead of linear
    lowrank_rank: int = 0  # rank r of the optional low-rank mapping of q and k (0 = off)
    qk_init_gain: float | None = None  # orthogonal init of the Q/K maps' final layers with this gain (paper: 0.1,
    # docs/design.md §8); None = PyTorch's default init
    coverage_weight: float = 0.0  # β: the score is s + β·cov, cov the share of the image's salient patches the
    # caption explains (mmgeo.kernels.coverage; breaks ties toward the image with nothing unnamed, docs/design.md §9);
    # 0 = off (geometric models only)
    d_global: int = 128  # dimension of the pooled global vectors (what FAISS indexes)
    global_pool: str = "cls"  # what the global vectors pool: "cls" ([CLS] token / the ViT's own pooling), "mean"
    # (mean over real tokens and over patches) or "values" (geometric models: the mean text value û and the mean
    # patch value v̂ through one shared-init linear map, so the global score starts as the geometric score with
    # uniform attention and learns with the values; docs/design.md §2)
    init_temperature_geo: float = 0.03  # initial temperature of the geometric InfoNCE (learnable); the score is a
    # mean of cosines, so its spread is narrow and needs a sharper softmax than CLIP's 0.07
    init_temperature_global: float = 0.07  # initial temperature of the global InfoNCE (learnable)
    extra: dict = field(default_factory=dict)  # free-form notes saved with the model (e.g. dataset name)

    def __post_init__(self):
        if self.score not in ("geometric", "global"):
            raise ValueError(f"score must be 'geometric' or 'global', got {self.score!r}")
        if self.global_pool not in ("cls", "mean", "values"):
            raise ValueError(f"global_pool must be 'cls', 'mean' or 'values', got {self.global_pool!r}")
        if self.global_pool == "values" and self.score != "geometric":
            raise ValueError("global_pool='values' pools the geometric values; a global-only model has none: "
                             "use 'cls' or 'mean'")
        if self.coverage_weight and self.score != "geometric":
            raise ValueError("coverage_weight needs the geometric score's attention; a global-only model has none: "
                             "set it to 0")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")
        owned = sorted(set(self.image_backbone_args) & set(IMAGE_ARGS_OWNED))
        if owned:
            raise ValueError(f"image_backbone_args sets {', '.join(owned)}: give "
                             f"{', '.join(IMAGE_ARGS_OWNED[k] for k in owned)} instead")
        if self.image_stem_full_res and not self.image_conv_stem:
            raise ValueError("image_stem_full_res adds a layer to the conv stem: set image_conv_stem true as well")
        if self.image_mean is not None:
            self.image_mean = tuple(self.image_mean)
        if self.image_std is not None:
            self.image_std = tuple(self.image_std)
