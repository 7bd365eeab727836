"""Write WebDataset shards in img2dataset's layout (``{key}.png|jpg`` + ``{key}.txt`` + ``{key}.json``), e.g. from the
shapes world, to train and evaluate from shards (docs/training.md, "Training from WebDataset shards").

    python -m mmgeo.data.make_shards --split train --out data/shapes_shards/train [--per-shard 1000]
    python -m mmgeo.data.make_shards --split val --out data/shapes_shards/val --limit 1014

Prints the shard pattern to pass as data.shards / --shards. Images are written as PNG by default (lossless: the
shards hold the in-memory world's pixels exactly); ``--image-format jpg`` writes JPEG as img2dataset does.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable
from pathlib import Path

from mmgeo.config import CliParser, run_cli


def write_shards(samples: Iterable, out: str | os.PathLike, per_shard: int = 1000, image_format: str = "png",
                 url_of=None) -> str:
    """Write ``(PIL image, captions)`` samples to ``out/00000.tar``, ``00001.tar``, ... (``per_shard`` each) through
    webdataset's ShardWriter; the ``.txt`` holds the captions one per line, the ``.json`` img2dataset's url /
    key / status / width / height (``url_of(i)``, default None). Returns the brace pattern of the shards."""
    from webdataset import ShardWriter

    if per_shard < 1:
        raise ValueError(f"--per-shard must be at least 1, got {per_shard}")
    if image_format not in ("png", "jpg"):
        raise ValueError(f"--image-format must be png or jpg, got {image_format!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.tar")):
        raise FileExistsError(f"{out} already holds .tar files; write the shards into an empty folder")
    count = 0
    with ShardWriter(str(out / "%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (image, captions) in enumerate(samples):
            buf = io.BytesIO()
            image.save(buf, format="PNG" if image_format == "png" else "JPEG", quality=95)
            key = f"{i // per_shard:05d}{i % per_shard:04d}"
            meta = {"url": url_of(i) if url_of else None, "key": key, "status": "success",
                    "width": image.width, "height": image.height, "caption": captions[0]}
            sink.write({"__key__": key, image_format: buf.getvalue(), "txt": "\n".join(captions),
                        "json": json.dumps(meta)})
            count += 1
    if count == 0:
        raise ValueError("no samples to write")
    last = (count - 1) // per_shard
    return str(out / f"{{00000..{last:05d}}}.tar") if last else str(out / "00000.tar")


def main(argv: list[str] | None = None) -> str:
    p = CliParser(prog="python -m mmgeo.data.make_shards", description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="train", choices=["train", "val", "test", "cogent"], help="shapes-world split")
    p.add_argument("--out", required=True, help="folder to write the shards into (new or empty)")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    p.add_argument("--limit", type=int, default=None, help="only the first N images of the split")
    p.add_argument("--seed", type=int, default=0, help="shapes-world seed (data.seed)")
    p.add_argument("--image-size", type=int, default=48, help="image side in px (the model's input size; geo-tiny 48)")
    p.add_argument("--image-format", default="png", choices=["png", "jpg"])
    args = p.parse_args(argv)
    from tqdm import tqdm

    from mmgeo.data import ShapesWorld

    world = ShapesWorld(args.split, seed=args.seed, image_size=args.image_size, size=args.limit)
    samples = (world[i] for i in tqdm(range(len(world)), desc=f"shapes {args.split}"))
    pattern = write_shards(samples, args.out, args.per_shard, args.image_format,
                           url_of=lambda i: f"synthetic://{args.split}/{i}")
    print(f"wrote {len(world)} samples of the shapes world's {args.split} split to {pattern}")
    return pattern


if __name__ == "__main__":
    run_cli(main)
