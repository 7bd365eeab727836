"""Format-faithful SugarCREPE fixtures: one JSON per edit type as in the data/ folder of
github.com/RAIVNLab/sugar-crepe (an object mapping ids "0", "1", ... to {"filename", "caption",
"negative_caption"}), and COCO-named JPEG images (000000xxxxxx.jpg) in a separate folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from mmgeo.data.sugarcrepe import SUGARCREPE_TYPES

PER_TYPE = 2  # entries per edit type; entry i of every type names image i (images are shared, as in COCO)


def coco_name(i: int) -> str:
    return f"{i:012d}.jpg"


def write_sugarcrepe(root: Path, per_type: int = PER_TYPE) -> tuple[Path, Path]:
    """Lay out ``root/data/*.json`` and ``root/val2017/*.jpg``; returns (json_dir, image_dir)."""
    json_dir, image_dir = root / "data", root / "val2017"
    json_dir.mkdir(parents=True)
    image_dir.mkdir(parents=True)
    for i in range(per_type):
        Image.new("RGB", (24, 20), (40 * i + 30, 120, 200 - 40 * i)).save(image_dir / coco_name(i), format="JPEG")
    for edit in SUGARCREPE_TYPES:
        entries = {str(i): {"filename": coco_name(i), "caption": f"a red bus next to a white car {i}",
                            "negative_caption": f"a white bus next to a red car {i} ({edit})"}
                   for i in range(per_type)}
        (json_dir / f"{edit}.json").write_text(json.dumps(entries, indent=4))
    return json_dir, image_dir


def edit_entry(json_dir: Path, edit: str, key: str, entry) -> None:
    """Replace (or add) one entry of one file."""
    path = json_dir / f"{edit}.json"
    data = json.loads(path.read_text())
    data[key] = entry
    path.write_text(json.dumps(data))
