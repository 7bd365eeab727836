"""Flickr30K loaders on format-faithful fixtures: the three layouts, split selection, bad samples."""

import logging

import pytest
from PIL import Image

from mmgeo.data import Flickr30K, build_dataset, detect_format
from tests.data import flickr_fixtures as fx
from tests.data.flickr_fixtures import BAD_EXPECTED, COUNTS, MAX_PIXELS, WRITERS, image_bytes, write_csv


@pytest.fixture(scope="module", params=sorted(WRITERS))
def layout(request, tmp_path_factory):
    fmt = request.param
    return fmt, WRITERS[fmt](tmp_path_factory.mktemp(fmt), bad=True)


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_every_layout_yields_images_with_all_their_captions(layout, split):
    fmt, root = layout
    assert detect_format(root) == fmt
    ds = build_dataset("flickr30k", split, root=str(root), max_pixels=MAX_PIXELS)
    expected = COUNTS[split] + (1 if split == "test" else 0)  # the one-empty-caption image stays
    assert len(ds) == expected and ds.format == fmt
    image, captions = ds[0]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (40, 48)
    assert len(captions) == 5 and all(c.strip() for c in captions)
    assert ds.captions(0) == captions  # the same captions without reading the image


def test_bad_samples_are_skipped_counted_and_logged(layout, caplog):
    fmt, root = layout
    with caplog.at_level(logging.WARNING, logger="mmgeo.data"):
        ds = Flickr30K(root, "test", max_pixels=MAX_PIXELS)
    assert dict(ds.skipped) == BAD_EXPECTED
    assert "skipped" in caplog.text and "too_large" in caplog.text
    assert [len(c) for _, c in ds.items] == [5] * COUNTS["test"] + [4]  # the rest intact
    assert all(ds[i][0].size == (40, 48) for i in range(len(ds)))


def test_size_limit_and_format_override(tmp_path):
    path = write_csv(tmp_path, sep=",")
    ds = build_dataset("flickr30k", "train", size=3, root=str(path), data_format="csv")
    assert len(ds) == 3 and ds.num_captions == 15 and not ds.skipped


def test_csv_without_split_column_is_the_split(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes(1, "PNG"))
    (tmp_path / "t.csv").write_text("filepath,title\na.png,a dog\na.png,a brown dog\n")
    ds = Flickr30K(tmp_path / "t.csv", "test")
    assert len(ds) == 1 and ds[0][1] == ["a dog", "a brown dog"]


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--data-root"):
        build_dataset("flickr30k", "test")
    with pytest.raises(ValueError, match="neither"):
        detect_format(tmp_path)
    (tmp_path / "t.csv").write_text("path,caption\nx.png,a dog\n")
    with pytest.raises(ValueError, match="filepath"):
        Flickr30K(tmp_path / "t.csv", "test")
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("coco", "test")


def test_uncached_dataset_id_names_the_download():
    from mmgeo.models.hub import MissingDownloadError

    with pytest.raises(MissingDownloadError, match="huggingface-cli download mmgeo-test/no-such-dataset"):
        Flickr30K("mmgeo-test/no-such-dataset", "test")


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_parquet_files_per_split_without_a_split_column(tmp_path, split):
    root = fx.write_parquet_per_split(tmp_path / "flickr")
    ds = build_dataset("flickr30k", split, root=str(root))
    assert ds.format == "hf" and len(ds) == COUNTS[split] and ds.num_captions == 5 * COUNTS[split]
