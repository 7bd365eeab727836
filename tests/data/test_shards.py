"""WebDataset shards: listing, reading in order, bad samples skipped and counted, readers that never share a shard,
and the caption path (negatives, partial captions) the same as for map-style data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmgeo.data import ShapesWorld, build_dataset
from mmgeo.data.make_shards import write_shards
from mmgeo.data.pairs import CaptionPairs, Collate
from mmgeo.data.shard_stream import ShardLoader, ShardPairs, ShardSource, reader_shards
from mmgeo.data.shards import SHARD_STRIDE, ShardError, check_shard_count, expand_shards
from tests.data.shard_fixtures import CORRUPT, NO_CAPTION, write_fixture_shards


def _tokenize(texts):
    return {"input_ids": torch.zeros(len(texts), 2, dtype=torch.long),
            "attention_mask": torch.ones(len(texts), 2, dtype=torch.long)}


def _to_tensor(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255


def _loader(pattern, samples_per_epoch, batch, workers=0, buffer=4, negatives=0, partial=0.0):
    source = ShardSource(pattern, samples_per_epoch, buffer)
    pairs = CaptionPairs(source, _to_tensor, seed=0, caption_negatives=negatives, partial_captions=partial)
    return source, ShardLoader(ShardPairs(source, pairs, Collate(_tokenize), batch, seed=0), batch, workers)


def test_ordered_reading_skips_and_counts_bad_samples(tmp_path):
    pattern, good = write_fixture_shards(tmp_path, shards=3, per_shard=4, bad={1: CORRUPT, 6: NO_CAPTION})
    ds = build_dataset("webdataset", "test", shards=pattern)
    assert ds.keys == good and len(ds) == 10
    assert dict(ds.skipped) == {"unreadable_image": 1, "no_caption": 1}
    image, captions = ds[0]
    assert image.mode == "RGB" and image.size == (32, 32)
    assert len(captions) == 2 and captions[1].endswith("(caption 1)")  # several .txt lines: several captions
    assert ds.ids[:3] == [0, 2, 3] and ds.ids[-1] == 2 * SHARD_STRIDE + 3
    assert build_dataset("webdataset", "test", shards=pattern, size=3).keys == good[:3]


def test_pipe_commands_read_the_same_samples(tmp_path):
    pattern, good = write_fixture_shards(tmp_path, shards=2, per_shard=3)
    piped = "::".join(f"pipe:cat {tmp_path}/{s:05d}.tar" for s in range(2))
    assert build_dataset("webdataset", "test", shards=piped).keys == good


def test_shard_patterns_that_list_nothing_name_the_fix(tmp_path):
    write_fixture_shards(tmp_path, shards=2, per_shard=2)
    assert len(expand_shards(f"{tmp_path}/{{00000..00001}}.tar")) == 2
    with pytest.raises(ShardError, match=r"no shard of .*nope.* exists .*brace range"):
        expand_shards(f"{tmp_path}/nope/{{00000..00001}}.tar")
    with pytest.raises(ShardError, match=r"2 of the 4 shards of .* do not exist .*00002.tar"):
        expand_shards(f"{tmp_path}/{{00000..00003}}.tar")
    with pytest.raises(ShardError, match="no shards given: set data.shards"):
        expand_shards("")
    with pytest.raises(ValueError, match="needs data.samples_per_epoch"):
        ShardSource(f"{tmp_path}/{{00000..00001}}.tar", None)
    with pytest.raises(ShardError, match=r"2 shard\(s\) .* for 4 readers \(2 rank\(s\) × 2 loader worker\(s\)\)"):
        check_shard_count(2, world=2, workers=2, pattern="p")


def test_readers_split_by_node_then_worker_never_share_a_shard():
    for epoch in range(3):
        taken = [reader_shards(10, 0, epoch, r, 2, w, 2) for r in range(2) for w in range(2)]
        flat = [s for t in taken for s in t]
        assert sorted(flat) == list(range(10)) and len(flat) == len(set(flat))
    assert reader_shards(10, 0, 0, 0, 1, 0, 0) != reader_shards(10, 0, 1, 0, 1, 0, 0)  # reshuffled per epoch


def test_an_epoch_reads_every_sample_once_over_two_workers_and_counts_bad_ones(tmp_path):
    pattern, good = write_fixture_shards(tmp_path, shards=4, per_shard=5, bad={3: CORRUPT, 12: NO_CAPTION})
    source, loader = _loader(pattern, samples_per_epoch=18, batch=3, workers=2)
    ids = []
    for step, batch in enumerate(loader):
        assert int(batch["step"]) == step and int(batch["epoch"]) == 0
        ids += batch["index"].tolist()
        source.record([batch["reader"].tolist()])  # what ShardProgress does after each step
    assert len(ids) == 18 == len(set(ids))
    keys = {int(k[:5]) * SHARD_STRIDE + int(k[5:]) for k in good}
    assert set(ids) == keys  # all 18 good samples, the two bad ones skipped
    assert dict(source.skipped) == {"unreadable_image": 1, "no_caption": 1}


def test_readers_that_run_dry_say_to_lower_samples_per_epoch(tmp_path):
    pattern, _ = write_fixture_shards(tmp_path, shards=2, per_shard=4)
    _, loader = _loader(pattern, samples_per_epoch=12, batch=2)
    with pytest.raises(ShardError, match=r"ran dry in epoch 0 after 4 of 6 steps.*lower data.samples_per_epoch"):
        list(loader)


def test_shard_captions_take_the_same_caption_path_as_the_in_memory_world(tmp_path):
    """Shards written from the shapes world hold its pixels and captions; CaptionPairs draws the same caption,
    negatives and partial captions from them; the stream's batches carry the negatives."""
    world = ShapesWorld("train", image_size=32, size=12)
    pattern = write_shards((world[i] for i in range(12)), tmp_path, per_shard=5)
    assert pattern.endswith("{00000..00002}.tar")
    shards = build_dataset("webdataset", "train", shards=pattern)
    kw = dict(seed=3, caption_negatives=2, partial_captions=0.5)
    a, b = CaptionPairs(world, _to_tensor, **kw), CaptionPairs(shards, _to_tensor, **kw)
    partial = 0
    for i in range(12):
        image, captions = shards[i]
        assert np.array_equal(np.asarray(image), np.asarray(world[i][0])) and captions == world[i][1]
        for epoch in range(3):
            x, y = a[(i, epoch, 0)]["pairs"][0], b.item([shards[i]], i, epoch, 0)["pairs"][0]
            assert torch.equal(x[0], y[0]) and x[1:] == y[1:] and len(y[2]) == 2
            partial += y[1] not in captions
    assert partial > 0  # some captions were cut to one or two object phrases
    _, loader = _loader(pattern, samples_per_epoch=8, batch=4, negatives=2, partial=0.5)
    batch = next(iter(loader))
    assert int(batch["num_captions"]) == 4 and batch["input_ids"].shape[0] == 4 + 4 * 2
    with pytest.raises(ValueError, match="cannot make hard-negative variants"):
        CaptionPairs(ShardSource(pattern, 8), _to_tensor, seed=0, hard_negatives=True)
