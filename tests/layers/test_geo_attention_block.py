"""GeometricAttentionBlock vs nn.MultiheadAttention (float64, exact), conversion of real models, errors, options."""

import math

import pytest
import torch
from torch import nn

from mmgeo.layers import GeometricAttentionBlock, convert_attention

F64 = torch.float64
E, H, B, L = 8, 2, 3, 5


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0, equal_nan=True)


def make_mha(seed=0, **kw):
    """An MHA in float64 with non-zero biases (its init zeroes them), so the copy of every weight is tested."""
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, dtype=F64, **kw)
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_()
    return mha


# MHA configs: constructor kwargs and whether inputs are self-attention (query is key is value, S = L)
CONFIGS = {
    "self": (dict(), True),
    "self_batch_first": (dict(batch_first=True), True),
    "cross": (dict(batch_first=True), False),
    "kdim_vdim": (dict(kdim=6, vdim=10), False),
    "no_bias": (dict(bias=False, batch_first=True), True),
    "bias_kv_zero_attn": (dict(add_bias_kv=True, add_zero_attn=True), False),
}
# forward calls: extra kwargs, mask kinds ("bool"/"float"/"causal"/"random_bool" for attn_mask; "bool"/"float" kpm)
CALLS = {
    "plain": dict(),
    "no_weights": dict(need_weights=False),
    "per_head_weights": dict(average_attn_weights=False),
    "kpm_bool": dict(kpm="bool"),
    "kpm_float_no_weights": dict(kpm="float", need_weights=False),
    "attn2d_bool": dict(attn="bool2d"),
    "attn2d_float": dict(attn="float2d", average_attn_weights=False),
    "attn3d_bool": dict(attn="bool3d", need_weights=False),
    "attn3d_float": dict(attn="float3d"),
    "both_bool": dict(attn="bool2d", kpm="bool", need_weights=False),
    "both_float": dict(attn="float3d", kpm="float"),
    "causal_hint": dict(attn="causal", is_causal=True, need_weights=False),
    "causal_hint_weights": dict(attn="causal", is_causal=True),
    "causal_hint_kpm": dict(attn="causal", kpm="bool", is_causal=True, need_weights=False),
}


def make_call(mha, self_attn, batched, attn=None, kpm=None, gen=None, **kw):
    S = L if self_attn else 6
    b = B if batched else 1

    def shape(n, d):
        return ((B, n, d) if mha.batch_first else (n, B, d)) if batched else (n, d)

    q = torch.randn(shape(L, E), dtype=F64, generator=gen)
    k = q if self_attn else torch.randn(shape(S, mha.kdim), dtype=F64, generator=gen)
    v = q if self_attn else torch.randn(shape(S, mha.vdim), dtype=F64, generator=gen)
    if attn is not None:
        lead = () if attn.endswith("2d") or attn == "causal" else (b * H,)
        banned = torch.rand(*lead, L, S, generator=gen) < 0.3
        banned[..., 0] = False  # every query keeps a key
        if attn == "causal":
            banned = torch.ones(L, S).triu(1).bool()
        kw["attn_mask"] = banned if "float" not in attn else \
            torch.randn(banned.shape, dtype=F64, generator=gen).masked_fill(banned, -math.inf)
    if kpm is not None:
        pad = torch.rand(b, S, generator=gen) < 0.3
        pad[:, 0] = False
        pad = pad if batched else pad[0]
        kw["key_padding_mask"] = pad if kpm == "bool" else \
            torch.randn(pad.shape, dtype=F64, generator=gen).masked_fill(pad, -math.inf)
    return (q, k, v), kw


def check_same(mha, block, args, kw):
    """Compare in train mode with grad (MHA's general path) and in eval under no_grad (its fast path)."""
    for train in (True, False):
        mha.train(train), block.train(train)
        with torch.set_grad_enabled(train):
            (out_m, w_m), (out_b, w_b) = mha(*args, **kw), block(*args, **kw)
        close(out_b, out_m)
        assert (w_m is None) == (w_b is None)
        if w_m is not None:
            close(w_b, w_m)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("config", CONFIGS)
def test_from_mha_reproduces_mha(config, call, batched):
    kwargs, self_attn = CONFIGS[config]
    mha = make_mha(**kwargs)
    block = GeometricAttentionBlock.from_mha(mha)
    assert block.is_standard and block.batch_first == mha.batch_first
    gen = torch.Generator().manual_seed(1)
    args, kw = make_call(mha, self_attn, batched, gen=gen, **CALLS[call])
    check_same(mha, block, args, kw)


def test_wrong_causal_hint_follows_mha_general_path():
    """is_causal with a non-causal mask is undefined in MHA: its general path drops the mask (SDPA is_causal), its
    eval fast path uses the mask. The block follows the general path."""
    mha = make_mha(batch_first=True).train()
    args, kw = make_call(mha, True, True, attn="bool2d", is_causal=True, need_weights=False,
                         gen=torch.Generator().manual_seed(3))
    close(GeometricAttentionBlock.from_mha(mha)(*args, **kw)[0], mha(*args, **kw)[0])


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")  # MHA warns on float + bool masks
def test_built_directly_with_copied_weights():
    mha = make_mha(kdim=6, vdim=10, batch_first=True)
    block = GeometricAttentionBlock(E, H, kdim=6, vdim=10, batch_first=True, dtype=F64)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    with torch.no_grad():
        for lin, w, b in ((block.q_proj, mha.q_proj_weight, bq), (block.k_proj, mha.k_proj_weight, bk),
                          (block.v_proj, mha.v_proj_weight, bv), (block.out_proj, mha.out_proj.weight,
                                                                   mha.out_proj.bias)):
            lin.weight.copy_(w), lin.bias.copy_(b)
    args, kw = make_call(mha, False, True, attn="float3d", kpm="bool", gen=torch.Generator().manual_seed(2))
    check_same(mha, block, args, kw)


def test_fully_masked_rows_like_mha():
    """MHA (general path): NaN rows when weights are returned, zero attention (SDPA safe softmax) otherwise."""
    mha = make_mha(batch_first=True).train()
    block = GeometricAttentionBlock.from_mha(mha)
    x = torch.randn(B, L, E, dtype=F64)
    mask = torch.zeros(L, L, dtype=torch.bool)
    mask[1] = True
    for need_weights in (True, False):
        out_m, _ = mha(x, x, x, attn_mask=mask, need_weights=need_weights)
        out_b, _ = block(x, x, x, attn_mask=mask, need_weights=need_weights)
        close(out_b, out_m)
        assert out_b[:, 1].isnan().all() == need_weights


def test_dropout_on_attention_weights():
    torch.manual_seed(0)
    block = GeometricAttentionBlock(E, H, dropout=0.5, batch_first=True, dtype=F64)
    x = torch.randn(B, L, E, dtype=F64)
    w_eval = block.eval()(x, x, x, average_attn_weights=False)[1]
    w_train = block.train()(x, x, x, average_attn_weights=False)[1]
    dropped = w_train == 0
    assert 0 < dropped.double().mean() < 1
    close(w_train[~dropped], 2 * w_eval[~dropped])  # kept weights scaled by 1 / (1 - p)


def _tiny_text_transformer(**kw):
    from open_clip.transformer import TextTransformer

    torch.manual_seed(0)
    return TextTransformer(context_length=16, vocab_size=100, width=32, heads=4, layers=2, output_dim=16, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(embed_cls=True, pad_id=0)], ids=["causal", "cls_pad_3d_mask"])
def test_convert_open_clip_text_transformer(kw):
    model = _tiny_text_transformer(**kw).double().eval()
    text = torch.randint(1, 100, (3, 16))
    text[1, 10:] = 0  # padding (masked per key by the 3-D mask when embed_cls)
    with torch.no_grad():
        before = model(text)
    assert convert_attention(model) is model
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    assert sum(isinstance(m, GeometricAttentionBlock) for m in model.modules()) == 2
    with torch.no_grad():
        after = model(text)
    close(after, before)
    model.train()
    model(text).sum().backward()  # trains after conversion


def test_convert_open_clip_attentional_pooler_and_torch_encoder_layer():
    from open_clip.transformer import AttentionalPooler

    torch.manual_seed(0)
    pooler = AttentionalPooler(d_model=32, context_dim=24, n_head=4, n_queries=5).double().eval()
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dtype=F64).eval()
    x, y = torch.randn(2, 7, 24, dtype=F64), torch.randn(2, 6, 16, dtype=F64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    with torch.no_grad():
        before = pooler(x), layer(y, src_key_padding_mask=pad)
        convert_attention(pooler), convert_attention(layer)
        after = pooler(x), layer(y, src_key_padding_mask=pad)
    assert isinstance(pooler.attn, GeometricAttentionBlock) and isinstance(layer.self_attn, GeometricAttentionBlock)
    close(after[0], before[0])
    close(after[1][~pad], before[1][~pad])  # torch's fast path leaves padded positions unspecified


def test_convert_keeps_shared_modules_shared():
    mha = make_mha()
    model = nn.ModuleDict({"a": nn.ModuleList([mha]), "b": nn.ModuleList([mha])})
    convert_attention(model, use_gated_projection=True)
    assert model["a"][0] is model["b"][0] and model["a"][0].v_gate is not None
    assert isinstance(convert_attention(mha), GeometricAttentionBlock)


# --- errors name the shapes ---------------------------------------------------------------------------------------


def test_embed_dim_not_divisible():
    match = r"embed_dim=30 is not divisible by num_heads=4.*\[1, 2, 3, 5, 6, 10, 15, 30\]"
    with pytest.raises(ValueError, match=match):
        GeometricAttentionBlock(30, 4)


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda x: dict(attn_mask=torch.zeros(5, 7, dtype=torch.bool)), ValueError,
         r"attn_mask of shape \(5, 7\) does not broadcast to \(B, H, L, S\) = \(3, 2, 5, 5\).*\(6, 5, 5\)"),
        (lambda x: dict(attn_mask=torch.zeros(3, 5, 5)), ValueError, r"attn_mask of shape \(3, 5, 5\)"),
        (lambda x: dict(key_padding_mask=torch.zeros(3, 6, dtype=torch.bool)), ValueError,
         r"key_padding_mask of shape \(3, 6\) does not match \(B, S\) = \(3, 5\)"),
        (lambda x: dict(key=x[:, :4]), ValueError, r"key \(3, 4, 8\), value \(3, 5, 8\)"),
        (lambda x: dict(query=torch.zeros(3, 5, 10, dtype=F64)), ValueError,
         r"query has feature dim 10 \(shape \(3, 5, 10\)\) but the block has embed_dim=8"),
        (lambda x: dict(value=x[0]), ValueError, r"all 3-D .* value \(5, 8\)"),
        (lambda x: dict(key=x[:2], value=x[:2]), ValueError, r"batch sizes differ.*key \(2, 5, 8\)"),
        (lambda x: dict(attn_mask=torch.zeros(5, 5, dtype=torch.int64)), TypeError,
         r"attn_mask must be bool .* got dtype torch.int64 \(shape \(5, 5\)\)"),
        (lambda x: dict(key_padding_mask=torch.zeros(3, 5, dtype=torch.int32)), TypeError, r"torch.int32"),
        (lambda x: dict(is_causal=True), RuntimeError, r"Need attn_mask if specifying the is_causal hint"),
    ],
    ids=["attn2d", "attn3d", "kpm", "kv_len", "query_dim", "mixed_dims", "batch", "attn_dtype", "kpm_dtype", "causal"],
)
def test_errors_name_the_shapes(make, err, match):
    block = GeometricAttentionBlock(E, H, batch_first=True, dtype=F64)
    x = torch.randn(B, L, E, dtype=F64)
    kw = dict(query=x, key=x, value=x) | make(x)
    with pytest.raises(err, match=match):
        block(**kw)


# --- the framework's options -----------------------------------------------------------------------------------------


def test_options_match_a_manual_reference_and_train():
    torch.manual_seed(0)
    d_a, S = 3, 6
    block = GeometricAttentionBlock(E, H, kdim=6, batch_first=True, dtype=F64, d_a=d_a,
                                    use_lowrank_mapping=True, lowrank_rank=2, use_gated_projection=True)
    assert block.q_proj.weight.shape == (H * d_a, E) and block.k_proj.weight.shape == (H * d_a, 6)
    x, y, z = torch.randn(B, L, E, dtype=F64), torch.randn(B, S, 6, dtype=F64), torch.randn(B, S, E, dtype=F64)
    out, w = block(x, y, z, average_attn_weights=False)
    assert out.shape == (B, L, E) and w.shape == (B, H, L, S)

    uv = block.lowrank.U @ block.lowrank.V  # (d_a, d_a), shared by the heads
    q = (block.q_proj(x).view(B, L, H, d_a).transpose(1, 2)) @ uv  # (B, H, L, d_a)
    k = (block.k_proj(y).view(B, S, H, d_a).transpose(1, 2)) @ uv  # (B, H, S, d_a)
    v = torch.sigmoid(block.v_gate(z)) * block.v_proj(z)  # (B, S, E)
    ref_w = (q @ k.transpose(-2, -1) / math.sqrt(d_a)).softmax(-1)  # (B, H, L, S)
    ref = block.out_proj((ref_w @ v.view(B, S, H, E // H).transpose(1, 2)).transpose(1, 2).reshape(B, L, E))
    close(w, ref_w)
    close(out, ref)

    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())


@pytest.mark.parametrize("options", [dict(d_a=6), dict(use_lowrank_mapping=True, lowrank_rank=2),
                                     dict(use_gated_projection=True)], ids=["d_a", "lowrank", "gated"])
def test_from_mha_with_options_runs(options):
    mha = make_mha(batch_first=True)
    block = GeometricAttentionBlock.from_mha(mha, **options)
    assert not block.is_standard
    torch.testing.assert_close(block.v_proj.weight, mha.in_proj_weight[2 * E:])
    x = torch.randn(B, L, E, dtype=F64, requires_grad=True)
    out, w = block(x, x, x, key_padding_mask=torch.zeros(B, L, dtype=torch.bool))
    assert out.shape == (B, L, E) and w.shape == (B, L, L)
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("gain", [0.1, 1.0])
def test_orthogonal_qk_init(gain):
    block = GeometricAttentionBlock(E, H, kdim=4, dtype=F64, d_a=3, qk_init_gain=gain)
    wq, wk = block.q_proj.weight, block.k_proj.weight  # (6, 8): rows orthonormal; (6, 4): columns orthonormal
    close(wq @ wq.T, gain**2 * torch.eye(6, dtype=F64))
    close(wk.T @ wk, gain**2 * torch.eye(4, dtype=F64))
    assert not block.q_proj.bias.any() and not block.k_proj.bias.any()
    mha = make_mha()
    converted = GeometricAttentionBlock.from_mha(mha, qk_init_gain=gain)  # a gain re-initialises Q/K
    wq = converted.q_proj.weight
    close(wq @ wq.T, gain**2 * torch.eye(E, dtype=F64))
    torch.testing.assert_close(converted.v_proj.weight, mha.in_proj_weight[2 * E:])


def test_lazy_top_level_export():
    import mmgeo

    assert mmgeo.GeometricAttentionBlock is GeometricAttentionBlock and mmgeo.convert_attention is convert_attention


def test_unmasked_attention_routes_to_the_fused_kernel(monkeypatch):
    """With the Triton path on (MMGEO_KERNELS=triton; the interpreter on CPU) the block calls geo_attention."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py on CPU)")
    import importlib

    ga = importlib.import_module("mmgeo.layers.geo_attention_block")  # the module (the package exports the class)
    calls = []
    real = ga.geo_attention
    monkeypatch.setattr(ga, "geo_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    block = GeometricAttentionBlock(16, 2, batch_first=True, d_a=4).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref, _ = block(x, x, x, need_weights=False)
        monkeypatch.setenv("MMGEO_KERNELS", "triton")
        fused, _ = block(x, x, x, need_weights=False)
    assert calls == [1]
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
