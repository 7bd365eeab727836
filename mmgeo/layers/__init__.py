"""Building blocks that models compose (timm's split between layers and models)."""

from mmgeo.layers.geo_attention_block import GeometricAttentionBlock, convert_attention
from mmgeo.layers.key_head import ConvChannelAttentionKeyHead
from mmgeo.layers.lowrank import LowRankMapping
from mmgeo.layers.phrase_window import PhraseWindow
from mmgeo.layers.salience import PatchSalience
from mmgeo.layers.text_mlp import PositionAwareTextMLP, relative_positions, sinusoidal_features
from mmgeo.layers.value_proj import ValueProjection

__all__ = [
    "ConvChannelAttentionKeyHead",
    "GeometricAttentionBlock",
    "LowRankMapping",
    "PatchSalience",
    "PhraseWindow",
    "PositionAwareTextMLP",
    "ValueProjection",
    "convert_attention",
    "relative_positions",
    "sinusoidal_features",
]
