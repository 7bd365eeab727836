"""Fetch Flickr30K (Karpathy split) and check its split counts (data/README.md).

    python data/prepare_flickr30k.py --fetch data/flickr30k     # HF parquet conversion of nlphuji/flickr30k
    python data/prepare_flickr30k.py --check data/flickr30k [--data-format hf|karpathy|csv]

--check loads every split through the same loader train.py / eval.py use (every image decoded once),
prints images / captions / skipped per split and exits with status 1 when a count is off:
29,000 / 1,014 / 1,000 images with 5 captions each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from mmgeo.data.flickr import SPLIT_SIZES, Flickr30K  # noqa: E402

CAPTIONS_PER_IMAGE = 5
HF_REPO, HF_REVISION = "nlphuji/flickr30k", "refs/convert/parquet"


def check(root: str, data_format: str | None = None, expected: dict[str, int] = SPLIT_SIZES) -> list[str]:
    """-> problems (empty when every split has the expected images, each with 5 captions); prints a table."""
    problems = []
    print(f"{'split':6} {'images':>7} {'expected':>8} {'captions':>9} {'expected':>8}  skipped")
    for split, n in expected.items():
        try:
            ds = Flickr30K(root, split, data_format=data_format)
        except ValueError as err:
            problems.append(f"{split}: {err}")
            continue
        caps = ds.num_captions
        print(f"{split:6} {len(ds):7d} {n:8d} {caps:9d} {CAPTIONS_PER_IMAGE * n:8d}  {dict(ds.skipped) or '-'}")
        if len(ds) != n:
            problems.append(f"{split}: {len(ds)} images, expected {n}")
        if caps != CAPTIONS_PER_IMAGE * n:
            problems.append(f"{split}: {caps} captions, expected {CAPTIONS_PER_IMAGE * n}")
        if ds.skipped:
            problems.append(f"{split}: bad samples skipped {dict(ds.skipped)}")
    return problems


def fetch(dest: str) -> Path:
    """Download the parquet conversion of nlphuji/flickr30k (~4.4 GB) into ``dest``."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(HF_REPO, repo_type="dataset", revision=HF_REVISION, local_dir=dest))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", metavar="PATH", help="folder / CSV / HF id to check")
    what.add_argument("--fetch", metavar="DEST", help=f"download {HF_REPO} ({HF_REVISION}) into DEST")
    p.add_argument("--data-format", choices=["hf", "karpathy", "csv"], default=None, help="default: detect")
    args = p.parse_args(argv)
    if args.fetch:
        print(f"fetched into {fetch(args.fetch)}; now run: python data/prepare_flickr30k.py --check {args.fetch}")
        return 0
    problems = check(args.check, args.data_format)
    if problems:
        print("\nFLICKR30K CHECK FAILED:\n  " + "\n  ".join(problems)
              + "\nsee data/README.md (wrong folder, an incomplete download, or a different split file?)")
        return 1
    print("\nFlickr30K Karpathy split OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
