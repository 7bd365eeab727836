"""ResumableBatchSampler: W ranks see the single-process batches; resuming continues the same order."""

import pytest

from mmgeo.data.sampler import ResumableBatchSampler


def _epoch(s, epoch):
    s.set_epoch(epoch)
    return list(s)


def test_ranks_split_the_single_process_batches():
    single = _epoch(ResumableBatchSampler(50, 8, seed=3, rank=0, world=1), 1)
    ranks = [_epoch(ResumableBatchSampler(50, 8, seed=3, rank=r, world=4), 1) for r in range(4)]
    assert len(single) == 6  # 50 // 8, the incomplete last batch dropped
    for step, batch in enumerate(single):
        assert sum((ranks[r][step] for r in range(4)), []) == batch  # rank order = single order
        assert all(key[1:] == (1, 6 + step) for key in batch)  # (item, epoch, global step)


def test_epochs_are_permutations_and_differ():
    s = ResumableBatchSampler(40, 8, seed=0, rank=0, world=1)
    e0, e1 = ([k[0] for b in _epoch(s, e) for k in b] for e in (0, 1))
    assert sorted(e0) == sorted(e1) == list(range(40)) and e0 != e1


def test_resume_mid_epoch_continues_the_order():
    full = _epoch(ResumableBatchSampler(64, 8, seed=1, rank=1, world=2), 2)
    state = ResumableBatchSampler(64, 8, seed=1, rank=1, world=2).state_dict(step=2 * 8 + 5)
    resumed = ResumableBatchSampler(64, 8, seed=1, rank=1, world=2)
    resumed.load_state_dict(state)
    assert state["epoch"] == 2 and list(resumed) == full[5:]
    assert list(resumed) == full  # the resume offset applies once; the next pass is the whole epoch


def test_resume_refuses_another_order_and_bad_sizes():
    state = ResumableBatchSampler(64, 8, seed=1).state_dict(step=3)
    with pytest.raises(ValueError, match="cannot resume this data order"):
        ResumableBatchSampler(64, 16, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="at least one full global batch"):
        ResumableBatchSampler(4, 8)
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        list(ResumableBatchSampler(64, 8, rank=0, world=3))
