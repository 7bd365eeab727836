"""MuonAdamW: AdamW groups as torch's AdamW, Muon groups as torch's Muon (AdamW-matched RMS), who takes Muon."""

import copy

import pytest
import torch

from mmgeo.training.muon import MuonAdamW, muon_parameters, orthogonalize
from tests.training.test_module import _module


def _steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16)])
def test_orthogonalize_brings_every_singular_value_near_one(shape):
    torch.manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k))
    g = u @ torch.diag(torch.logspace(-1.5, 1, k)) @ v.T  # singular values 0.03-10: 2.5 decades
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.6 and s.max() < 1.2, s
    u, _, vh = torch.linalg.svd(g, full_matrices=False)  # the same singular vectors as U·Vᵀ
    assert torch.nn.functional.cosine_similarity(orthogonalize(g).flatten(), (u @ vh).flatten(), dim=0) > 0.9


def test_adamw_groups_step_as_torch_adamw():
    torch.manual_seed(0)
    a = [torch.randn(5, 3), torch.randn(7)]
    b = [x.clone() for x in a]
    grads = [[torch.randn_like(x) for x in a] for _ in range(4)]
    ours = MuonAdamW([{"params": a, "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.98))
    ref = torch.optim.AdamW([{"params": b, "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.98))
    _steps(ours, a, grads)
    _steps(ref, b, grads)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)  # two implementations: rounding may differ


def test_muon_groups_step_as_torch_muon_with_adamw_matched_rms():
    torch.manual_seed(0)
    a = [torch.randn(32, 12), torch.randn(12, 32)]
    b, start = [x.clone() for x in a], [x.clone() for x in a]
    grads = [[torch.randn_like(x) for x in a] for _ in range(3)]
    ours = MuonAdamW([{"params": a, "weight_decay": 0.1, "muon": True}], lr=0.02, momentum=0.95)
    ref = torch.optim.Muon(b, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    _steps(ours, a, grads)
    _steps(ref, b, grads)
    tol = 0.05 * 0.02 * 0.2 * 32 ** 0.5  # 5 % of one step's largest entry scale: torch's iteration runs in bf16
    for x, y, x0 in zip(a, b, start):
        torch.testing.assert_close(x, y, rtol=0, atol=tol)
        assert (y - x0).abs().max() > 10 * tol  # three steps moved the weights far more than the tolerance


@pytest.mark.parametrize("shape", [(8, 4, 3, 3), (40, 2, 3, 3)])  # wide and tall as (out, in·kh·kw)
def test_a_parameter_without_gradient_is_left_alone_and_conv_weights_keep_their_shape(shape):
    torch.manual_seed(0)
    conv, frozen = torch.randn(shape), torch.randn(6, 6)
    before = frozen.clone()
    opt = MuonAdamW([{"params": [conv, frozen], "weight_decay": 0.1, "muon": True}], lr=0.01)
    conv.grad = torch.randn_like(conv)
    old = conv.clone()
    opt.step()
    assert torch.equal(frozen, before) and frozen not in opt.state
    out, fan_in = shape[0], shape[1] * shape[2] * shape[3]
    step = (conv - old * (1 - 0.01 * 0.1)).reshape(out, -1) / (0.01 * 0.2 * max(out, fan_in) ** 0.5)  # orthogonalised
    s = torch.linalg.svdvals(step)
    assert s.min() > 0.5 and s.max() < 1.3


def test_a_vector_in_a_muon_group_is_refused():
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        MuonAdamW([{"params": [torch.randn(3)], "muon": True}], lr=0.01)


def test_the_module_gives_linear_and_conv_weights_to_muon_and_the_rest_to_adamw():
    module = _module("--optim.name", "muon")
    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in module.model.named_parameters()}
    muon = [names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]]
    rest = [names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]]
    assert set(muon) == {names[i] for i in muon_parameters(module.model)}
    assert "query_mlp.fc1.weight" in muon and any(n.startswith("key_head.conv") for n in muon)
    assert not any("embeddings" in n or n.endswith(("bias", "pos_embed", "cls_token")) for n in muon)
    assert len(muon) + len(rest) == len(names)
    assert isinstance(_module().configure_optimizers()["optimizer"], torch.optim.AdamW)  # the default


def test_an_unknown_optimizer_name_is_refused():
    with pytest.raises(ValueError, match="optim.name='sgd': use adamw or muon"):
        _module("--optim.name", "sgd")


def test_a_state_dict_round_trip_continues_the_same_steps():
    """What a checkpoint and --resume do: the state saved after two steps, loaded into a fresh optimizer over a copy
    of the parameters, gives the next step bit for bit (both kinds of group, step counts included)."""
    torch.manual_seed(0)
    mat, vec = torch.randn(12, 8), torch.randn(8)

    def make(m, v):
        return MuonAdamW([{"params": [m], "weight_decay": 0.1, "muon": True}, {"params": [v]}], lr=0.01)

    opt = make(mat, vec)
    grads = [[torch.randn(12, 8), torch.randn(8)] for _ in range(3)]
    _steps(opt, [mat, vec], grads[:2])
    saved = copy.deepcopy(opt.state_dict())  # as written to a checkpoint: not the live buffers
    mat2, vec2 = mat.clone(), vec.clone()
    resumed = make(mat2, vec2)
    resumed.load_state_dict(saved)
    _steps(opt, [mat, vec], grads[2:])
    _steps(resumed, [mat2, vec2], grads[2:])
    assert torch.equal(mat, mat2) and torch.equal(vec, vec2)
    assert resumed.state[vec2]["step"] == 3
