"""mmgeo.layers.conv_stem: the patchify convolution's grid and width through stride-2 convolutions (Xiao et al.
2021), with an optional stride-1 convolution at the input resolution first."""

import pytest
import torch

from mmgeo.layers.conv_stem import ConvStem


@pytest.mark.parametrize("patch_size", [2, 4, 8])
@pytest.mark.parametrize("full_res", [False, True])
def test_conv_stem_gives_the_patchify_grid_and_width(patch_size, full_res):
    stem = ConvStem(3, 32, patch_size, full_res)
    out = stem(torch.randn(2, 3, 48, 48))  # (B, C, H/p, W/p)
    assert out.shape == (2, 32, 48 // patch_size, 48 // patch_size)
    strides = [m.stride[0] for m in stem if isinstance(m, torch.nn.Conv2d)]
    assert strides == [1] * full_res + [2] * (patch_size.bit_length() - 1) + [1]  # the last: the 1×1 projection


def test_full_res_stem_sees_a_pixel_before_any_downsampling():
    """A one-pixel change moves the full-resolution layer's output at that pixel: nothing was averaged away."""
    first = ConvStem(3, 32, 8, full_res=True)[0].eval()
    x = torch.zeros(1, 3, 16, 16)
    y = x.clone()
    y[0, :, 5, 7] = 1.0
    diff = (first(y) - first(x)).abs().sum(1)[0]  # (16, 16)
    assert diff[5, 7] > 0 and diff[0, 0] == 0


def test_conv_stem_refuses_a_patch_size_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two patch size"):
        ConvStem(3, 32, 6)


def test_model_config_builds_the_stems_it_names(tiny_overrides):
    from mmgeo.models.registry import model_config
    from mmgeo.models.towers import build_image_tower

    vit = build_image_tower(model_config("geo-tiny", **tiny_overrides, image_conv_stem=True, image_stem_full_res=True))
    assert isinstance(vit.patch_embed.proj, ConvStem) and vit.patch_embed.proj[0].stride == (1, 1)
    with pytest.raises(ValueError, match="set image_conv_stem true"):
        model_config("geo-tiny", image_stem_full_res=True)
