"""Flickr30K, Karpathy split (29,000 / 1,014 / 1,000 images, 5 captions each), from three layouts (docs/design.md §5).

    hf        a Hugging Face ``datasets`` id (cached only when offline) or a folder of .parquet files with
              columns ``image`` / ``caption`` (list) / ``split`` / ``filename`` — nlphuji/flickr30k's layout,
              one "test" split holding every row, the ``split`` column naming train / val / test — or a
              dataset that ships separate train / validation / test splits
    karpathy  ``dataset_flickr30k.json`` ({"images": [{"filename", "split", "sentences": [{"raw"}]}]}) plus
              an image folder (``flickr30k-images/``, ``images/`` or the json's own folder); "restval" is train
    csv       open_clip's CSV / TSV: ``filepath`` and ``title`` columns, one row per caption, rows grouped by
              image; an optional ``split`` column, otherwise the whole file is the split

``ds[i] -> (PIL.Image RGB, list[str])``: one image, all its captions (training draws one of them per
step; evaluation encodes every one).

Bad samples are dropped **when the index is built**, so every consumer — a DataLoader worker, the
evaluation loop — sees the same clean, fixed-length dataset and nothing has to skip mid-batch: each
image is decoded once (in a thread pool) and checked for a missing file, an unreadable or truncated
file, and more than ``max_pixels`` pixels (the decompression-bomb guard, checked on the header before
decoding); empty captions are dropped, and an image left with none is dropped. ``ds.skipped`` counts
drops by reason (a caption-level reason counts captions) and one log line reports them. Images are
decoded again lazily on access; a file that turns bad after validation raises a clear error.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from mmgeo.data.images import MAX_PIXELS

log = logging.getLogger("mmgeo.data")

KARPATHY_JSON = "dataset_flickr30k.json"
SPLIT_SIZES = {"train": 29_000, "val": 1_014, "test": 1_000}  # images; 5 captions each
_SPLIT_ALIASES = {"train": ("train", "restval"), "val": ("val", "validation", "dev"), "test": ("test",)}
SKIP_REASONS = ("missing_file", "unreadable_image", "too_large", "empty_caption", "no_caption")


def detect_format(root: str | os.PathLike) -> str:
    """Layout from the path: a .csv/.tsv file -> csv; a folder with dataset_flickr30k.json (or the json
    itself) -> karpathy; a folder of .parquet files or a dataset id -> hf."""
    path = Path(root)
    if path.suffix.lower() in (".csv", ".tsv"):
        return "csv"
    if path.name == KARPATHY_JSON or (path / KARPATHY_JSON).is_file():
        return "karpathy"
    if path.is_dir():
        if next(path.rglob("*.parquet"), None) is not None:
            return "hf"
        raise ValueError(f"cannot tell the Flickr30K layout of folder {str(path)!r}: it holds neither "
                         f"{KARPATHY_JSON} nor .parquet files; see data/README.md, or pass --data-format")
    if path.exists():
        raise ValueError(f"cannot tell the Flickr30K layout of {str(path)!r}; name it with --data-format "
                         "hf|karpathy|csv")
    return "hf"  # not a local path: a Hugging Face dataset id


def check_split(split: str) -> None:
    """Raise a ValueError naming the fix when ``split`` is not a Flickr30K Karpathy split."""
    if split == "cogent":
        raise ValueError("split 'cogent' (held-out colour-shape combos) exists only in the synthetic shapes world "
                         "(--data synthetic); flickr30k has the splits train / val / test")
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {list(SPLIT_SIZES)}, got {split!r}")


class Flickr30K:
    """Flickr30K Karpathy split from an ``hf`` / ``karpathy`` / ``csv`` layout (see the module docstring).

    root: folder, file or dataset id; split: train / val / test; data_format: None = detect from ``root``;
    size: keep the first N valid images; max_pixels: larger images are skipped.
    """

    def __init__(self, root: str | os.PathLike, split: str = "test", data_format: str | None = None,
                 size: int | None = None, max_pixels: int = MAX_PIXELS):
        check_split(split)
        self.root, self.split, self.max_pixels = str(root), split, max_pixels
        self.format = data_format or detect_format(root)
        loaders = {"hf": self._load_hf, "karpathy": self._load_karpathy, "csv": self._load_csv}
        if self.format not in loaders:
            raise ValueError(f"data_format must be one of {list(loaders)}, got {self.format!r}")
        self._hf = None  # the HF table (images read from it by row) for the hf layout
        records = loaders[self.format]()  # [(path or row id, captions)]
        if not records:
            raise ValueError(f"no {split!r} images found in {self.root!r} ({self.format} layout)")
        self.skipped: Counter[str] = Counter()  # dropped samples by reason (see SKIP_REASONS)
        self.items = self._validate(records, size)  # [(path or row id, captions)] all valid
        total = len(records)
        if self.skipped:
            log.warning("flickr30k %s: skipped %s (%d of %d images kept) from %s", split, dict(self.skipped),
                        len(self.items), total, self.root)
        if not self.items:
            raise ValueError(f"every {split!r} image in {self.root!r} was skipped: {dict(self.skipped)}")

    # ------------------------------------------------------------------ layouts
    def _load_hf(self) -> list[tuple[int, list[str]]]:
        table = _open_hf(self.root, self.split)
        for col in ("image", "caption"):
            if col not in table.column_names:
                raise ValueError(f"{self.root!r} has no {col!r} column (columns: {table.column_names}); "
                                 "expected nlphuji/flickr30k's image / caption / split / filename")
        self._hf = table
        return [(i, [c] if isinstance(c, str) else list(c or [])) for i, c in enumerate(table["caption"])]

    def _load_karpathy(self) -> list[tuple[str, list[str]]]:
        path = Path(self.root)
        meta = path if path.name == KARPATHY_JSON else path / KARPATHY_JSON
        images = json.loads(meta.read_text())["images"]
        rows = [im for im in images if im["split"] in _SPLIT_ALIASES[self.split]]
        folder = _image_folder(meta.parent, [im["filename"] for im in rows[:20]])
        return [(str(folder / im["filename"]), [s["raw"] for s in im["sentences"]]) for im in rows]

    def _load_csv(self) -> list[tuple[str, list[str]]]:
        path = Path(self.root)
        delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter=delimiter)
            missing = {"filepath", "title"} - set(reader.fieldnames or [])
            if missing:
                raise ValueError(f"{path} lacks column(s) {sorted(missing)} (has {reader.fieldnames}); open_clip's "
                                 "CSV layout is `filepath` + `title`, one row per caption")
            grouped: dict[str, list[str]] = {}
            for row in reader:
                if "split" in row and row["split"] not in _SPLIT_ALIASES[self.split]:
                    continue
                file = row["filepath"]
                file = file if os.path.isabs(file) else str(path.parent / file)
                grouped.setdefault(file, []).append(row["title"] or "")
        return list(grouped.items())

    # ------------------------------------------------------------------ validation
    def _read(self, key) -> bytes | str:
        """Raw image source: a path, or the bytes of an HF row (raises FileNotFoundError when absent)."""
        if self._hf is None:
            return key
        cell = self._hf[int(key)]["image"]
        if cell is None:
            raise FileNotFoundError(f"row {key} has no image")
        if isinstance(cell, dict):
            if cell.get("bytes"):
                return cell["bytes"]
            if cell.get("path"):
                return cell["path"]
            raise FileNotFoundError(f"row {key} has no image bytes or path")
        return cell  # a path string

    def _decode(self, key) -> Image.Image:
        src = self._read(key)
        with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as im:
            w, h = im.size
            if w * h > self.max_pixels:
                raise _TooLarge(f"{w}x{h} pixels > max_pixels={self.max_pixels}")
            return im.convert("RGB")  # convert() decodes fully: truncation surfaces here

    def _check(self, key) -> str | None:
        try:
            self._decode(key)
        except FileNotFoundError:
            return "missing_file"
        except (_TooLarge, Image.DecompressionBombError):
            return "too_large"
        except (OSError, SyntaxError, ValueError):  # PIL: UnidentifiedImageError, truncated file, bad header
            return "unreadable_image"
        return None

    def _validate(self, records, size: int | None) -> list:
        """Drop bad samples (counted in ``self.skipped``); stop once ``size`` images are kept."""
        items, chunk = [], 256  # validate in chunks so that ``size`` stops early
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            for start in range(0, len(records), chunk):
                part = records[start:start + chunk]
                for (key, caps), reason in zip(part, pool.map(self._check, [k for k, _ in part])):
                    if size is not None and len(items) >= size:
                        break
                    good = [c.strip() for c in caps if isinstance(c, str) and c.strip()]
                    if reason or not good:
                        self.skipped[reason or "no_caption"] += 1
                        continue
                    self.skipped["empty_caption"] += len(caps) - len(good)
                    items.append((key, good))
        self.skipped = Counter({k: self.skipped[k] for k in SKIP_REASONS if self.skipped[k]})  # stable order
        return items

    # ------------------------------------------------------------------ dataset protocol
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Image.Image, list[str]]:
        key, captions = self.items[i]
        try:
            return self._decode(key), list(captions)
        except Exception as err:  # noqa: BLE001 - name the file and the way out
            raise RuntimeError(f"image {key!r} of {self.root!r} was valid when the dataset was indexed but cannot "
                               f"be read now ({err}); rebuild the dataset") from err

    def captions(self, i: int) -> list[str]:
        """``self[i][1]`` without reading the image."""
        return list(self.items[i][1])

    @property
    def num_captions(self) -> int:
        return sum(len(c) for _, c in self.items)


class _TooLarge(ValueError):
    pass


def _image_folder(base: Path, sample: list[str]) -> Path:
    """The folder holding the Karpathy json's images: the first candidate where sample files exist."""
    candidates = [base / "flickr30k-images", base / "images", base / "flickr30k_images", base]
    for folder in candidates:
        if sample and any((folder / name).is_file() for name in sample):
            return folder
    return candidates[0]


def _open_hf(root: str, split: str):
    """-> one ``datasets.Dataset`` of the split's rows, images left undecoded ({"bytes", "path"})."""
    import datasets

    path = Path(root)
    try:
        if path.is_dir():
            files = sorted(str(p) for p in path.rglob("*.parquet"))
            table = datasets.load_dataset("parquet", data_files={"rows": files}, split="rows")
            if "split" not in table.column_names:  # files per split: pick them by name
                names = _SPLIT_ALIASES[split]
                mine = [f for f in files if any(n in Path(f).relative_to(path).as_posix().lower() for n in names)]
                if not mine:
                    raise ValueError(f"{root!r}: no `split` column and no parquet file named after {split!r}")
                table = datasets.load_dataset("parquet", data_files={split: mine}, split=split)
        else:
            dd = datasets.load_dataset(root)
            first = next(iter(dd.values()))
            if "split" in first.column_names:
                table = datasets.concatenate_datasets(list(dd.values()))
            else:
                name = next((n for n in _SPLIT_ALIASES[split] if n in dd), None)
                if name is None:
                    raise ValueError(f"dataset {root!r} has splits {list(dd)}; none is {split!r}")
                table = dd[name]
    except (ConnectionError, FileNotFoundError) as err:
        from mmgeo.models.hub import MissingDownloadError

        raise MissingDownloadError(
            f"dataset {root!r} is neither a local folder nor in the Hugging Face cache, and nothing can be downloaded "
            f"here ({type(err).__name__}). On a machine with network access run `huggingface-cli download {root} "
            "--repo-type dataset --local-dir DIR` (Flickr30K: `huggingface-cli download nlphuji/flickr30k --repo-type "
            "dataset --revision refs/convert/parquet --local-dir data/flickr30k`, data/README.md), copy DIR here "
            "and pass it as --data-root / data.root.") from err
    if isinstance(table.features.get("image"), datasets.Image):
        table = table.cast_column("image", datasets.Image(decode=False))
    if "split" in table.column_names:
        names = set(_SPLIT_ALIASES[split])
        table = table.select([i for i, s in enumerate(table["split"]) if s in names])
    return table
