"""Cross-rank contrastive loss: 2-process DDP on CPU (gloo) equals one process on the concatenated batch.

Loss and gradients to 1e-5, global and geometric score, with and without local loss, with and without
true-caption pairs left out of the negatives.
One spawn runs every case (process start-up dominates); dropout is off (eval mode) since each rank would
draw its own masks. A control case without the cross-rank gather must *differ*, so the comparison can fail.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import TINY

WORLD, PER_RANK = 2, 4
CASES = [("geo", False), ("geo", True), ("clip", False), ("clip", True)]
MASKED = [("geo", False), ("geo", True)]  # with true-caption pairs left out of the negatives
RUNS = [(*c, False) for c in CASES] + [(*c, True) for c in MASKED]  # (model, local loss, masked)


def _positives(rank: int) -> torch.Tensor:
    """(PER_RANK, PER_RANK): rank 0's caption 0 is true of its image 1, rank 1's caption 2 of its image 0."""
    out = torch.zeros(PER_RANK, PER_RANK, dtype=torch.bool)
    out[(0, 1) if rank == 0 else (2, 0)] = True
    return out


def _batch():
    """8 (pixels, caption) pairs; rank 0's captions are shorter than rank 1's, so ranks pad differently."""
    from mmgeo.data import ShapesWorld

    ds = ShapesWorld("train", seed=3, image_size=TINY["image_size"])
    pairs = [(ds[i][0], c) for i in range(24) for c in ds[i][1]]
    pairs.sort(key=lambda p: len(p[1]))
    pick = pairs[:PER_RANK] + pairs[-PER_RANK:]
    return [p[0] for p in pick], [p[1] for p in pick]


def _loss_and_grads(model, texts, pixels, loss_fn):
    model.zero_grad(set_to_none=True)
    tok = model.tokenize(texts)
    text, image = model(tok["input_ids"], tok["attention_mask"], pixels)
    losses = loss_fn(text, image)
    losses["loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads


class _Step(torch.nn.Module):
    """What Lightning wraps in DDP: a module whose forward is the whole training step."""

    def __init__(self, model, local_loss, gather=True, positives=None):
        super().__init__()
        self.model, self.local_loss, self.gather, self.positives = model, local_loss, gather, positives

    def forward(self, input_ids, attention_mask, pixels):
        from mmgeo.training.losses import contrastive_loss, retrieval_loss

        text, image = self.model(input_ids, attention_mask, pixels)
        if not self.gather:  # the naive DDP loss: each rank's own slice only
            return retrieval_loss(self.model.logits(text, image))
        return contrastive_loss(self.model, text, image, local_loss=self.local_loss, positives=self.positives)


def _worker(rank: int, tmp: str):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mmgeo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    images, texts = _batch()
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = {}
    for name, local, masked in RUNS + [("control", False, False)]:
        gather = name != "control"  # control: the naive loss without the cross-rank gather
        model = mmgeo.load_model(f"{tmp}/{'geo' if name == 'control' else name}.pt")  # eval mode: no dropout
        step = DDP(_Step(model, local, gather, _positives(rank) if masked else None))
        step.zero_grad(set_to_none=True)
        tok = model.tokenize(texts[sl])
        pixels = torch.stack([model.preprocess(im) for im in images[sl]])
        losses = step(tok["input_ids"], tok["attention_mask"], pixels)
        losses["loss"].backward()  # DDP averages parameter gradients over ranks
        for v in losses.values():  # the logged loss: mean over ranks (equal anyway without local loss)
            dist.all_reduce(v.detach_(), op=dist.ReduceOp.AVG)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[(name, local, masked)] = ({k: v for k, v in losses.items()}, grads, tok["input_ids"].shape[1])
    if rank == 0:
        torch.save(out, f"{tmp}/rank0.pt")
    else:
        torch.save({"lengths": {c: out[(*c, False)][2] for c in CASES}}, f"{tmp}/rank1.pt")
    dist.barrier()  # neither rank tears gloo down while the other still writes
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    import mmgeo

    tmp = tmp_path_factory.mktemp("ddp")
    for name, variant in (("geo", "geo-tiny"), ("clip", "clip-tiny")):
        torch.manual_seed(0)
        mmgeo.save_model(mmgeo.create_model(variant, **TINY), tmp / f"{name}.pt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(str(tmp),), nprocs=WORLD, join=True)
    return tmp, torch.load(tmp / "rank0.pt", weights_only=False), torch.load(tmp / "rank1.pt", weights_only=False)


def _single(tmp, name, masked=False):
    import mmgeo
    from mmgeo.training.losses import retrieval_loss

    model = mmgeo.load_model(tmp / f"{name}.pt")
    images, texts = _batch()
    pixels = torch.stack([model.preprocess(im) for im in images])
    positives = torch.block_diag(*(_positives(r) for r in range(WORLD))) if masked else None  # (W·B, W·B)
    return _loss_and_grads(model, texts, pixels, lambda t, i: retrieval_loss(model.logits(t, i), positives=positives))


@pytest.mark.parametrize("name,local,masked", RUNS,
                         ids=[f"{n}-{'local' if lo else 'full'}{'-masked' if m else ''}" for n, lo, m in RUNS])
def test_two_process_ddp_equals_single_process(ddp_results, name, local, masked):
    tmp, rank0, rank1 = ddp_results
    losses, grads, len0 = rank0[(name, local, masked)]
    assert len0 != rank1["lengths"][(name, local)], "ranks should tokenize to different lengths (padding path)"
    ref_losses, ref_grads = _single(tmp, name, masked)
    if masked:  # the mask changes the loss, so the comparison can fail
        assert not torch.allclose(ref_losses["loss"], _single(tmp, name)[0]["loss"], rtol=1e-4, atol=1e-4)
    expect_terms = {"loss", "loss_global"} | ({"loss_geometric"} if name == "geo" else set())
    assert set(losses) == set(ref_losses) == expect_terms
    for k in ref_losses:
        torch.testing.assert_close(losses[k], ref_losses[k], rtol=1e-5, atol=1e-5, msg=f"{k} differs")
    assert set(grads) == set(ref_grads) and len(grads) > 10
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=f"grad of {n} differs")
    if name == "geo":  # the geometric heads really received gradient through the gathered tensors
        assert ref_grads["query_mlp.fc2.weight"].abs().max() > 1e-4
        assert ref_grads["key_head.proj.weight"].abs().max() > 1e-4


def test_without_gather_gradients_differ(ddp_results):
    """The control: per-rank loss on the local slice only is not the global-batch loss."""
    tmp, rank0, _ = ddp_results
    losses, grads, _ = rank0[("control", False, False)]
    ref_losses, ref_grads = _single(tmp, "geo")
    assert not torch.allclose(losses["loss"], ref_losses["loss"], rtol=1e-3, atol=1e-3)
    assert any(not torch.allclose(grads[n], ref_grads[n], rtol=1e-3, atol=1e-4) for n in ref_grads)


def test_single_process_contrastive_loss_is_retrieval_loss(tiny_model):
    from mmgeo.training.losses import contrastive_loss, retrieval_loss

    images, texts = _batch()
    tok = tiny_model.tokenize(texts)
    pixels = torch.stack([tiny_model.preprocess(im) for im in images])
    text, image = tiny_model(tok["input_ids"], tok["attention_mask"], pixels)
    a = contrastive_loss(tiny_model, text, image, local_loss=True)
    b = retrieval_loss(tiny_model.logits(text, image))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
