import math

import pytest
import torch

from mmgeo.layers import (
    ConvChannelAttentionKeyHead,
    LowRankMapping,
    PositionAwareTextMLP,
    ValueProjection,
    relative_positions,
    sinusoidal_features,
)


def test_relative_positions():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    r = relative_positions(mask)
    torch.testing.assert_close(r, torch.tensor([[0, 0.5, 1, 0], [0, 1 / 3, 2 / 3, 1], [0, 0, 0, 0]]))


def test_sinusoidal_features():
    pe = sinusoidal_features(torch.tensor([0.0, 0.5]), 4)
    torch.testing.assert_close(pe[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(pe[1], torch.tensor([1.0, 0.0, math.cos(math.pi / 2), -1.0]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="even"):
        sinusoidal_features(torch.zeros(2), 3)


def test_text_mlp_shapes_and_position_awareness():
    torch.manual_seed(0)
    mlp = PositionAwareTextMLP(8, num_heads=2, d_a=4, hidden_dim=16, pos_dim=6)
    h = torch.randn(1, 5, 8).repeat(2, 1, 1)  # the same token states ...
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)  # ... in captions of other lengths
    q = mlp(h, mask)
    assert q.shape == (2, 2, 5, 4)
    torch.testing.assert_close(q[0, :, 0], q[1, :, 0])  # [CLS]: r = 0 in both
    assert not torch.allclose(q[0, :, 2], q[1, :, 2])  # token 2: r = 0.5 vs 1.0


@pytest.mark.parametrize("spatial", [False, True])
def test_key_head_shapes(spatial):
    head = ConvChannelAttentionKeyHead(12, (3, 4), num_heads=2, d_a=5, hidden_dim=8, spatial_gate=spatial)
    assert head(torch.randn(3, 12, 12)).shape == (3, 2, 12, 5)
    with pytest.raises(ValueError, match="3×4=12 patch tokens, got 10"):
        head(torch.randn(3, 10, 12))


def test_key_head_sees_neighbours():
    """The 3×3 conv mixes neighbouring patches: changing one patch changes its neighbours' keys."""
    torch.manual_seed(0)
    head = ConvChannelAttentionKeyHead(4, (4, 4), num_heads=1, d_a=3)
    x = torch.randn(1, 16, 4)
    y = x.clone()
    y[0, 5] += 1.0  # patch (1, 1)
    dk = (head(x) - head(y)).abs().sum(-1)[0, 0]  # (16,)
    assert dk[6] > 0 and dk[9] > 0  # (1, 2), (2, 1) are neighbours


@pytest.mark.parametrize("gated", [False, True])
def test_value_projection(gated):
    p = ValueProjection(6, num_heads=3, d_e=2, gated=gated)
    assert p(torch.randn(2, 5, 6)).shape == (2, 3, 5, 2)
    assert (p.gate is not None) == gated


def test_lowrank_mapping_starts_as_rank_r_projection():
    m = LowRankMapping(8, 3)
    x = torch.randn(10, 8)
    y = m(x)
    assert torch.linalg.matrix_rank(y) == 3
    torch.testing.assert_close(m(y), y, atol=1e-5, rtol=1e-5)  # idempotent: a projection
    with pytest.raises(ValueError, match="rank"):
        LowRankMapping(4, 5)


def test_phrase_window_concatenates_neighbours_in_order_with_zero_padding():
    from mmgeo.layers import PhraseWindow

    h = torch.arange(1, 7, dtype=torch.float32).view(1, 3, 2)  # tokens (1,2), (3,4), (5,6)
    mask = torch.tensor([[True, True, False]])  # the third token is padding
    out = PhraseWindow(1)(h, mask)  # (1, 3, 6): [h_{t-1}; h_t; h_{t+1}]
    assert out.shape == (1, 3, 6)
    assert out[0, 0].tolist() == [0, 0, 1, 2, 3, 4]  # nothing before the first token
    assert out[0, 1].tolist() == [1, 2, 3, 4, 0, 0]  # padding after the last real token reads as zeros
    assert PhraseWindow(0)(h, mask) is h and PhraseWindow(2).out_dim(8) == 40


def test_phrase_window_makes_a_tokens_value_depend_on_its_neighbours():
    """With w > 0 the value of "circle" changes when the colour before it changes; with w = 0 only through
    the encoder's own context."""
    import mmgeo

    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", phrase_window=2, text_layers=0).eval()
    emb = model.encode_text(["a red circle", "a blue circle"])
    circle = 3  # [CLS] a red circle
    assert not torch.allclose(emb.value[0, :, circle], emb.value[1, :, circle])
    plain = mmgeo.create_model("geo-tiny", phrase_window=0, text_layers=0).eval()
    emb = plain.encode_text(["a red circle", "a blue circle"])
    torch.testing.assert_close(emb.value[0, :, circle], emb.value[1, :, circle])  # no encoder layers: no context
