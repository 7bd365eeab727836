"""RetrievalModule: the model by name, its parameter groups, the orthogonal Q/K init, layered clipping."""

import pytest
import torch

from mmgeo.training.config import load_train_config
from mmgeo.training.module import RetrievalModule, step_seed
from tests.conftest import TINY


def _module(*overrides):
    args = [x for k, v in TINY.items() for x in (f"--model_args.{k}", str(v))]
    cfg = load_train_config("configs/synthetic.yaml", args + ["--trainer.max_steps", "20", *overrides])
    torch.manual_seed(0)
    return RetrievalModule(cfg)


@pytest.mark.parametrize("gain", [0.1, 0.05])
def test_qk_init_is_orthogonal_up_to_the_gain(gain):
    model = _module("--model_args.qk_init_gain", str(gain)).model
    assert model.cfg.qk_init_gain == gain
    for w in model.qk_maps().values():  # (H·d_a, fan_in): H·d_a <= fan_in at test size -> rows orthogonal
        side = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        torch.testing.assert_close(side, gain ** 2 * torch.eye(side.shape[0]), atol=1e-6, rtol=0)


def test_groups_are_the_models_parameter_groups():
    module = _module()
    names = {id(p): n for n, p in module.model.named_parameters()}
    assert all(names[id(p)].startswith(("query_mlp", "key_head")) for p in module.groups["qk"])
    assert {names[id(p)].split(".")[0] for p in module.groups["value"]} == {"value_proj", "text_value"}
    assert sum(len(g) for g in module.groups.values()) == len(names)
    assert module.model.cfg.extra == {"dataset": "synthetic"}


def test_layered_clipping_brings_each_group_to_its_limit():
    module = _module("--aids.clip_qk", "0.5", "--aids.clip_value", "1.0", "--aids.clip_rest", "2.0")
    module.log_dict = lambda *a, **k: None  # outside a Trainer
    for p in module.model.parameters():
        p.grad = torch.randn_like(p) * 10  # far above every limit
    module.configure_gradient_clipping(None)
    for group, limit in (("qk", 0.5), ("value", 1.0), ("rest", 2.0)):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.groups[group]]))
        assert norm <= limit * (1 + 1e-5), (group, float(norm))
        assert norm >= 0.99 * limit  # clipped to, not below, the limit


def test_value_frozen_for_the_first_fraction_of_steps():
    module = _module("--aids.freeze_value_fraction", "0.25")  # 20 steps: steps 0-4 frozen
    assert [module.value_frozen(s) for s in (0, 4, 5, 19)] == [True, True, False, False]


def test_step_seed_depends_on_seed_step_and_rank_only():
    assert step_seed(0, 3, 1) == step_seed(0, 3, 1)
    assert len({step_seed(0, 3, 1), step_seed(1, 3, 1), step_seed(0, 4, 1), step_seed(0, 3, 0)}) == 4


def test_typed_plurals_give_the_model_the_plurals_of_its_nouns():
    plain, counted = _module().model, _module("--data.typed_plurals", "0.5").model
    assert "circles" not in plain.tokenizer.get_vocab()
    assert set(counted.cfg.text_vocab) - set(plain.cfg.text_vocab) == {"circles", "squares", "triangles", "diamonds"}
    ids = counted.tokenizer("two yellow circles")["input_ids"]
    assert counted.tokenizer.unk_token_id not in ids  # read, not the unknown token
