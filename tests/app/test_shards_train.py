"""train.py, eval.py and serve build from WebDataset shards written by the test (tests/data/shard_fixtures.py).

SIGKILL mid-epoch + --resume: no sample twice within an epoch, the resumed epoch continues at unopened shards, the
epochs after it are the uninterrupted run's; 2-process DDP (gloo) reads every sample of each epoch exactly once;
eval.py --data webdataset and serve build --shards read the same samples in the same order.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

import mmgeo
import mmgeo.training as training
from mmgeo.data.sampler import read_samples
from mmgeo.data.shards import SHARD_STRIDE
from tests.app.test_resume import _args, _finish, _run, _samples_reached
from tests.conftest import TINY
from tests.data.shard_fixtures import CORRUPT, NO_CAPTION, write_fixture_shards

SHARDS, PER_SHARD, BATCH = 6, 16, 8  # 96 samples


def _shard_args(out, name, pattern, samples_per_epoch, steps, *extra):
    return _args(out, name, "--data.name", "webdataset", "--data.shards", pattern, "--data.samples_per_epoch",
                 str(samples_per_epoch), "--data.shuffle_buffer", "8", "--trainer.max_steps", str(steps),
                 "--trainer.batch_size", str(BATCH), *extra)


def _epochs(samples: dict, steps_per_epoch: int) -> dict[int, list[int]]:
    out = {}
    for step, (epoch, items) in sorted(samples.items()):
        assert epoch == step // steps_per_epoch
        out.setdefault(epoch, []).extend(items)
    return out


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    return write_fixture_shards(tmp_path_factory.mktemp("shards"), SHARDS, PER_SHARD)[0]


@pytest.mark.slow
def test_sigkill_and_resume_continue_at_unopened_shards(pattern, tmp_path):
    steps, spe, every = 24, 10, 3  # 80 of the 96 samples per epoch: epochs 0, 1 and part of 2
    args = lambda name, *x: _shard_args(tmp_path, name, pattern, spe * BATCH, steps,  # noqa: E731
                                        "--trainer.checkpoint_every_n_steps", str(every), *x)
    victim = _run(args("killed"))  # a real process, killed for real; the other runs in this one (cheaper)
    samples = tmp_path / "killed" / "samples.tsv"
    deadline = time.time() + 240
    while not _samples_reached(samples, every + 1) and victim.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert victim.poll() is None, "training finished before it could be killed: " + victim.communicate()[0][-2000:]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    frm = int(training.latest_checkpoint(tmp_path / "killed").stem.split("=")[1])
    training.train(args("killed", "--resume"))
    training.train(args("straight"))
    assert 0 < frm < spe  # mid-epoch 0

    a, b = read_samples(tmp_path / "straight" / "samples.tsv"), read_samples(samples)
    assert sorted(b) == list(range(steps))
    ea, eb = _epochs(a, spe), _epochs(b, spe)
    for items in eb.values():
        assert len(items) == len(set(items)), "a sample read twice within an epoch"
    assert {s: a[s] for s in range(frm)} == {s: b[s] for s in range(frm)}  # before the checkpoint: the same
    before = {i // SHARD_STRIDE for s in range(frm) for i in b[s][1]}
    after = {i // SHARD_STRIDE for s in range(frm, spe) for i in b[s][1]}
    assert before and after and not before & after, "the resumed epoch re-read a shard opened before the kill"
    assert ea[1] == eb[1] and ea[2] == eb[2]  # the epochs after the resumed one are the uninterrupted run's


@pytest.mark.slow
def test_two_process_ddp_reads_every_sample_of_an_epoch_exactly_once(pattern, tmp_path):
    spe = SHARDS * PER_SHARD // BATCH  # the whole data each epoch: each rank's 3 shards give its 12 local batches
    log = _finish(_run(_shard_args(tmp_path, "ddp", pattern, SHARDS * PER_SHARD, 2 * spe, "--trainer.strategy", "ddp",
                                   "--trainer.devices", "2", "--trainer.accelerator", "cpu",
                                   "--trainer.checkpoint_every_n_steps", "0", "--data.num_workers", "2")))
    assert f"trained {2 * spe} steps" in log
    every_sample = sorted(s * SHARD_STRIDE + p for s in range(SHARDS) for p in range(PER_SHARD))
    epochs = _epochs(read_samples(tmp_path / "ddp" / "samples.tsv"), spe)
    assert sorted(epochs) == [0, 1]
    for items in epochs.values():  # global batches: rank 0's half, then rank 1's
        assert sorted(items) == every_sample
    assert epochs[0] != epochs[1]  # reshuffled


def test_a_pattern_that_lists_nothing_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ValueError, match=r"no shard of .*nope.*exists"):
        training.train(_shard_args(tmp_path, "none", f"{tmp_path}/nope/{{00000..00003}}.tar", 16, 2))


def test_eval_and_serve_build_read_the_same_shards(tmp_path):
    """eval.py counts and skips what serve build skips; eval over the built index (whose image i must be sample i)
    agrees with the exact evaluation on the gallery size."""
    import eval as eval_script
    from serve.cli import main as serve

    pattern, good = write_fixture_shards(tmp_path / "val", 3, 4, bad={1: CORRUPT, 6: NO_CAPTION})
    torch.manual_seed(0)
    ckpt = tmp_path / "model.pt"
    mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY).eval(), ckpt)
    exact = eval_script.main(["--ckpt", str(ckpt), "--data", "webdataset", "--shards", pattern, "--device", "cpu",
                              "--out", str(tmp_path / "exact.json")])
    assert exact["counts"]["images"] == len(good) and exact["counts"]["captions"] == 2 * len(good)
    assert exact["counts"]["skipped"] == {"unreadable_image": 1, "no_caption": 1}
    assert serve(["build", "--ckpt", str(ckpt), "--shards", pattern, "--out", str(tmp_path / "index"),
                  "--no-progress"]) == 0
    assert json.loads((tmp_path / "index" / "manifest.json").read_text())["count"] == len(good)
    served = eval_script.main(["--ckpt", str(ckpt), "--index", str(tmp_path / "index"), "--data", "webdataset",
                               "--shards", pattern, "--device", "cpu"])
    assert served["counts"]["images"] == len(good) and served["mode"] == "two-stage"
    with pytest.raises(SystemExit) as err:
        eval_script.main(["--ckpt", str(ckpt), "--data", "webdataset"])
    assert err.value.code == 2
