"""GeometricAttentionBlock: the general operator as a drop-in for ``nn.MultiheadAttention`` (docs/design.md §3).

Scaled dot-product attention in a learned attention space of ``d_a`` dims per head::

    q = W_q x  (H·d_a),  k = W_k y  (H·d_a),  v = P_V z  (linear, or gated σ(W_g z) ⊙ W_v z)
    optional low-rank map on q and k: x <- x · (U V), U: d_a×r, V: r×d_a, shared by the heads
    out = W_o concat_h softmax(q_h k_hᵀ / sqrt(d_a) + mask) v_h

With ``d_a = embed_dim // num_heads``, no low-rank map and a linear P_V this is exactly
``nn.MultiheadAttention`` (docs/design.md §8: the special case ``d_a = d_k``); ``from_mha`` copies an MHA's weights
and ``convert_attention`` swaps every MHA in a model for an equivalent block.

Same constructor arguments, ``forward`` signature, masks and return values as ``nn.MultiheadAttention``.
Limits: the fused Triton kernel serves unmasked attention without returned weights (masks take the plain
PyTorch path); no NestedTensor input,
no TorchScript, no ``static_k``/``static_v``; dropout draws different random numbers than MHA's SDPA path;
``in_proj_weight``/``in_proj_bias`` are None (q/k/v live in ``q_proj``/``k_proj``/``v_proj``), as in an MHA
built with kdim/vdim, which also keeps torch's Transformer layers off their fused fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgeo.kernels import attention_logits, geo_attention, use_triton
from mmgeo.layers.lowrank import LowRankMapping


def init_qk_orthogonal_(block: GeometricAttentionBlock, gain: float) -> None:
    """Orthogonal init of the Q/K maps with a small gain (paper: 0.05–0.1), biases zero (docs/design.md §8).

    Each (H·d_a, in) weight gets orthonormal rows (or columns, whichever fits) times ``gain``, so heads start
    in mutually orthogonal subspaces and early logits stay in range.
    """
    with torch.no_grad():
        for lin in (block.q_proj, block.k_proj):
            nn.init.orthogonal_(lin.weight, gain=gain)
            if lin.bias is not None:
                lin.bias.zero_()


class GeometricAttentionBlock(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` with a learned attention space (docs/design.md §3)."""

    # No packed projection (like an MHA built with kdim/vdim): code that looks for one sees None and
    # falls back to calling forward, e.g. nn.TransformerEncoderLayer skips its fused fast path.
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        d_a: int | None = None,
        use_lowrank_mapping: bool = False,
        lowrank_rank: int = 8,
        use_gated_projection: bool = False,
        qk_init_gain: float | None = None,
    ):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got embed_dim={embed_dim}, num_heads={num_heads}")
        if embed_dim % num_heads:
            divisors = [h for h in range(1, embed_dim + 1) if embed_dim % h == 0]
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}: each head gets embed_dim // "
                f"num_heads value dims; pick num_heads from {divisors} or make embed_dim a multiple of {num_heads}"
            )
        if d_a is not None and d_a <= 0:
            raise ValueError(f"d_a (attention-space dims per head) must be > 0 or None, got {d_a}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.d_v = embed_dim // num_heads  # d_v: value dims per head
        self.d_a = d_a or self.d_v  # d_a: attention-space dims per head (queries and keys)
        self.add_zero_attn = add_zero_attn
        self.qk_init_gain = qk_init_gain
        qk_dim = num_heads * self.d_a  # H·d_a
        self.q_proj = nn.Linear(embed_dim, qk_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, qk_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **kw)
        self.v_gate = nn.Linear(self.vdim, embed_dim, bias=bias, **kw) if use_gated_projection else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.lowrank = None
        if use_lowrank_mapping:
            self.lowrank = LowRankMapping(self.d_a, lowrank_rank).to(**kw)
        if add_bias_kv:  # MHA's layout: (1, 1, dim), appended as one extra key/value
            self.bias_k = nn.Parameter(torch.empty(1, 1, qk_dim, **kw))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **kw))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """MHA's init (xavier q/k/v, zero biases, xavier-normal bias_k/v), or orthogonal Q/K if a gain is set."""
        with torch.no_grad():
            w = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
            if self.kdim == self.embed_dim == self.vdim:  # MHA packs q, k, v: xavier over the packed matrix
                packed = torch.empty(sum(x.shape[0] for x in w), self.embed_dim, dtype=w[0].dtype, device=w[0].device)
                nn.init.xavier_uniform_(packed)
                for x, chunk in zip(w, packed.split([x.shape[0] for x in w])):
                    x.copy_(chunk)
            else:
                for x in w:
                    nn.init.xavier_uniform_(x)
            self.out_proj.reset_parameters()
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
                if lin.bias is not None:
                    lin.bias.zero_()
            if self.bias_k is not None:
                nn.init.xavier_normal_(self.bias_k)
                nn.init.xavier_normal_(self.bias_v)
        if self.qk_init_gain is not None:
            init_qk_orthogonal_(self, self.qk_init_gain)

    @property
    def is_standard(self) -> bool:
        """True when the block computes exactly what nn.MultiheadAttention computes."""
        return self.d_a == self.d_v and self.lowrank is None and self.v_gate is None

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention, **options) -> GeometricAttentionBlock:
        """An equivalent block with ``mha``'s weights (outputs equal when no option is on).

        Q/K weights (and bias_k) are copied when d_a = d_v and no ``qk_init_gain`` is asked for; a gain
        means "re-initialise Q/K", and another d_a has nothing to copy. V, out_proj, biases are always copied.
        """
        ref = mha.out_proj.weight
        block = cls(
            mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
            add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim, vdim=mha.vdim,
            batch_first=mha.batch_first, device=ref.device, dtype=ref.dtype, **options,
        )
        copy_qk = block.d_a == block.d_v and block.qk_init_gain is None
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                wq, wk, wv = mha.in_proj_weight.chunk(3)  # each (E, E)
            else:
                wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            bq, bk, bv = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)
            pairs = [(block.v_proj.weight, wv), (block.v_proj.bias, bv), (block.out_proj.weight, ref),
                     (block.out_proj.bias, mha.out_proj.bias), (block.bias_v, mha.bias_v)]
            if copy_qk:
                pairs += [(block.q_proj.weight, wq), (block.q_proj.bias, bq), (block.k_proj.weight, wk),
                          (block.k_proj.bias, bk), (block.bias_k, mha.bias_k)]
            for dst, src in pairs:
                if dst is not None:
                    dst.copy_(src)
        return block.train(mha.training)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, d_a={self.d_a}, "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}, dropout={self.dropout}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """nn.MultiheadAttention.forward: (L, B, E) or (B, L, E) if batch_first, or unbatched (L, E).

        Masks: bool (True = not allowed) or float (added to the logits). attn_mask (L, S) or (B·H, L, S)
        (also accepted: 4-D broadcastable to (B, H, L, S)); key_padding_mask (B, S), or (S,) unbatched.
        Returns (attn_output like query, weights (B, L, S) averaged or (B, H, L, S), or None).
        """
        batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, _ = query.shape  # query (B, L, E), key (B, S, kdim), value (B, S, vdim)
        S, H, d_a = key.shape[1], self.num_heads, self.d_a
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)  # keys appended to the S given
        mask = self._build_mask(attn_mask, key_padding_mask, batched, B, L, S, extra, is_causal, need_weights, query)

        q = self.q_proj(query).view(B, L, H, d_a).transpose(1, 2)  # (B, H, L, d_a)
        k = self.k_proj(key)  # (B, S, H·d_a)
        v = self.v_proj(value)  # (B, S, E)
        if self.v_gate is not None:
            v = torch.sigmoid(self.v_gate(value)) * v  # (B, S, E)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, -1)], dim=1)  # (B, S+1, H·d_a)
            v = torch.cat([v, self.bias_v.expand(B, 1, -1)], dim=1)  # (B, S+1, E)
        k = k.view(B, k.shape[1], H, d_a).transpose(1, 2)  # (B, H, S', d_a)
        v = v.view(B, v.shape[1], H, self.d_v).transpose(1, 2)  # (B, H, S', d_v)
        if self.lowrank is not None:
            q, k = self.lowrank(q), self.lowrank(k)  # (B, H, L, d_a), (B, H, S', d_a)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, d_a)], dim=2)  # (B, H, S'+1, d_a)
            v = torch.cat([v, v.new_zeros(B, H, 1, self.d_v)], dim=2)  # (B, H, S'+1, d_v)

        out, weights = self._attend(q, k, v, mask, need_weights)  # (B, H, L, d_v), (B, H, L, S')
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))  # (B, L, E)
        if not batched:
            out = out.squeeze(0)  # (L, E)
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (L, B, E)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S')
        return out, weights if batched else weights.squeeze(0)

    def _attend(self, q, k, v, mask, need_weights: bool = True):
        """Core attention: q (B, H, L, d_a), k (B, H, S, d_a), v (B, H, S, d_v), mask additive (B|1, H|1, L, S).

        Returns (out (B, H, L, d_v), weights (B, H, L, S) or None). Unmasked attention without weights or
        dropout goes to the fused ``mmgeo.kernels.geo_attention`` when its Triton path applies (CUDA tensors,
        or MMGEO_KERNELS=triton); masks still take this plain path. Mirrors MHA: rows
        whose keys are all masked give NaN with need_weights, zeros without (SDPA's safe softmax).
        """
        if mask is None and not need_weights and not (self.training and self.dropout > 0):
            if use_triton("geo_attention", q, k, v):  # CUDA (or MMGEO_KERNELS=triton): the fused kernel
                return geo_attention(q, k, v), None
        scores = attention_logits(q, k).to(q.dtype)  # (B, H, L, S): <q, k> / sqrt(d_a)
        if mask is not None:
            scores = scores + mask
        weights = scores.softmax(dim=-1)  # (B, H, L, S)
        if not need_weights and mask is not None:
            weights = weights.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
        weights = F.dropout(weights, self.dropout, self.training)
        return weights @ v, weights  # (B, H, L, d_v)

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """Shape/dtype checks with messages that name the shapes; returns whether the input is batched."""
        shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"expected query, key, value all 3-D (batched) or all 2-D (unbatched), got {shapes}")
        for name, x, dim, arg in (("query", query, self.embed_dim, "embed_dim"), ("key", key, self.kdim, "kdim"),
                                  ("value", value, self.vdim, "vdim")):
            if x.shape[-1] != dim:
                raise ValueError(f"{name} has feature dim {x.shape[-1]} (shape {tuple(x.shape)}) but the block has "
                                 f"{arg}={dim}: build it with {arg}={x.shape[-1]} or project {name} to {dim}")
        batch_axis = 0 if self.batch_first else 1
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key and value must have the same batch and length (one value per key), got {shapes}")
        if query.dim() == 3 and query.shape[batch_axis] != key.shape[batch_axis]:
            layout = "(B, L, E)" if self.batch_first else "(L, B, E) (batch_first=False)"
            raise ValueError(f"query and key batch sizes differ for layout {layout}: {shapes}; "
                             f"check batch_first={self.batch_first}")
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                raise TypeError(f"{name} must be bool (True = not allowed) or floating point (added to the logits), "
                                f"got dtype {m.dtype} (shape {tuple(m.shape)}): use mask.bool() or mask.float()")
        return query.dim() == 3

    def _build_mask(self, attn_mask, key_padding_mask, batched, B, L, S, extra, is_causal, need_weights, like):
        """Merge attn_mask and key_padding_mask into one additive float mask (B|1, H|1, L, S+extra), or None.

        The ``extra`` appended keys (bias_k, zero attention) are allowed, except under the causal hint below.
        """
        H = self.num_heads
        if is_causal and attn_mask is None:  # MHA treats is_causal as a hint that needs the mask
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        mask = None
        if attn_mask is not None:
            shape = tuple(attn_mask.shape)
            if shape == (L, S):
                mask = attn_mask.reshape(1, 1, L, S)
            elif shape == (B * H, L, S):
                mask = attn_mask.reshape(B, H, L, S)
            elif attn_mask.dim() == 4 and all(n in (1, m) for n, m in zip(shape, (B, H, L, S))):
                mask = attn_mask
            else:
                raise ValueError(
                    f"attn_mask of shape {shape} does not broadcast to (B, H, L, S) = ({B}, {H}, {L}, {S}): pass "
                    f"(L, S) = ({L}, {S}) shared by all batches and heads, or (B*num_heads, L, S) = ({B * H}, {L}, {S})"
                    f", with L the query length and S the key length")
            if is_causal and key_padding_mask is None and not need_weights:
                # MHA then hands is_causal to SDPA and drops attn_mask: upper-left causal over all keys
                causal = ~torch.ones(L, S + extra, dtype=torch.bool, device=like.device).tril()  # (L, S')
                return _additive(causal.view(1, 1, L, S + extra), like.dtype)
            mask = _additive(mask, like.dtype)
        if key_padding_mask is not None:
            expected = (B, S) if batched else (S,)
            if tuple(key_padding_mask.shape) != expected:
                raise ValueError(
                    f"key_padding_mask of shape {tuple(key_padding_mask.shape)} does not match (B, S) = {expected}: "
                    f"one entry per key (S = key length {S}), True or -inf on padding")
            kpm = _additive(key_padding_mask.reshape(B, 1, 1, S), like.dtype)  # (B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        return F.pad(mask, (0, extra)) if mask is not None and extra else mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (True = not allowed) -> 0 / -inf; float masks pass through in the compute dtype."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def convert_attention(model: nn.Module, **options) -> nn.Module:
    """Replace every nn.MultiheadAttention inside ``model`` (recursively, in place) by an equivalent block.

    ``options`` go to GeometricAttentionBlock (d_a, use_lowrank_mapping, ...); with none on,
    outputs are unchanged. A module shared by several parents stays shared. Returns ``model`` (or the new
    block when ``model`` itself is an nn.MultiheadAttention).
    """
    done: dict[int, GeometricAttentionBlock] = {}

    def swap(mha: nn.MultiheadAttention) -> GeometricAttentionBlock:
        if id(mha) not in done:
            done[id(mha)] = GeometricAttentionBlock.from_mha(mha, **options)
        return done[id(mha)]

    if isinstance(model, nn.MultiheadAttention):
        return swap(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(parent, name, swap(child))
    return model
