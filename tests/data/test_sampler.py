"""ResumableBatchSampler: W ranks see the single-process batches; resuming continues the same order; caption groups."""

import numpy as np
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


def _clusters(n: int = 64) -> np.ndarray:
    """Items in clusters of four: each item's nearest are its three cluster-mates, then the next cluster."""
    return np.array([[j for j in range(i // 4 * 4, i // 4 * 4 + 4) if j != i] + [(i + 4) % n] for i in range(n)])


def test_caption_groups_fill_each_rank_batch_and_resume():
    neighbours = _clusters()
    single = _epoch(ResumableBatchSampler(64, 16, seed=2, rank=0, world=1, neighbours=neighbours, group=4), 1)
    ranks = [_epoch(ResumableBatchSampler(64, 16, seed=2, rank=r, world=2, neighbours=neighbours, group=4), 1)
             for r in range(2)]
    assert sorted(k[0] for b in single for k in b) == list(range(64))  # still a permutation
    for step, batch in enumerate(single):
        assert ranks[0][step] + ranks[1][step] == batch
        for rank in ranks:  # each rank's slice holds whole clusters
            items = sorted(k[0] for k in rank[step])
            assert all(len({i // 4 for i in items[c:c + 4]}) == 1 for c in range(0, 8, 4))
    state = ResumableBatchSampler(64, 16, seed=2, neighbours=neighbours, group=4).state_dict(step=4 + 2)
    resumed = ResumableBatchSampler(64, 16, seed=2, rank=0, world=1, neighbours=neighbours, group=4)
    resumed.load_state_dict(state)
    assert list(resumed) == single[2:]
    with pytest.raises(ValueError, match="cannot resume this data order"):
        ResumableBatchSampler(64, 16, seed=2).load_state_dict(state)  # a grouped run resumed without groups
    with pytest.raises(ValueError, match="cannot resume this data order"):
        ResumableBatchSampler(64, 16, seed=2, neighbours=neighbours, group=4).load_state_dict(
            ResumableBatchSampler(64, 16, seed=2).state_dict(step=3))


def test_caption_groups_refuse_sizes_that_cut_groups():
    with pytest.raises(ValueError, match="dividing the global batch"):
        ResumableBatchSampler(64, 10, neighbours=_clusters(), group=4)
    with pytest.raises(ValueError, match="one neighbour row per item"):
        ResumableBatchSampler(64, 16, neighbours=_clusters()[:60], group=4)
    with pytest.raises(ValueError, match="do not fill a local batch of 8"):
        list(ResumableBatchSampler(64, 16, rank=0, world=2, neighbours=_clusters(), group=16))
