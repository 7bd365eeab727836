"""A test-size open_clip architecture (ViT, 32 px, patch 8, one block per tower), registered in-process."""

import json
from pathlib import Path

NAME = "mmgeo-test-tiny"
CONFIG = {"embed_dim": 16,
          "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
          "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def register(folder: Path) -> str:
    """Write the config into ``folder`` and add it to open_clip's registry; -> the architecture name."""
    import open_clip

    (folder / f"{NAME}.json").write_text(json.dumps(CONFIG))
    open_clip.add_model_config(folder)
    return NAME
