"""SugarCREPE's published JSON format -> suite items; bad entries stop with the fix, or are counted."""

import pytest

from mmgeo.data.sugarcrepe import SUGARCREPE_TYPES, load_sugarcrepe
from tests.data.sugarcrepe_fixtures import PER_TYPE, coco_name, edit_entry, write_sugarcrepe


@pytest.fixture
def sugarcrepe(tmp_path):
    return write_sugarcrepe(tmp_path)


def test_loads_every_entry_with_its_edit_type(sugarcrepe):
    json_dir, image_dir = sugarcrepe
    items = load_sugarcrepe(json_dir, image_dir)
    assert len(items) == PER_TYPE * len(SUGARCREPE_TYPES)
    assert {edit for it in items for edit in it.negatives} == set(SUGARCREPE_TYPES)
    first = next(it for it in items if "swap_att" in it.negatives)
    assert first.caption == "a red bus next to a white car 0"
    assert first.negatives == {"swap_att": ["a white bus next to a red car 0 (swap_att)"]}
    assert first.rewrites == {} and first.image_id == coco_name(0)
    assert first.load_image().size == (24, 20) and first.load_image().mode == "RGB"
    assert len({it.image_key() for it in items}) == PER_TYPE  # images shared across edit types
    assert items.report == {"files": {t: PER_TYPE for t in SUGARCREPE_TYPES}, "skipped": {}, "missing_types": []}


def test_limit_reads_the_first_entries_of_each_file(sugarcrepe):
    items = load_sugarcrepe(*sugarcrepe, limit=1)
    assert len(items) == len(SUGARCREPE_TYPES) and all(it.image_id == coco_name(0) for it in items)


def test_subset_of_files_is_reported(sugarcrepe):
    json_dir, image_dir = sugarcrepe
    (json_dir / "add_obj.json").unlink()
    assert load_sugarcrepe(json_dir, image_dir).report["missing_types"] == ["add_obj"]


@pytest.mark.parametrize("entry, reason, message", [
    ({"filename": coco_name(0), "caption": "a cat"}, "malformed_entry", "negative_caption"),
    ({"filename": coco_name(0), "caption": "", "negative_caption": "a dog"}, "malformed_entry", "caption"),
    (["not", "an", "object"], "malformed_entry", "list"),
    ({"filename": "000000999999.jpg", "caption": "a cat", "negative_caption": "a dog"}, "missing_image", "val2017"),
])
def test_bad_entry_raises_naming_file_and_fix_or_is_skipped_and_counted(sugarcrepe, entry, reason, message):
    json_dir, image_dir = sugarcrepe
    edit_entry(json_dir, "swap_att", "7", entry)
    with pytest.raises(ValueError, match=message) as err:
        load_sugarcrepe(json_dir, image_dir)
    assert "swap_att.json" in str(err.value) and "'7'" in str(err.value) and "skip_bad" in str(err.value)
    items = load_sugarcrepe(json_dir, image_dir, skip_bad=True)
    assert len(items) == PER_TYPE * len(SUGARCREPE_TYPES)
    assert items.report["skipped"] == {"swap_att": {reason: 1}}
    assert items.report["files"]["swap_att"] == PER_TYPE + 1


def test_invalid_json_or_wrong_layout_names_the_file(sugarcrepe):
    json_dir, image_dir = sugarcrepe
    (json_dir / "replace_rel.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"replace_rel\.json is not valid JSON.*re-download"):
        load_sugarcrepe(json_dir, image_dir)
    (json_dir / "replace_rel.json").write_text("[]")
    with pytest.raises(ValueError, match=r"replace_rel\.json holds a list"):
        load_sugarcrepe(json_dir, image_dir)


def test_missing_folders_say_what_to_download(tmp_path, sugarcrepe):
    json_dir, image_dir = sugarcrepe
    for args in [(tmp_path / "nope", image_dir), (tmp_path, image_dir), (json_dir, tmp_path / "nope")]:
        with pytest.raises(FileNotFoundError) as err:
            load_sugarcrepe(*args)
        assert "RAIVNLab/sugar-crepe" in str(err.value) and "val2017" in str(err.value)


def test_unreadable_image_fails_when_scored_with_its_path(sugarcrepe):
    json_dir, image_dir = sugarcrepe
    (image_dir / coco_name(1)).write_bytes(b"not a jpeg")
    item = next(it for it in load_sugarcrepe(json_dir, image_dir) if it.image_id == coco_name(1))
    with pytest.raises(OSError, match=coco_name(1)):
        item.load_image()
