"""The typed training config: the schema of configs/*.yaml and of train.py's dotted overrides.

``load_train_config(path, overrides)`` reads it. ``model_args`` are ModelConfig fields, checked (name and type)
when the config is read; the model config is the one place for model settings, the input image size included
(synthetic images are drawn at the model's input size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar

from mmgeo.config import FieldsOf, load_config
from mmgeo.data import MAX_PIXELS
from mmgeo.data.caption_edits import EDIT_KINDS, check_kind_weights, check_kinds
from mmgeo.models.config import ModelConfig


@dataclass
class DataConfig:
    MOVED: ClassVar[dict[str, str]] = {  # removed keys -> where they live now
        "image_size": "model_args.image_size (synthetic images are drawn at the model's input size)"}

    name: str = "synthetic"  # dataset: "synthetic" = the embedded shapes world, "flickr30k" = Karpathy split at root,
    # "webdataset" = tar shards (data.shards; docs/training.md, "Training from WebDataset shards")
    root: str | None = None  # flickr30k: folder / file / HF dataset id (data/README.md); unused for synthetic
    format: str | None = None  # flickr30k layout: hf | karpathy | csv (None = detect from root)
    max_pixels: int = MAX_PIXELS  # flickr30k: images with more pixels are skipped (decompression-bomb guard)
    shards: str | None = None  # webdataset: train shard pattern, brace-expanded ("DIR/{00000..00123}.tar"; "a::b"
    # joins patterns; "pipe:CMD" reads CMD's stdout)
    val_shards: str | None = None  # webdataset: shard pattern of the val set (its first val_size samples, in order)
    samples_per_epoch: int | None = None  # webdataset: samples per epoch (required; steps per epoch = this // batch
    # size); keep it a few shards below the good samples the shards hold: each rank needs samples_per_epoch / world
    shuffle_buffer: int = 1000  # webdataset: samples each reader shuffles in (shard order is shuffled per epoch too)
    seed: int = 0  # dataset seed (scenes and captions)
    train_size: int | None = None  # images of the train split to use (None = all)
    val_size: int = 200  # val images scored for R@K during training (0 = no validation)
    num_workers: int = 1  # DataLoader worker processes
    hard_negatives: bool = False  # pair each image with a one-change variant in the batch (synthetic only: the
    # scene graph makes it, so no real dataset can give this signal; kept for comparison)
    caption_negatives: int = 0  # rule-based text hard negatives per caption (NegCLIP-style word swaps / replacements /
    # relation flips of the caption itself, mmgeo.data.caption_edits; any dataset), extra negatives of image->text
    negative_kinds: list[str] = field(default_factory=lambda: list(EDIT_KINDS))  # caption edit kinds to draw from
    # (add_axis too, for data whose one-axis relations mean the other axis is level: the shapes world)
    negative_weights: dict[str, float] = field(default_factory=dict)  # relative draw weight of edit kinds (1 for
    # a kind not named), e.g. {replace_noun: 3} for more noun-replacing negatives; empty = uniform
    partial_captions: float = 0.0  # share of items whose caption is cut to a sub-caption of 1-2 of its object
    # phrases (mmgeo.data.caption_parts: text rules, any dataset); its caption negatives edit the sub-caption
    colorless_sub_captions: float = 0.0  # share of sub-captions whose colour words are left out ("a small square on
    # the left": mmgeo.data.caption_parts.without_colors), so shape and place are asked for apart from colour; such a
    # sub-caption is true of other batch images, so pair it with mask_true_captions (docs/design.md §9)
    typed_captions: float = 0.0  # share of the items not cut to a sub-caption whose caption is written the way
    # people type (mmgeo.data.caption_parts.typed_caption): a relation as "B below A", else the objects without
    # their places ("two shapes : A and B"); flagged as sub-captions, since such a caption may be true of other images
    typed_relations: float = 0.0  # share of those typed captions written as a relation from whichever of the
    # image's captions places one object from another (the shapes world: one template in five), else 0 = a relation
    # only when the drawn caption places one
    typed_plurals: float = 0.0  # share of those typed captions whose caption names two or more objects of one kind
    # written as how many ("two yellow circles", caption_parts.plural_count); > 0 adds the plurals of a word-level
    # vocabulary's nouns to the model's (caption_parts.with_plurals)
    fewer_phrase_negatives: int = 0  # per caption naming ≥ 2 object phrases, up to this many copies with one
    # phrase left out (mmgeo.data.caption_parts.fewer_phrases) as image->text negatives only: true of the image, they
    # teach it to prefer the caption naming more of it; never text->image queries (the edit terms skip them)
    caption_groups: int = 0  # batches made of groups of this many images whose captions read alike (TF-IDF
    # neighbours, mmgeo.data.caption_groups; map-style data); 0 = random batches. Must divide the batch per device
    caption_groups_by: str = "tfidf"  # how groups are formed: tfidf (captions that read alike) | superset (images
    # an image's whole caption is true of by text rules: they hold its objects and more)
    mask_true_captions: bool = False  # a caption true of another image of its batch (by text rules,
    # mmgeo.data.caption_groups) is not that image's negative; sub-captions and caption groups make such pairs
    mask_true_of: str = "all"  # the captions mask_true_captions acts on: all | sub_captions (a whole caption keeps
    # every other image as a negative, even one holding its objects and more)

    def __post_init__(self):
        if self.caption_groups < 0 or self.caption_groups == 1:
            raise ValueError(f"data.caption_groups={self.caption_groups}: use 0 (random batches) or a group size ≥ 2")
        if self.fewer_phrase_negatives < 0:
            raise ValueError(f"data.fewer_phrase_negatives={self.fewer_phrase_negatives}: use 0 (off) or a count ≥ 1")
        if self.caption_groups_by not in ("tfidf", "superset"):
            raise ValueError(f"data.caption_groups_by={self.caption_groups_by!r}: use tfidf or superset")
        if self.mask_true_of not in ("all", "sub_captions"):
            raise ValueError(f"data.mask_true_of={self.mask_true_of!r}: use all or sub_captions")
        check_kinds(self.negative_kinds)
        if self.negative_weights:
            check_kind_weights(self.negative_weights, self.negative_kinds)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon: Muon for the weights of linear and convolution layers, AdamW for the rest
    # (mmgeo.training.muon; Muon's updates scaled to AdamW's RMS, so lr and weight_decay keep their meaning)
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.05  # decoupled weight decay (not on biases, norms, temperatures)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas (CLIP's)
    muon_momentum: float = 0.95  # Muon's (Nesterov) momentum; name: muon only
    warmup_steps: int = 50  # linear warm-up, then cosine decay to 0 at max_steps

    def __post_init__(self):
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"optim.name={self.name!r}: use adamw or muon")


@dataclass
class LossConfig:
    global_weight: float = 1.0  # λ: weight of the global InfoNCE next to the geometric one
    distill_weight: float = 0.0  # weight of the KL from the geometric score's in-batch softmax to the global one's
    # (teacher detached; mmgeo.training.losses.distillation): the first stage learns from the re-rank
    negative_query_weight: float = 0.0  # caption edits as queries: -log(1 - p) of the image each was made from among
    # the batch's images (text->image side; mmgeo.training.losses.negative_query)
    negative_query_rows: str = "all"  # the edits negative_query takes: all | sub_captions (edits of sub-captions) |
    # true_of_another (edits the text rules find true of another image of the batch)
    edit_query_weight: float = 0.0  # caption edits as queries of the batch images they are true of by text rules,
    # above the image each was made from (mmgeo.training.losses.edit_query; needs data.caption_negatives)
    edit_truth: str = "contains"  # when an edit is true of an image, for both edit terms: contains (each object it
    # names is one of the image's) | counts (so, and a count it states, "two shapes : ...", is the image's) | whole
    # (so, and an edit of a whole caption names all the image's objects: a whole caption leaves none out, so it is
    # not an image's that holds more; edits of sub-captions keep contains)
    local_loss: bool = False  # several ranks: score local captions/images against all (2·B·W·B pairs, not (W·B)²)

    def __post_init__(self):
        if self.negative_query_rows not in ("all", "sub_captions", "true_of_another"):
            raise ValueError(f"loss.negative_query_rows={self.negative_query_rows!r}: use all, sub_captions or "
                             "true_of_another")
        if self.edit_truth not in ("contains", "counts", "whole"):
            raise ValueError(f"loss.edit_truth={self.edit_truth!r}: use contains, counts or whole")


@dataclass
class CoverageConfig:
    """After training, fit the coverage salience with the model frozen (``mmgeo.training.fit_coverage``,
    docs/design.md §9) and write the model with it."""

    weight: float = 0.0  # β written into the model (its score becomes s + β·cov); 0 = no fit
    fit_weight: float = 0.05  # β_fit: the weight of cov in the fitting loss
    images: int = 2000  # the first N training images (and their captions) are the fit's queries and candidates
    candidates: int = 10  # per caption, its K best images by the geometric score s
    shortlist: int = 0  # > 0: s only over the N images the caption's global score ranks first (what search re-ranks;
    # a fit linear in images, not quadratic); 0 = over every image (docs/measurements/retrieval.md: 100 vs 0)
    steps: int = 300  # full-batch Adam steps (only the salience's 1 + H·d_a parameters learn)
    lr: float = 0.05  # Adam's learning rate

    def __post_init__(self):
        if self.weight < 0 or self.fit_weight <= 0 or min(self.images, self.candidates, self.steps) < 1 \
                or self.shortlist < 0:
            raise ValueError(f"coverage: weight >= 0, fit_weight > 0, images, candidates, steps >= 1 and "
                             f"shortlist >= 0; got {self}")


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimiser steps
    batch_size: int = 128  # image–caption pairs per step over ALL devices (each gets batch_size / world)
    accelerator: str = "auto"  # Lightning accelerator: cpu, gpu, auto
    devices: int = 1  # devices (processes) per node
    num_nodes: int = 1  # nodes (SLURM / torchrun); world size = devices × num_nodes
    strategy: str = "auto"  # Lightning strategy: auto, ddp, fsdp (loss gathered across ranks either way)
    precision: str = "32-true"  # Lightning precision, e.g. bf16-mixed on GPU
    val_every_n_steps: int = 250  # validation R@K interval (0 = only at the end)
    log_every_n_steps: int = 10  # metrics logging interval
    checkpoint_every_n_steps: int = 500  # step checkpoints (atomic) for --resume; 0 = only at the end
    max_nonfinite_steps: int = 5  # a non-finite loss/gradient skips its step; stop after this many in a row
    log_samples: bool = False  # append each step's item indices to samples.tsv (audits the data order)
    seed: int = 0  # seed of weights, caption choice, data order and per-step dropout
    threads: int = 0  # torch CPU threads (0 = torch's default)
    init_from: str = ""  # a model.pt whose weights start the run (fine-tuning; same model config; fresh optimiser
    # and schedule; ignored on --resume, whose checkpoint holds the weights); "" = the model's own initialisation


@dataclass
class AidsConfig:
    """Training aids from the paper (docs/design.md §3, §8); all off by default. The orthogonal Q/K init is a model
    setting: ``model_args.qk_init_gain``."""

    MOVED: ClassVar[dict[str, str]] = {  # removed keys -> where they live now
        "qk_init_gain": "model_args.qk_init_gain (the orthogonal Q/K init is a model setting)"}

    clip_qk: float | None = None  # layered clipping: max grad norm of the Q/K maps (paper 0.5); None = off
    clip_value: float = 1.0  # layered clipping: max grad norm of the value projections (paper 1.0)
    clip_rest: float = 1.0  # layered clipping: max grad norm of all other parameters together
    freeze_value_fraction: float = 0.0  # two-stage warm-up: value projections frozen this fraction of steps (paper 0.1)
    ortho_weight: float = 0.0  # orthogonality regulariser: loss += weight · Σ ||W Wᵀ − I||²_F over Q/K maps
    diagnostics_every_n_steps: int = 100  # log attention diagnostics on a fixed val batch (0 = off); training unchanged
    diagnostics_images: int = 16  # val images (with all their captions) in that batch

    def __post_init__(self):
        if not 0 <= self.freeze_value_fraction < 1:
            raise ValueError(f"aids.freeze_value_fraction must be in [0, 1), got {self.freeze_value_fraction}; "
                             "the paper freezes the value projections for 0.1 of the steps")
        limits = {"clip_qk": self.clip_qk, "clip_value": self.clip_value, "clip_rest": self.clip_rest}
        bad = {k: v for k, v in limits.items() if v is not None and v <= 0}
        if bad:
            raise ValueError(f"aids clipping limits must be positive max-norms, got {bad} (paper: 0.5 Q/K, 1.0 value)")


@dataclass
class TrainConfig:
    name: str = "synthetic"  # run name: outputs go to <out_dir>/<name>/
    out_dir: str = "runs"  # root of run folders
    model: str = "geo-tiny"  # registered model variant (mmgeo.list_models())
    model_args: Annotated[dict, FieldsOf(ModelConfig)] = field(default_factory=dict)  # ModelConfig fields to
    # override, e.g. {d_a: 64, image_size: 32}; names and types checked when the config is read
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    aids: AidsConfig = field(default_factory=AidsConfig)
    coverage: CoverageConfig = field(default_factory=CoverageConfig)


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from a YAML file plus dotted overrides (``["--trainer.max_steps", "300"]``)."""
    return load_config(TrainConfig, path, overrides)
