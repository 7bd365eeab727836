import pytest
import torch

import mmgeo
from mmgeo.data import ShapesWorld
from mmgeo.models import Embedding
from mmgeo.training.losses import retrieval_loss, symmetric_infonce


@pytest.fixture(scope="module")
def batch():
    ds = ShapesWorld("test", image_size=32, size=6)
    return [ds[i][0] for i in range(6)], [ds[i][1][i % 5] for i in range(6)]


def test_registry_lists_variants_and_rejects_unknowns(tiny_overrides):
    assert {"geo-tiny", "clip-tiny", "geo-vitb16-bert", "clip-vitb16-bert"} <= set(mmgeo.list_models())
    with pytest.raises(ValueError, match="unknown model 'geo-huge'"):
        mmgeo.create_model("geo-huge")
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['d_z'\]"):
        mmgeo.create_model("geo-tiny", d_z=3)


def test_forward_shapes(tiny_model, batch):
    images, captions = batch
    cfg = tiny_model.cfg
    t, i = tiny_model.encode_text(captions), tiny_model.encode_image(images)
    T = t.mask.shape[1]
    assert t.pooled.shape == (6, cfg.d_global) and i.pooled.shape == (6, cfg.d_global)
    assert t.attn.shape == (6, cfg.num_heads, T, cfg.d_a) and t.value.shape == (6, cfg.num_heads, T, cfg.d_e)
    S = (cfg.image_size // cfg.patch_size) ** 2
    assert i.attn.shape == (6, cfg.num_heads, S, cfg.d_a) and i.mask.shape == (6, S)
    real = t.mask[:, None].expand(-1, cfg.num_heads, -1)  # (6, H, T)
    torch.testing.assert_close(t.value.norm(dim=-1), real.float())  # unit on real tokens, 0 on padding
    assert not t.attn[~real].any()  # padding queries are not computed
    assert tiny_model.score(t, i).shape == (6, 6) and tiny_model.score(t, i, "global").shape == (6, 6)


def test_padding_never_changes_a_score(tiny_model, batch):
    images, captions = batch
    img = tiny_model.encode_image(images)
    short = min(captions, key=len)
    alone = tiny_model.encode_text([short])
    padded = tiny_model.encode_text([short, "a big red circle " * 6 + "in the center"])  # forces padding
    assert padded.mask[0].sum() < padded.mask.shape[1]
    for mode in ("geometric", "global"):
        torch.testing.assert_close(tiny_model.score(padded[0:1], img, mode), tiny_model.score(alone, img, mode),
                                   atol=1e-5, rtol=1e-5)


def test_encode_image_accepts_pil_or_preprocessed_tensor(tiny_model, batch):
    images, _ = batch
    from_pil = tiny_model.encode_image(images)
    pixels = torch.stack([tiny_model.preprocess(im) for im in images])
    torch.testing.assert_close(tiny_model.encode_image(pixels).attn, from_pil.attn)
    with pytest.raises(ValueError, match=r"\(N, 3, 32, 32\)"):
        tiny_model.encode_image(torch.zeros(2, 3, 16, 16))


def test_bad_text_input(tiny_model):
    with pytest.raises(ValueError, match="empty caption"):
        tiny_model.encode_text(["a red circle", "  "])
    with pytest.raises(TypeError, match="list of strings"):
        tiny_model.encode_text("a red circle")


def test_long_caption_is_truncated_with_a_warning(tiny_model):
    with pytest.warns(UserWarning, match="truncated"):
        e = tiny_model.encode_text(["a red circle " * 40])
    assert e.mask.shape[1] == tiny_model.cfg.max_text_len


def test_clip_baseline_is_global_only(tiny_overrides, batch):
    images, captions = batch
    clip = mmgeo.create_model("clip-tiny", **tiny_overrides).eval()
    assert not clip.geometric and not hasattr(clip, "key_head")
    t, i = clip.encode_text(captions), clip.encode_image(images)
    assert t.attn is None and clip.score(t, i, "global").shape == (6, 6)
    with pytest.raises(ValueError, match="no geometric score"):
        clip.score(t, i)
    assert set(clip.logits(t, i)) == {"global"}


@pytest.mark.parametrize("opts", [dict(gated_value=True), dict(lowrank_rank=4), dict(spatial_gate=True),
                                  dict(coverage_weight=0.1)])
def test_options_build_and_train_a_step(tiny_overrides, batch, opts):
    images, captions = batch
    model = mmgeo.create_model("geo-tiny", **{**tiny_overrides, **opts})
    tok = model.tokenize(captions)
    pixels = torch.stack([model.preprocess(im) for im in images])
    loss = retrieval_loss(model.logits(*model(tok["input_ids"], tok["attention_mask"], pixels)))["loss"]
    loss.backward()
    assert torch.isfinite(loss)
    assert model.key_head.proj.weight.grad.abs().sum() > 0 and model.query_mlp.fc2.weight.grad.abs().sum() > 0


def test_coverage_adds_beta_times_coverage_and_its_salience_learns(tiny_overrides, batch):
    from mmgeo.kernels import pair_score
    from mmgeo.kernels.coverage import coverage

    images, captions = batch
    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **{**tiny_overrides, "coverage_weight": 0.25})
    t, i = model.encode_text(captions), model.encode_image(images)
    s = pair_score(t.attn, t.mask, t.value, i.attn, i.mask, i.value)
    cov = coverage(t.attn, t.mask, t.value, i.attn, i.mask, i.value, model.salience(i.attn))
    assert float((cov - cov.mean()).abs().max().detach()) > 0, "the same coverage for every pair: nothing checked"
    torch.testing.assert_close(model.score(t, i), s + 0.25 * cov)
    assert model.coverage_term == (0.25, model.salience)
    assert mmgeo.create_model("geo-tiny", **tiny_overrides).coverage_term is None
    tok = model.tokenize(captions)
    pixels = torch.stack([model.preprocess(im) for im in images])
    retrieval_loss(model.logits(*model(tok["input_ids"], tok["attention_mask"], pixels)))["loss"].backward()
    assert model.salience.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="coverage_weight needs the geometric score"):
        mmgeo.create_model("clip-tiny", **{**tiny_overrides, "coverage_weight": 0.1})


def test_loss_is_symmetric_and_prefers_the_diagonal():
    torch.manual_seed(0)
    logits = torch.randn(5, 5)
    torch.testing.assert_close(symmetric_infonce(logits), symmetric_infonce(logits.T))
    assert symmetric_infonce(10 * torch.eye(5)) < symmetric_infonce(torch.zeros(5, 5))
    torch.testing.assert_close(symmetric_infonce(torch.zeros(4, 4)), torch.log(torch.tensor(4.0)))
    with pytest.raises(ValueError, match="square"):
        symmetric_infonce(torch.zeros(3, 4))
    both = retrieval_loss({"geometric": logits, "global": logits.T}, global_weight=0.5)
    torch.testing.assert_close(both["loss"], 1.5 * symmetric_infonce(logits))


def test_embedding_cat_pads_token_dims():
    a = Embedding(torch.randn(2, 4), torch.randn(2, 1, 3, 5), torch.randn(2, 1, 3, 2), torch.ones(2, 3, dtype=bool))
    b = Embedding(torch.randn(1, 4), torch.randn(1, 1, 5, 5), torch.randn(1, 1, 5, 2), torch.ones(1, 5, dtype=bool))
    c = Embedding.cat([a, b])
    assert c.attn.shape == (3, 1, 5, 5) and c.mask.shape == (3, 5)
    assert not c.mask[:2, 3:].any() and c.mask[2].all()
    assert len(c[1:]) == 2


def test_length_groups_give_the_one_group_states_and_gradients(tiny_model):
    """A large batch runs its text encoder in groups of similar length (``token_states``): every real token's
    state and every encoder gradient equal those of one padded pass, up to float rounding."""
    from mmgeo.models import towers

    ds = ShapesWorld("test", image_size=32, size=60)
    captions = [c for i in range(60) for c in ds[i][1][:2]]  # 120 captions, lengths vary
    captions[7] = "a big red circle " * 8 + "in the center"  # one long caption: the rest is padding
    tok = tiny_model.tokenize(captions)
    ids, mask = tok["input_ids"], tok["attention_mask"].bool()
    encoder = tiny_model.text_encoder
    calls = []
    hook = encoder.register_forward_hook(lambda module, args, output: calls.append(1))
    weight = torch.randn(*ids.shape, encoder.config.hidden_size)  # a loss reading real tokens only

    def states_and_grads(fn):
        encoder.zero_grad(set_to_none=True)
        h = fn()
        (h * weight)[mask].sum().backward()
        return h[mask].detach(), {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}

    grouped, g_grouped = states_and_grads(lambda: towers.token_states(encoder, ids, tok["attention_mask"]))
    assert len(calls) == min(towers.MAX_LENGTH_GROUPS, len(captions) // towers.LENGTH_GROUP) == 2
    one, g_one = states_and_grads(lambda: encoder(**tok).last_hidden_state)
    hook.remove()
    torch.testing.assert_close(grouped, one, atol=1e-5, rtol=1e-4)
    assert g_grouped.keys() == g_one.keys() and len(g_one) > 10
    for name in g_one:
        torch.testing.assert_close(g_grouped[name], g_one[name], atol=1e-4, rtol=1e-3, msg=name)


def test_mean_global_pool_averages_real_tokens_and_patches():
    """global_pool="mean": the global vector of a caption is the same alone or padded in a batch with a longer one,
    and the image's is the projected mean of its patch tokens."""
    from mmgeo.models.towers import patch_tokens
    from tests.conftest import TINY

    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **TINY, global_pool="mean").eval()
    short, long = "a red circle in the center", "a big red circle in the center and a small blue square at the top"
    with torch.no_grad():
        alone, batched = model.encode_text([short]), model.encode_text([short, long])
        torch.testing.assert_close(alone.pooled[0], batched.pooled[0], atol=1e-5, rtol=1e-5)
        pixels = torch.randn(2, 3, TINY["image_size"], TINY["image_size"])
        tokens, _ = patch_tokens(model.image_encoder, pixels)
        expect = torch.nn.functional.normalize(model.image_global(tokens.mean(1)), dim=-1)
        torch.testing.assert_close(model.forward_image(pixels).pooled, expect)
        cls = mmgeo.create_model("geo-tiny", **TINY).eval()
        cls.load_state_dict(model.state_dict())  # same weights, [CLS] pooling: another vector
        assert not torch.allclose(cls.encode_text([short]).pooled, alone.pooled)
    with pytest.raises(ValueError, match="global_pool"):
        mmgeo.create_model("geo-tiny", **TINY, global_pool="max")


def test_values_global_pool_starts_as_the_uniform_attention_score():
    """global_pool="values": at init the global score is the cosine of the mean text value and the mean patch value
    (one orthogonal map for both), i.e. the geometric score's values under uniform attention, normalised."""
    from tests.conftest import TINY

    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **TINY, global_pool="values").eval()
    texts = ["a big red circle in the center", "a small blue square at the top and a red circle on the left"]
    with torch.no_grad():
        t = model.encode_text(texts)
        i = model.forward_image(torch.randn(3, 3, TINY["image_size"], TINY["image_size"]))
        u_bar = torch.stack([t.value[b][:, t.mask[b]].mean(1).flatten() for b in range(2)])  # (2, H·d_e)
        v_bar = i.value.mean(2).flatten(1)  # (3, H·d_e)
        expect = torch.nn.functional.normalize(u_bar, dim=-1) @ torch.nn.functional.normalize(v_bar, dim=-1).T
        torch.testing.assert_close(model.score(t, i, "global"), expect, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="global-only"):
        mmgeo.create_model("clip-tiny", **TINY, global_pool="values")
