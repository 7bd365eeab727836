"""Format-faithful Flickr30K fixtures: real JPEG/PNG bytes, the real column names / JSON structure / split field.

Each writer lays out ``counts`` images per split (5 captions each) and, with ``bad=True``, one bad
sample of each kind in the test split: a missing file (or absent bytes), a truncated JPEG, garbage
bytes, an image over ``BIG_SIDE``² pixels, all-empty captions, and one empty caption among five.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from PIL import Image

COUNTS = {"train": 8, "val": 3, "test": 4}
BIG_SIDE = 120  # the oversized image's side; tests pass max_pixels below BIG_SIDE²
MAX_PIXELS = 100 * 100
BAD_EXPECTED = {"missing_file": 1, "unreadable_image": 2, "too_large": 1, "empty_caption": 1, "no_caption": 1}


def image_bytes(i: int, fmt: str = "JPEG", side: int = 40) -> bytes:
    im = Image.new("RGB", (side, side + 8), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256))
    im.paste((255 - (37 * i) % 256, 40, 200), (4, 4, 4 + (i % 5) * 6 + 6, 20))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def _captions(i: int) -> list[str]:
    return [f"photo {i} variant {k}: a person with a red bag number {i}" for k in range(5)]


def samples(bad: bool = False, bad_split: str = "test") -> list[dict]:
    """[{filename, split, captions, data (bytes or None = missing)}]; bad ones last, in ``bad_split``."""
    rows, n = [], 0
    for split, count in COUNTS.items():
        for _ in range(count):
            fmt = "PNG" if n % 3 == 0 else "JPEG"
            rows.append({"filename": f"{1000 + n}.{'png' if fmt == 'PNG' else 'jpg'}", "split": split,
                         "captions": _captions(n), "data": image_bytes(n, fmt)})
            n += 1
    if bad:
        def add(name, data, caps=None):
            rows.append({"filename": name, "split": bad_split, "captions": caps or _captions(len(rows)), "data": data})
        add("missing.jpg", None)
        add("truncated.jpg", image_bytes(99, side=90)[:600])
        add("garbage.jpg", b"this is not an image at all" * 10)
        add("big.png", image_bytes(98, "PNG", side=BIG_SIDE))
        add("nocaption.jpg", image_bytes(97), ["", "  ", "", "", ""])
        add("onempty.jpg", image_bytes(96), _captions(96)[:4] + [""])
    return rows


def _write_images(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r in rows:
        if r["data"] is not None:
            (folder / r["filename"]).write_bytes(r["data"])


def write_karpathy(root: Path, bad: bool = False, bad_split: str = "test") -> Path:
    """root/dataset_flickr30k.json + root/flickr30k-images/ (Karpathy's structure)."""
    rows = samples(bad, bad_split)
    _write_images(root / "flickr30k-images", rows)
    images = [{"filepath": "", "filename": r["filename"], "imgid": i, "split": r["split"],
               "sentids": list(range(5 * i, 5 * i + 5)),
               "sentences": [{"raw": c, "tokens": c.lower().split(), "imgid": i, "sentid": 5 * i + k}
                             for k, c in enumerate(r["captions"])]} for i, r in enumerate(rows)]
    (root / "dataset_flickr30k.json").write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    return root


def write_csv(root: Path, bad: bool = False, sep: str = "\t", bad_split: str = "test") -> Path:
    """open_clip layout: filepath / title (one row per caption) and a split column; images alongside."""
    rows = samples(bad, bad_split)
    _write_images(root / "images", rows)
    path = root / ("flickr30k.tsv" if sep == "\t" else "flickr30k.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter=sep)
        w.writerow(["filepath", "title", "split"])
        for r in rows:
            for c in r["captions"]:
                w.writerow([f"images/{r['filename']}", c, r["split"]])
    return path


def write_parquet(root: Path, bad: bool = False, bad_split: str = "test") -> Path:
    """nlphuji/flickr30k's parquet conversion: TEST/test/0000.parquet, one split holding all rows."""
    import datasets

    rows = samples(bad, bad_split)
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Sequence(datasets.Value("string")),
                                  "sentids": datasets.Sequence(datasets.Value("string")),
                                  "split": datasets.Value("string"), "img_id": datasets.Value("string"),
                                  "filename": datasets.Value("string")})
    table = datasets.Dataset.from_dict({
        "image": [{"bytes": r["data"], "path": None} if r["data"] else None for r in rows],  # None: no image
        "caption": [r["captions"] for r in rows],
        "sentids": [[str(5 * i + k) for k in range(5)] for i in range(len(rows))],
        "split": [r["split"] for r in rows], "img_id": [str(i) for i in range(len(rows))],
        "filename": [r["filename"] for r in rows]}, features=features)
    out = root / "TEST" / "test"
    out.mkdir(parents=True, exist_ok=True)
    table.to_parquet(str(out / "0000.parquet"))
    return root


def write_parquet_per_split(root: Path) -> Path:
    """A dataset that ships separate splits: train- / validation- / test-0000.parquet, no split column."""
    import datasets

    src = write_parquet(root.parent / f"{root.name}-src") / "TEST" / "test" / "0000.parquet"
    full = datasets.load_dataset("parquet", data_files=str(src), split="train")
    root.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train"), ("val", "validation"), ("test", "test")):
        part = full.select([i for i, s in enumerate(full["split"]) if s == split]).remove_columns("split")
        part.to_parquet(str(root / f"{name}-0000.parquet"))
    return root


WRITERS = {"karpathy": write_karpathy, "csv": write_csv, "hf": write_parquet}
