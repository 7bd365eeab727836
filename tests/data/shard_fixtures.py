"""Tiny WebDataset shards written by the tests themselves, with tarfile, in img2dataset's layout: ``{key}.jpg``,
``{key}.txt`` and ``{key}.json`` (url, key, status, width, height) per sample; optionally a corrupt image and a
sample without its caption."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from PIL import Image

CORRUPT, NO_CAPTION = "corrupt", "no_caption"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def jpeg(i: int, size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256)).save(buf, format="JPEG")
    return buf.getvalue()


def caption(i: int) -> str:
    return f"a red circle number {i} in the top left with a blue square below it"


def write_fixture_shards(folder: Path, shards: int = 3, per_shard: int = 4, bad: dict | None = None,
                         captions: int = 2) -> tuple[str, list[str]]:
    """``shards`` tars of ``per_shard`` samples; ``bad`` = {sample number: CORRUPT | NO_CAPTION}. Sample n has key
    ``f"{shard:05d}{pos:04d}"`` and ``captions`` caption lines. Returns (the brace pattern, the good keys in order)."""
    folder.mkdir(parents=True, exist_ok=True)
    bad, good, n = bad or {}, [], 0
    for s in range(shards):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for pos in range(per_shard):
                key = f"{s:05d}{pos:04d}"
                image = b"\xff\xd8\xff\xe0 not really a jpeg" if bad.get(n) == CORRUPT else jpeg(n)
                _add(tar, f"{key}.jpg", image)
                if bad.get(n) != NO_CAPTION:
                    text = "\n".join(f"{caption(n)} (caption {c})" for c in range(captions))
                    _add(tar, f"{key}.txt", text.encode())
                meta = {"url": f"https://example.com/{n}.jpg", "key": key, "status": "success", "width": 32,
                        "height": 32}
                _add(tar, f"{key}.json", json.dumps(meta).encode())
                if n not in bad:
                    good.append(key)
                n += 1
    return str(folder / f"{{00000..{shards - 1:05d}}}.tar"), good
