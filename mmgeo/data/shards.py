"""WebDataset shards: tar files of ``{key}.jpg`` / ``{key}.txt`` / ``{key}.json``, the layout img2dataset writes and
open_clip trains from (docs/training.md, "Training from WebDataset shards").

    expand_shards("data/cc/{00000..00123}.tar")   # brace expansion as open_clip writes it; "a::b" lists, pipe:CMD
    read_shard(url)                              # (position, sample dict) of one shard, through ``webdataset``
    decode_sample(sample) -> (image, captions)   # or a skip reason of SKIP_REASONS, counted as Flickr30K's are
    ShardSamples(pattern, size)                  # every good sample of the shards in listing order, ``ds[i]``

A sample's image is its first member with an image suffix (jpg, jpeg, png, webp); its captions are the lines of
its ``.txt`` (one line = one caption, several lines = several captions); ``.json`` (url, key, status, width,
height) is metadata. A sample's ``sample_id`` is ``shard number × SHARD_STRIDE + its position in the shard``
(shard number in listing order): stable across runs, used for caption draws and samples.tsv.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from pathlib import Path

from PIL import Image

from mmgeo.data.images import MAX_PIXELS, open_image

log = logging.getLogger("mmgeo.data")

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
SHARD_STRIDE = 1_000_000  # sample_id = shard number × SHARD_STRIDE + position: at most this many samples per shard
# the Flickr30K reasons (mmgeo.data.flickr.SKIP_REASONS), plus shards that end early (truncated / unreadable tar)
SKIP_REASONS = ("missing_file", "unreadable_image", "too_large", "empty_caption", "no_caption", "unreadable_shard")


class ShardError(ValueError):
    """A shard pattern that lists nothing, or shards that cannot be read; the message names the fix."""


def expand_shards(pattern: str) -> list[str]:
    """The shard URLs of ``pattern``: ``::``-separated parts, each brace-expanded (``{00000..00123}``, as
    webdataset / open_clip do). Local paths must exist; ``pipe:CMD`` and URLs are passed on unchecked."""
    from webdataset.shardlists import expand_urls

    if not pattern or not str(pattern).strip():
        raise ShardError("no shards given: set data.shards (train.py) or --shards (eval.py, serve build) to a "
                         "pattern like 'data/shards/{00000..00009}.tar'")
    urls = expand_urls(str(pattern))
    local = [u for u in urls if _is_local(u)]
    missing = [u for u in local if not Path(u).is_file()]
    if local and len(missing) == len(local):
        raise ShardError(f"no shard of {pattern!r} exists (first: {missing[0]!r}); check the folder and the brace "
                         "range, e.g. 'DIR/{00000..00009}.tar' for 00000.tar .. 00009.tar "
                         "(python -m mmgeo.data.make_shards writes shards from the shapes world)")
    if missing:
        raise ShardError(f"{len(missing)} of the {len(urls)} shards of {pattern!r} do not exist (first: "
                         f"{missing[0]!r}); fix the brace range to the shards that are there")
    return urls


def _is_local(url: str) -> bool:
    return not url.startswith("pipe:") and "://" not in url


def read_shard(url: str, errors: list | None = None):
    """(position, sample) of each sample of one shard, in order, through webdataset's tar reader (``pipe:CMD``
    runs CMD and reads its stdout). A shard that ends early (truncated, unreadable) stops with what was read;
    its error is appended to ``errors`` (a list) when given, else raised as ShardError."""
    from webdataset.tariterators import tarfile_samples

    failed = []

    def handler(exn: Exception) -> bool:
        failed.append(exn)
        return False  # stop this shard

    for pos, sample in enumerate(tarfile_samples([{"url": url}], handler=handler)):
        if pos >= SHARD_STRIDE:
            raise ShardError(f"shard {url!r} holds more than {SHARD_STRIDE:,} samples; split it (img2dataset "
                             "--number_sample_per_shard)")
        yield pos, sample
    if failed:
        if errors is None:
            raise ShardError(f"shard {url!r} cannot be read: {failed[0]}")
        errors.append(f"{url}: {failed[0]}")


def decode_sample(sample: dict, max_pixels: int = MAX_PIXELS) -> tuple[Image.Image | None, list[str], str | None]:
    """(RGB image, captions, None) of a shard sample, or (None, [], reason) when it is skipped: no image member
    (``missing_file``), an undecodable or truncated one (``unreadable_image``), more than ``max_pixels``
    (``too_large``), no ``.txt`` or no non-empty line in it (``no_caption``)."""
    ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
    if ext is None:
        return None, [], "missing_file"
    text = sample.get("txt")
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    captions = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not captions:
        return None, [], "no_caption"
    try:
        image = open_image(io.BytesIO(sample[ext]), max_pixels)
    except ValueError as err:
        return None, [], "too_large" if "over the limit" in str(err) else "unreadable_image"
    except (OSError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, [], "unreadable_image"
    return image, captions, None


def ordered(counts: Counter) -> Counter:
    """``counts`` in SKIP_REASONS order, zero counts dropped (what reports print)."""
    return Counter({k: counts[k] for k in SKIP_REASONS if counts[k]})


class ShardSamples:
    """Every good sample of the shards of ``pattern``, in listing order (no shuffle: evaluation and gallery builds
    read the same images in the same order), at most ``size``; ``ds[i] -> (PIL.Image RGB, list[str])``.

    Samples are read once, checked as ``decode_sample`` does, and kept encoded in memory (decoded again on
    access); bad ones are dropped and counted in ``skipped`` by reason, with one log line, as Flickr30K's are."""

    def __init__(self, pattern: str, size: int | None = None, max_pixels: int = MAX_PIXELS):
        self.pattern, self.max_pixels = str(pattern), max_pixels
        self.urls = expand_shards(pattern)
        self.skipped: Counter[str] = Counter()
        self.items: list[tuple[bytes, list[str]]] = []  # (encoded image, captions)
        self.keys: list[str] = []  # each kept sample's __key__
        self.ids: list[int] = []  # each kept sample's sample_id
        errors: list[str] = []
        for shard, url in enumerate(self.urls):
            if size is not None and len(self.items) >= size:
                break
            for pos, sample in read_shard(url, errors):
                if size is not None and len(self.items) >= size:
                    break
                image, captions, reason = decode_sample(sample, max_pixels)
                if reason:
                    self.skipped[reason] += 1
                    continue
                ext = next(e for e in IMAGE_EXTENSIONS if e in sample)
                self.items.append((sample[ext], captions))
                self.keys.append(sample["__key__"])
                self.ids.append(shard * SHARD_STRIDE + pos)
        self.skipped["unreadable_shard"] += len(errors)
        self.skipped = ordered(self.skipped)
        for err in errors:
            log.warning("shard ended early: %s", err)
        if self.skipped:
            log.warning("webdataset %s: skipped %s (%d samples kept)", self.pattern, dict(self.skipped),
                        len(self.items))
        if not self.items:
            raise ShardError(f"no good sample in the shards of {self.pattern!r} (skipped: {dict(self.skipped)})")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Image.Image, list[str]]:
        data, captions = self.items[i]
        return open_image(io.BytesIO(data), self.max_pixels), list(captions)

    @property
    def num_captions(self) -> int:
        return sum(len(c) for _, c in self.items)


def check_shard_count(num_shards: int, world: int, workers: int, pattern: str) -> None:
    """Shards go to readers (rank × worker) whole; fewer shards than readers would leave a reader without data."""
    readers = world * max(1, workers)
    if num_shards < readers:
        raise ShardError(f"{num_shards} shard(s) in {pattern!r} for {readers} readers ({world} rank(s) × "
                         f"{max(1, workers)} loader worker(s)): every reader needs at least one whole shard; "
                         f"lower data.num_workers or write the data into at least {readers} shards")
