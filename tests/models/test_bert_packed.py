import pytest
import torch

from mmgeo.data.shapes import ShapesWorld
from mmgeo.models import bert_packed, towers


def captions_of_many_lengths():
    ds = ShapesWorld("test", image_size=32, size=12)
    caps = [c for i in range(12) for c in ds[i][1][:1]]
    return caps + ["a big red circle " * 6 + "in the center", "circle"]  # one long, one of a single word


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_states_equal_the_models_own_on_real_tokens(tiny_model, dtype):
    encoder = tiny_model.text_encoder.to(dtype)
    tok = tiny_model.tokenize(captions_of_many_lengths())
    mask = tok["attention_mask"].bool()
    assert (~mask).sum() > mask.numel() // 4  # the batch really is padded
    with torch.no_grad():
        own = encoder(**tok).last_hidden_state  # (B, T, C)
        packed = bert_packed.packed_bert_states(encoder, tok["input_ids"], tok["attention_mask"])
    assert packed.dtype == dtype and packed.shape == own.shape
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-9}
    torch.testing.assert_close(packed[mask], own[mask], **tol)
    assert not packed[~mask].any()


def test_token_states_packs_only_without_gradients(tiny_model):
    encoder = tiny_model.text_encoder
    tok = tiny_model.tokenize(captions_of_many_lengths())
    calls = []
    hook = encoder.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        with torch.no_grad():
            states = towers.token_states(encoder, tok["input_ids"], tok["attention_mask"])
        assert calls == []  # the packed path, not the model's forward
        with_grad = towers.token_states(encoder, tok["input_ids"], tok["attention_mask"])
        assert calls == [1] and with_grad.requires_grad
    finally:
        hook.remove()
    mask = tok["attention_mask"].bool()
    torch.testing.assert_close(states[mask], with_grad.detach()[mask], atol=1e-5, rtol=1e-4)


def test_encode_text_equals_the_forward_with_gradients(tiny_model):
    """The search service's encoder (inference mode: packed) gives the training forward's queries and values."""
    caps = captions_of_many_lengths()
    fast = tiny_model.encode_text(caps)
    tok = tiny_model.tokenize(caps)
    slow = tiny_model.forward_text(**tok)
    for name in ("pooled", "attn", "value"):
        torch.testing.assert_close(getattr(fast, name), getattr(slow, name).detach(), atol=1e-5, rtol=1e-4, msg=name)


def test_supports_only_what_it_computes(tiny_model):
    encoder = tiny_model.text_encoder
    assert bert_packed.supports(encoder)
    encoder.train()
    assert not bert_packed.supports(encoder)  # dropout: the model's own forward
    encoder.eval()
    encoder.config.hidden_act = "gelu_new"  # the tanh approximation: not ours
    assert not bert_packed.supports(encoder)
    encoder.config.hidden_act = "gelu"
    encoder.config.is_decoder = True
    assert not bert_packed.supports(encoder)
    encoder.config.is_decoder = False
    assert not bert_packed.supports(tiny_model.query_mlp)
