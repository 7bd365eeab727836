import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    # Kernel tests run Triton on CPU through its interpreter, which is read when triton is first
    # imported — and Lightning imports triton, so this must happen before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A geo-tiny shrunk to test size: same code paths, seconds to build and run.
TINY = dict(text_hidden=32, text_layers=1, text_heads=2, image_embed_dim=32, image_depth=1, image_heads=2,
            image_size=32, patch_size=8, key_hidden=16, query_hidden=32, num_heads=2, d_a=8, d_e=8, d_global=16)


@pytest.fixture
def tiny_overrides():
    return dict(TINY)


@pytest.fixture
def tiny_model():
    import mmgeo

    torch.manual_seed(0)
    return mmgeo.create_model("geo-tiny", **TINY).eval()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
