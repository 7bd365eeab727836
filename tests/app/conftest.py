"""Fixtures shared by the entry-point tests."""

import pytest
import torch

import mmgeo


@pytest.fixture(scope="module")
def random_geo_tiny(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    mmgeo.save_model(mmgeo.create_model("geo-tiny").eval(), path)
    return path
