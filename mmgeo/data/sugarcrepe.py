"""SugarCREPE (Hsieh et al., NeurIPS 2023 Datasets and Benchmarks) in its published format.

The benchmark's repository (github.com/RAIVNLab/sugar-crepe) ships one JSON per edit type in its
``data/`` folder — ``add_att.json``, ``add_obj.json``, ``replace_att.json``, ``replace_obj.json``,
``replace_rel.json``, ``swap_att.json``, ``swap_obj.json`` — each mapping an id to
``{"filename": COCO val2017 image, "caption": positive, "negative_caption": negative}``. The edit
type is the file's name. Images are read lazily, when the suite scores them.

A malformed entry or a missing image raises an error naming the file, the entry and the fix; with
``skip_bad=True`` such entries are skipped instead and counted by file and reason in the item set's
``report`` (never dropped silently).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from mmgeo.data.edit_items import CompositionalItem, ItemSet

SUGARCREPE_TYPES = ("add_obj", "add_att", "replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att")
FIELDS = ("filename", "caption", "negative_caption")
REPO = "https://github.com/RAIVNLab/sugar-crepe"
COCO_VAL = "http://images.cocodataset.org/zips/val2017.zip"


def _how_to_get(json_dir: Path, image_dir: Path) -> str:
    return (f"SugarCREPE needs (1) the JSON files of the data/ folder of {REPO} ({', '.join(SUGARCREPE_TYPES)}"
            f" .json) in {json_dir} and (2) the COCO val2017 images ({COCO_VAL}, unzipped: 000000xxxxxx.jpg) in "
            f"{image_dir}; then run eval.py --suite compositional --data sugarcrepe --data-root {json_dir} "
            f"--image-root {image_dir}")


def _entry_problem(entry) -> str | None:
    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}, not an object with keys {list(FIELDS)}"
    missing = [k for k in FIELDS if not isinstance(entry.get(k), str) or not entry[k].strip()]
    return f"lacks a non-empty string {missing}" if missing else None


def load_sugarcrepe(json_dir, image_dir, limit: int | None = None, skip_bad: bool = False) -> ItemSet:
    """Suite items (one per entry, edit type = file name) from SugarCREPE's JSON files in ``json_dir``
    with images in ``image_dir``; ``limit``: first N entries of each file.

    ``report``: ``files`` (entries read per edit type), ``skipped`` ({edit type: {reason: n}}) and
    ``missing_types`` (standard edit types without a file).
    """
    json_dir, image_dir = Path(json_dir), Path(image_dir)
    if not json_dir.is_dir():
        raise FileNotFoundError(f"SugarCREPE annotations folder {json_dir} does not exist. "
                                + _how_to_get(json_dir, image_dir))
    files = sorted(json_dir.glob("*.json"), key=lambda f: (f.stem not in SUGARCREPE_TYPES, f.stem))
    if not files:
        raise FileNotFoundError(f"no SugarCREPE .json file in {json_dir}. " + _how_to_get(json_dir, image_dir))
    if not image_dir.is_dir():
        raise FileNotFoundError(f"SugarCREPE image folder {image_dir} does not exist. "
                                + _how_to_get(json_dir, image_dir))
    fix = "fix or remove the entry, or pass skip_bad=True (eval.py --skip-bad) to skip and count such entries"
    items, read, skipped = ItemSet(), {}, {}
    for path in files:
        edit = path.stem
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}); re-download it from {REPO} (data/)") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a {type(data).__name__}; SugarCREPE's format is an object mapping ids "
                             f"to {{{', '.join(FIELDS)}}} entries — re-download it from {REPO} (data/)")
        bad: Counter = Counter()
        entries = list(data.items())[:limit]
        for key, entry in entries:
            problem = _entry_problem(entry)
            reason = "malformed_entry"
            if problem is None and not (image_dir / entry["filename"]).is_file():
                problem = f"names image {entry['filename']!r}, which is not in {image_dir} (COCO val2017: {COCO_VAL})"
                reason = "missing_image"
            if problem is not None:
                if not skip_bad:
                    raise ValueError(f"{path}: entry {key!r} {problem}; {fix}")
                bad[reason] += 1
                continue
            items.append(CompositionalItem(image_dir / entry["filename"], entry["caption"],
                                           {edit: [entry["negative_caption"]]}, image_id=entry["filename"]))
        read[edit] = len(entries)
        if bad:
            skipped[edit] = dict(bad)
    items.report = {"files": read, "skipped": skipped,
                    "missing_types": [t for t in SUGARCREPE_TYPES if t not in read]}
    return items
