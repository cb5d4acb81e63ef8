"""PyTorch autograd over diffattn's fused kernels, and drop-in DIFF attention modules.

    import diffattn.torch as dt
    out = dt.diff_attention_v2(q, k, v, lambda_logit, causal=True)   # differentiable
    layer = dt.MultiheadDiffAttnV2(embed_dim, depth, num_heads, num_kv_heads)

Tensors are CPU tensors of float32, float64, bfloat16 or float16; they reach
the kernels without a copy when their last axis is contiguous (any other strides
pass as they are). Score modifiers (softcap, alibi_slopes (Hq), sinks (Hq),
learnable: their gradient comes back through autograd) are keyword arguments
of the functions. The backward of 16-bit tensors runs the 16-bit backward
kernels on the saved tensors themselves (no float32 copies): they compute in
float32 and write dq, dk, dv (and V2's dlambda_logit) in the tensors' dtype,
rounded once; lambda's and the sinks' gradients are computed in float32.

The modules keep the reference implementations' parameters (nn.Linear weights
and the state_dict names q_proj.weight, ..., lambda_q1, subln.weight), compute
the projections, rotary embedding, lambda and norm with torch operations and
the attention with the fused kernel, so any torch optimizer trains them and a
state_dict moves between them, the reference modules and the C++ layers
(diffattn.MultiheadDiffAttnV1 / V2, load_safetensors).
"""

import math

import numpy as np
import torch
from torch import nn

from . import _diffattn as _C

__all__ = [
    "diff_attention_v1", "diff_attention_v2", "attention", "DiffAttnV1Function",
    "DiffAttnV2Function", "AttentionFunction", "diff_attention_v1_varlen",
    "diff_attention_v2_varlen", "attention_varlen", "MultiheadDiffAttnV1",
    "MultiheadDiffAttnV2", "RMSNorm", "KVCache", "apply_rope", "lambda_init",
    "standard_alibi_slopes", "diff_attention_v1_stats", "diff_attention_v2_stats",
    "attention_stats",
]

_HALF = (torch.bfloat16, torch.float16)
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _np(t, name="tensor"):
    """The tensor as a numpy array over the same memory (a copy only when its
    last axis is not contiguous); bfloat16 as its uint16 bits."""
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError(f"diffattn.torch: {name} is on {t.device}; the kernels run on the CPU")
    if t.dim() > 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"diffattn.torch: {name} has dtype {t.dtype}; the kernels take "
                         "float32, float64, bfloat16 or float16")
    return t.numpy()


def _torch(a):
    """The numpy array as a tensor over the same memory (uint16 bits: bfloat16)."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _grad_dtype(t):
    """The kernels' compute type for t: float32 for 16-bit storage (lse, lambda,
    dlambda and dsinks are in it)."""
    return torch.float32 if t.dtype in _HALF else t.dtype


def _store(t, dtype):
    """The saved or incoming tensor t as a kernel argument of storage dtype (a
    no-op when t already has it: the 16-bit backward reads the tensors as they are)."""
    return _np(t if t.dtype == dtype else t.to(dtype))


def _opts(causal, window_left, window_right, scale, num_threads, softcap=0.0, alibi_slopes=None,
          sinks=None):
    o = dict(causal=bool(causal), window_left=int(window_left), window_right=int(window_right),
             scale=float(scale), num_threads=int(num_threads), softcap=float(softcap))
    if alibi_slopes is not None:
        o["alibi_slopes"] = alibi_slopes.detach().to(torch.float32).numpy() \
            if torch.is_tensor(alibi_slopes) else np.asarray(alibi_slopes, np.float32)
    if sinks is not None:
        o["sinks"] = sinks.detach().to(torch.float32).numpy()
    return o


def _dsinks(sinks, dtype):
    """The dsinks= output of a backward call (None without learnable sinks)."""
    return None if sinks is None else np.zeros(sinks.shape[0], dtype=np.dtype(str(dtype)[6:]))


def _grad_sinks(sinks, d):
    return None if sinks is None else torch.from_numpy(d).to(sinks.dtype)


def standard_alibi_slopes(n):
    """The standard ALiBi slopes of n heads (diffattn::standard_alibi_slopes): a
    float32 tensor (n); 2^(-8 i / m), i = 1..m for the largest power of two m <= n,
    then the odd i of 2^(-8 i / 2m) for the remaining heads."""
    m = 1
    while 2 * m <= n:
        m *= 2
    out = [2.0 ** (-8.0 * i / m) for i in range(1, m + 1)] if n > 0 else []
    out += [2.0 ** (-8.0 * i / (2 * m)) for i in range(1, 2 * n, 2)][:max(n - len(out), 0)]
    return torch.tensor(out, dtype=torch.float32)


def lambda_init(depth):
    """lambda_init(depth) = 0.8 - 0.6 exp(-0.3 depth), depth the 0-based layer index."""
    return _C.lambda_init(depth)


def _kernel(name, cu, backward=False):
    """The binding `name` (or its backward) and its extra keywords: the dense
    kernel, or, given packed-batch offsets cu = (cu_q, cu_k), its `_varlen` twin."""
    packed = cu[0] is not None
    fn = getattr(_C, name + ("_varlen" if packed else "") + ("_backward" if backward else ""))
    return fn, (dict(seqs=cu[0], cu_seqlens_k=cu[1]) if packed else {})


class DiffAttnV1Function(torch.autograd.Function):
    """diff_attention_v1 with its backward. lambda_ is a 0-d tensor (one lambda)
    or (H) (one per DIFF head). With offsets cu_q (and cu_k), a packed batch:
    diff_attention_v1_varlen and its backward."""

    @staticmethod
    def forward(ctx, q, k, v, lambda_, causal=False, window_left=-1, window_right=-1, scale=0.0,
                num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None, cu_q=None, cu_k=None):
        o = _opts(causal, window_left, window_right, scale, num_threads, softcap, alibi_slopes,
                  sinks)
        lam = float(lambda_) if lambda_.dim() == 0 else _np(
            lambda_.to(torch.float32 if q.dtype in _HALF else q.dtype), "lambda_")
        fn, packed = _kernel("diff_attention_v1", (cu_q, cu_k))
        out, lse = fn(_np(q, "q"), _np(k, "k"), _np(v, "v"), lam, **packed, **o)
        out, lse = _torch(out), _torch(lse)
        ctx.save_for_backward(q, k, v, lambda_, out, lse)
        ctx.opts, ctx.sinks, ctx.cu = o, sinks, (cu_q, cu_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lambda_, out, lse = ctx.saved_tensors
        s, g = q.dtype, _grad_dtype(q)
        lam = float(lambda_) if lambda_.dim() == 0 else _np(lambda_.to(g), "lambda_")
        ds = _dsinks(ctx.sinks, g)
        fn, packed = _kernel("diff_attention_v1", ctx.cu, backward=True)
        dq, dk, dv, dl = fn(_np(q), _store(k, s), _store(v, s), lam, _np(out), _np(lse),
                            _store(dout, s), dsinks=ds, **packed, **ctx.opts)
        dl = torch.tensor(dl, dtype=lambda_.dtype) if lambda_.dim() == 0 else \
            _torch(dl).to(lambda_.dtype)
        return (_torch(dq).to(q.dtype), _torch(dk).to(k.dtype), _torch(dv).to(v.dtype), dl,
                None, None, None, None, None, None, None, _grad_sinks(ctx.sinks, ds), None, None)


class DiffAttnV2Function(torch.autograd.Function):
    """diff_attention_v2 with its backward (lambda_logit gets its gradient through
    the sigmoid); with offsets cu_q (and cu_k), diff_attention_v2_varlen."""

    @staticmethod
    def forward(ctx, q, k, v, lambda_logit, causal=False, window_left=-1, window_right=-1,
                scale=0.0, num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None, cu_q=None,
                cu_k=None):
        o = _opts(causal, window_left, window_right, scale, num_threads, softcap, alibi_slopes,
                  sinks)
        fn, packed = _kernel("diff_attention_v2", (cu_q, cu_k))
        out, lse = fn(_np(q, "q"), _np(k, "k"), _np(v, "v"), _np(lambda_logit, "lambda_logit"),
                      **packed, **o)
        out, lse = _torch(out), _torch(lse)
        ctx.save_for_backward(q, k, v, lambda_logit, out, lse)
        ctx.opts, ctx.sinks, ctx.cu = o, sinks, (cu_q, cu_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, logit, out, lse = ctx.saved_tensors
        s = q.dtype
        ds = _dsinks(ctx.sinks, _grad_dtype(q))
        fn, packed = _kernel("diff_attention_v2", ctx.cu, backward=True)
        dq, dk, dv, dlog = fn(_np(q), _store(k, s), _store(v, s), _store(logit, s), _np(out),
                              _np(lse), _store(dout, s), dsinks=ds, **packed, **ctx.opts)
        return (_torch(dq).to(q.dtype), _torch(dk).to(k.dtype), _torch(dv).to(v.dtype),
                _torch(dlog).to(logit.dtype), None, None, None, None, None, None, None,
                _grad_sinks(ctx.sinks, ds), None, None)


class AttentionFunction(torch.autograd.Function):
    """Plain softmax attention (GQA) with its backward; with offsets cu_q (and
    cu_k), attention_varlen."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, window_left=-1, window_right=-1, scale=0.0,
                num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None, cu_q=None, cu_k=None):
        o = _opts(causal, window_left, window_right, scale, num_threads, softcap, alibi_slopes,
                  sinks)
        fn, packed = _kernel("attention", (cu_q, cu_k))
        out, lse = fn(_np(q, "q"), _np(k, "k"), _np(v, "v"), **packed, **o)
        out, lse = _torch(out), _torch(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts, ctx.sinks, ctx.cu = o, sinks, (cu_q, cu_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        s = q.dtype
        ds = _dsinks(ctx.sinks, _grad_dtype(q))
        fn, packed = _kernel("attention", ctx.cu, backward=True)
        dq, dk, dv = fn(_np(q), _store(k, s), _store(v, s), _np(out), _np(lse), _store(dout, s),
                        dsinks=ds, **packed, **ctx.opts)
        return (_torch(dq).to(q.dtype), _torch(dk).to(k.dtype), _torch(dv).to(v.dtype),
                None, None, None, None, None, None, None, _grad_sinks(ctx.sinks, ds), None, None)


def diff_attention_v1(q, k, v, lambda_, *, causal=False, window_left=-1, window_right=-1,
                      scale=0.0, num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None):
    """Differentiable diff_attention_v1: q (B, N, 2H, d), k (B, M, 2Hkv, d),
    v (B, M, Hkv, 2d), lambda_ a number, 0-d tensor or (H) -> out (B, N, H, 2d)."""
    if not torch.is_tensor(lambda_):
        lambda_ = torch.tensor(float(lambda_), dtype=_grad_dtype(q))
    return DiffAttnV1Function.apply(q, k, v, lambda_, causal, window_left, window_right, scale,
                                    num_threads, softcap, alibi_slopes, sinks)


def diff_attention_v2(q, k, v, lambda_logit, *, causal=False, window_left=-1, window_right=-1,
                      scale=0.0, num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None):
    """Differentiable diff_attention_v2: q (B, N, 2H, d), k, v (B, M, Hkv, d),
    lambda_logit (B, N, H) -> out (B, N, H, d)."""
    return DiffAttnV2Function.apply(q, k, v, lambda_logit, causal, window_left, window_right,
                                    scale, num_threads, softcap, alibi_slopes, sinks)


def attention(q, k, v, *, causal=False, window_left=-1, window_right=-1, scale=0.0,
              num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None):
    """Differentiable plain attention: q (B, N, Hq, d), k (B, M, Hkv, d), v (B, M, Hkv, dv)."""
    return AttentionFunction.apply(q, k, v, causal, window_left, window_right, scale, num_threads,
                                   softcap, alibi_slopes, sinks)


def _offsets(cu, name):
    """Packed-batch offsets for the kernels, kept for the backward: a
    PackedSequences as it is, a tensor, array or list as a numpy copy (the
    kernels refuse non-integer dtypes)."""
    if cu is None or isinstance(cu, _C.PackedSequences):
        return cu
    if torch.is_tensor(cu):
        if cu.device.type != "cpu":
            raise ValueError(f"diffattn.torch: {name} is on {cu.device}; offsets live on the CPU")
        cu = cu.detach().numpy()
    return np.array(cu)


def diff_attention_v1_varlen(q, k, v, lambda_, cu_seqlens_q, cu_seqlens_k=None, *, causal=False,
                             window_left=-1, window_right=-1, scale=0.0, num_threads=0,
                             softcap=0.0, alibi_slopes=None, sinks=None):
    """Differentiable diff_attention_v1 over a packed batch (FlashAttention's varlen
    layout): q (T, 2H, d), k (T_k, 2Hkv, d), v (T_k, Hkv, 2d) -> out (T, H, 2d).
    cu_seqlens_q: the B + 1 offsets of the sequences in q (a list, an integer tensor
    or array, or a diffattn.PackedSequences holding both), cu_seqlens_k those in k
    and v when they differ; masks, windows and modifiers act within each sequence."""
    if not torch.is_tensor(lambda_):
        lambda_ = torch.tensor(float(lambda_), dtype=_grad_dtype(q))
    return DiffAttnV1Function.apply(
        q, k, v, lambda_, causal, window_left, window_right, scale, num_threads, softcap,
        alibi_slopes, sinks, _offsets(cu_seqlens_q, "cu_seqlens_q"),
        _offsets(cu_seqlens_k, "cu_seqlens_k"))


def diff_attention_v2_varlen(q, k, v, lambda_logit, cu_seqlens_q, cu_seqlens_k=None, *,
                             causal=False, window_left=-1, window_right=-1, scale=0.0,
                             num_threads=0, softcap=0.0, alibi_slopes=None, sinks=None):
    """Differentiable diff_attention_v2 over a packed batch: q (T, 2H, d), k, v
    (T_k, Hkv, d), lambda_logit (T, H) -> out (T, H, d); offsets as
    diff_attention_v1_varlen's."""
    return DiffAttnV2Function.apply(
        q, k, v, lambda_logit, causal, window_left, window_right, scale, num_threads, softcap,
        alibi_slopes, sinks, _offsets(cu_seqlens_q, "cu_seqlens_q"),
        _offsets(cu_seqlens_k, "cu_seqlens_k"))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=False, window_left=-1,
                     window_right=-1, scale=0.0, num_threads=0, softcap=0.0, alibi_slopes=None,
                     sinks=None):
    """Differentiable plain attention over a packed batch: q (T, Hq, d), k (T_k,
    Hkv, d), v (T_k, Hkv, dv) -> out (T, Hq, dv); offsets as
    diff_attention_v1_varlen's."""
    return AttentionFunction.apply(
        q, k, v, causal, window_left, window_right, scale, num_threads, softcap, alibi_slopes,
        sinks, _offsets(cu_seqlens_q, "cu_seqlens_q"), _offsets(cu_seqlens_k, "cu_seqlens_k"))


def _stats(name, q, tensors, scalars, out, return_out, kw):
    """The numpy statistics function `name` on tensors (q first): float32 and
    float64 as they are, without a copy; bfloat16 and float16 widened to float32
    (the statistics run in float or double). Returns the dict with its arrays as
    tensors, and with out= or return_out=True (stats, out)."""
    for n, t in tensors:
        if not torch.is_tensor(t):
            raise ValueError(f"{name}: {n} must be a tensor, got {type(t).__name__} (the numpy "
                             f"function diffattn.{name} takes arrays)")
    if q.dtype in (torch.float32, torch.float64):
        dtype = q.dtype
    elif q.dtype in _HALF:
        dtype = torch.float32
    else:
        raise ValueError(f"{name}: q has dtype {q.dtype}; expected float32, float64, bfloat16 "
                         "or float16")
    arrays = [_np(t if t.dtype == dtype else t.to(dtype), n) for n, t in tensors]
    if out is not None:
        if not torch.is_tensor(out):
            raise ValueError(f"{name}: out must be a tensor, got {type(out).__name__}")
        if out.dim() > 0 and out.size(-1) > 1 and out.stride(-1) != 1:
            raise ValueError(f"{name}: out's last axis must be contiguous (stride "
                             f"{out.stride(-1)})")
        kw["out"] = _np(out, "out")
    res = getattr(_C, name)(arrays[0], *arrays[1:3], *scalars, *arrays[3:], **kw,
                            return_out=return_out)
    stats, o = res if isinstance(res, tuple) else (res, None)
    stats = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in stats.items()}
    if o is None:
        return stats
    return stats, (out if out is not None else torch.from_numpy(o))


def _stats_kw(causal, window_left, window_right, scale, num_threads, needle_begin, needle_end,
              query_begin, query_end, logit_bits):
    return dict(causal=bool(causal), window_left=int(window_left), window_right=int(window_right),
                scale=float(scale), num_threads=int(num_threads), needle_begin=int(needle_begin),
                needle_end=int(needle_end), query_begin=int(query_begin),
                query_end=int(query_end), logit_bits=int(logit_bits))


def diff_attention_v1_stats(q, k, v, lambda_, *, causal=False, window_left=-1, window_right=-1,
                            scale=0.0, num_threads=0, needle_begin=0, needle_end=0,
                            query_begin=0, query_end=-1, logit_bits=0, out=None,
                            return_out=False):
    """diffattn.diff_attention_v1_stats on tensors (no autograd): the paper's
    measurements of every row as the fused kernel computes it, a dict of
    tensors; shapes as diff_attention_v1, lambda_ a number or a one-element
    tensor.
    bfloat16 and float16 tensors are measured in float32 (and out is float32)."""
    if torch.is_tensor(lambda_):
        if lambda_.numel() != 1 or lambda_.dim() > 1:
            raise ValueError("diff_attention_v1_stats: lambda_ must be a number or a tensor of "
                             f"one element, got a tensor of shape {tuple(lambda_.shape)}")
        lambda_ = lambda_.item()
    return _stats("diff_attention_v1_stats", q, [("q", q), ("k", k), ("v", v)],
                  [float(lambda_)], out, return_out,
                  _stats_kw(causal, window_left, window_right, scale, num_threads, needle_begin,
                            needle_end, query_begin, query_end, logit_bits))


def diff_attention_v2_stats(q, k, v, lambda_logit, *, causal=False, window_left=-1,
                            window_right=-1, scale=0.0, num_threads=0, needle_begin=0,
                            needle_end=0, query_begin=0, query_end=-1, logit_bits=0, out=None,
                            return_out=False):
    """diffattn.diff_attention_v2_stats on tensors (no autograd); shapes as
    diff_attention_v2. bfloat16 and float16 tensors are measured in float32."""
    return _stats("diff_attention_v2_stats", q,
                  [("q", q), ("k", k), ("v", v), ("lambda_logit", lambda_logit)], [], out,
                  return_out,
                  _stats_kw(causal, window_left, window_right, scale, num_threads, needle_begin,
                            needle_end, query_begin, query_end, logit_bits))


def attention_stats(q, k, v, *, causal=False, window_left=-1, window_right=-1, scale=0.0,
                    num_threads=0, needle_begin=0, needle_end=0, query_begin=0, query_end=-1,
                    logit_bits=0, out=None, return_out=False):
    """diffattn.attention_stats on tensors (no autograd); shapes as attention.
    bfloat16 and float16 tensors are measured in float32."""
    return _stats("attention_stats", q, [("q", q), ("k", k), ("v", v)], [], out, return_out,
                  _stats_kw(causal, window_left, window_right, scale, num_threads, needle_begin,
                            needle_end, query_begin, query_end, logit_bits))


def _rotate(x, cos, sin):
    """(x0 cos - x1 sin, x0 sin + x1 cos) on the interleaved pairs (x0, x1) of x,
    written into one new tensor (no stacked copies)."""
    shape = x.shape[:-1] + (x.shape[-1] // 2, 2)
    xv = x.reshape(shape)
    x0, x1 = xv[..., 0], xv[..., 1]
    out = torch.empty(shape, dtype=x.dtype)
    o0, o1 = out[..., 0], out[..., 1]
    torch.mul(x0, cos, out=o0)
    o0.sub_(x1 * sin)
    torch.mul(x0, sin, out=o1)
    o1.add_(x1 * cos)
    return out.flatten(-2)


class _RopeFunction(torch.autograd.Function):
    """The rotation with its backward, the rotation by the opposite angles: two
    products and a sum per output, where autograd through slices and a stack
    would zero-fill and add whole tensors."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin), None, None


def apply_rope(x, position_offset=0, base=10000.0):
    """Rotary embedding on interleaved pairs (2i, 2i+1), as the reference's
    apply_rotary_emb(..., interleaved=True) and diffattn::apply_rope: x (B, N, H, D),
    token n at position position_offset + n, angles computed in float64; the same
    values as x0 cos - x1 sin, x0 sin + x1 cos in x's dtype. position_offset may
    also be a tensor of the N positions (a packed batch's, restarting at 0 for
    each sequence)."""
    n = x.shape[1]
    if torch.is_tensor(position_offset):
        pos = position_offset.to(torch.float64)
    else:
        pos = torch.arange(position_offset, position_offset + n, dtype=torch.float64)
    d = x.shape[-1]
    inv_freq = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angle = pos[:, None] * inv_freq[None, :]  # (N, D/2)
    cos = angle.cos().to(x.dtype)[None, :, None, :]
    sin = angle.sin().to(x.dtype)[None, :, None, :]
    if x.requires_grad and torch.is_grad_enabled():
        return _RopeFunction.apply(x, cos, sin)
    with torch.no_grad():
        return _rotate(x, cos, sin)


def _packed_positions(cu, n):
    """The rotary positions of a packed batch of n tokens: t - cu[s] for token t of
    sequence s (int64 tensor)."""
    cu = torch.as_tensor(np.asarray(cu.cu_seqlens_q if isinstance(cu, _C.PackedSequences) else cu,
                                    dtype=np.int64))
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != n or \
            bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the {n} tokens of x, "
                         f"got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    return torch.arange(n, dtype=torch.int64) - torch.repeat_interleave(cu[:-1], lengths)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (the reference's subln): x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim, eps=1e-5, elementwise_affine=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * self.weight if self.weight is not None else out


def _cache_storage(dtype):
    """(torch dtype the rows are stored in, quantize_rows' name or None) of a
    cache dtype: a kernel dtype as itself, "int8" or torch.int8 as int8 rows,
    "float8_e4m3" (or torch.float8_e4m3fn where torch has it) as uint8 E4M3FN bits."""
    if dtype in ("int8", torch.int8):
        return torch.int8, "int8"
    if dtype == "float8_e4m3" or dtype == getattr(torch, "float8_e4m3fn", "float8_e4m3"):
        return torch.uint8, "float8_e4m3"
    if dtype not in _KERNEL_DTYPES:
        raise ValueError(f"make_cache: dtype must be float32, float64, bfloat16, float16, "
                         f"\"int8\" or \"float8_e4m3\"; got {dtype}")
    return dtype, None


class KVCache:
    """Keys (after rotary) and values of the tokens a module has seen, for B
    sequences decoded in step: buffers k (B, rows, heads, width) and v, and the
    number of tokens seen (size(), the rotary position of the next one).

    rows is the capacity, or for a module with a sliding window of W =
    window_left + 1 tokens at most 2W, as the C++ layers' caches: only the last
    W - 1 tokens are read again, the held rows (keys(), values(), stored() of
    them) move to the front when the buffer fills, and an append longer than
    the room left runs in pieces; memory is bounded by W, not by the sequence.

    An 8-bit cache (make_cache(..., dtype="int8" or "float8_e4m3")) holds k and v
    as int8, or uint8 E4M3FN bits, and one float32 scale per (token, head) row in
    k_scale and v_scale (B, rows, heads): each appended row is quantized by
    quantize_rows (scale = max |x| / 127 or / 448), and the decoding kernels read
    the rows in place. k_scale and v_scale are None for other caches.

    An append that fails (no room, a non-finite value for an 8-bit cache) leaves
    the cache as it was."""

    def __init__(self, batch, capacity, k_heads, k_dim, v_heads, v_dim, dtype, keep=-1):
        if batch < 0 or capacity < 0:
            raise ValueError(f"KVCache: batch and capacity must be >= 0, got {batch}, {capacity}")
        store, self._quant = _cache_storage(dtype)
        rows = capacity if keep < 0 else min(capacity, 2 * (keep + 1))
        self.k = torch.zeros(batch, rows, k_heads, k_dim, dtype=store)
        self.v = torch.zeros(batch, rows, v_heads, v_dim, dtype=store)
        self.k_scale = self.v_scale = None
        if self._quant:
            self.k_scale = torch.zeros(batch, rows, k_heads, dtype=torch.float32)
            self.v_scale = torch.zeros(batch, rows, v_heads, dtype=torch.float32)
        self._capacity, self._keep = capacity, keep
        self._size = self._start = self._end = 0

    def size(self):
        return self._size

    def capacity(self):
        return self._capacity

    def batch(self):
        return self.k.shape[0]

    def stored(self):
        """Rows held: size() without a window, at most W - 1 with one."""
        return self._end - self._start

    def keys(self):
        """The held keys (B, stored(), heads, width): a view."""
        return self.k[:, self._start:self._end]

    def values(self):
        """The held values (B, stored(), heads, width): a view."""
        return self.v[:, self._start:self._end]

    def bytes(self):
        """Bytes held for keys, values and (8-bit caches) their scales."""
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def clear(self):
        self._size = self._start = self._end = 0

    def _buffers(self):
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self._quant else [])

    def _max_append(self):
        left = self._capacity - self._size
        if self._keep < 0:
            return left
        return min(left, self.k.shape[1] - min(self.stored(), self._keep))

    def _reserve(self, n):
        """The row where n new tokens go, the kept rows moved to the front when
        the buffer is full (the cache still holds the same tokens)."""
        if self._end + n > self.k.shape[1]:
            kept = min(self.stored(), self._keep)
            for t in self._buffers():
                t[:, :kept] = t[:, self._end - kept:self._end].clone()
            self._start, self._end = 0, kept
        return self._end

    def _write(self, fn, row, k, v):
        new = slice(row, row + k.shape[1])
        if not self._quant:
            self.k[:, new] = k
            self.v[:, new] = v
            return
        try:
            for src, dst, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
                _C.quantize_rows(_np(src), self._quant, out=dst[:, new].numpy(),
                                 scale=scale[:, new].numpy())
        except ValueError as e:
            raise ValueError(f"{fn}: {e}") from None

    def _held_with(self, n):
        """k_cache, v_cache, cache_seqlens and the scale keywords of the kvcache
        kernels: the held rows and the n written after them."""
        rows = slice(self._start, self._end + n)
        lens = np.full(self.batch(), self._end + n - self._start, dtype=np.int64)
        if not self._quant:
            return _np(self.k[:, rows], "cache.k"), _np(self.v[:, rows], "cache.v"), lens, {}
        return (self.k[:, rows].numpy(), self.v[:, rows].numpy(), lens,
                dict(k_scale=self.k_scale[:, rows].numpy(),
                     v_scale=self.v_scale[:, rows].numpy()))

    def _append(self, fn, k, v, attend):
        """Appends keys k (B, n, ...) and values v, in pieces that fit, and after
        writing each piece calls attend(a, np, k_cache, v_cache, lens, scales) for
        the queries of tokens [a, a + np): their outputs, concatenated."""
        n = k.shape[1]
        if k.shape[0] != self.batch():
            raise ValueError(f"{fn}: x has batch {k.shape[0]}, the cache {self.batch()}")
        if n > self._capacity - self._size:
            raise ValueError(f"{fn}: cannot append {n} tokens to a cache holding {self._size} "
                             f"of capacity {self._capacity}")
        # One piece changes nothing until it counts; several overwrite held rows.
        saved = None
        if n > self._max_append():
            saved = ([t.clone() for t in self._buffers()], self._size, self._start, self._end)
        outs, a = [], 0
        try:
            while a < n or not outs:
                m = min(n - a, self._max_append())
                if m < 1 and a < n:
                    raise ValueError(f"{fn}: no room to append to a cache holding {self._size}")
                row = self._reserve(m)
                self._write(fn, row, k[:, a:a + m], v[:, a:a + m])
                outs.append(attend(a, m, *self._held_with(m)))
                self._end += m
                self._size += m
                if 0 <= self._keep < self.stored():
                    self._start = self._end - self._keep
                a += m
        except BaseException:
            if saved is not None:
                for t, c in zip(self._buffers(), saved[0]):
                    t.copy_(c)
                self._size, self._start, self._end = saved[1:]
            raise
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


class _Module(nn.Module):
    def _init_mods(self, softcap, alibi, sinks, query_heads, kw):
        if not math.isfinite(softcap) or softcap < 0:
            raise ValueError(f"{type(self).__name__}: softcap must be finite and >= 0 (0: none), "
                             f"got {softcap}")
        self.softcap, self.alibi = float(softcap), bool(alibi)
        # The slopes are float32 kernel options, not parameters: not in the state_dict.
        self._alibi_slopes = standard_alibi_slopes(query_heads) if alibi else None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(query_heads, **kw))
        else:
            self.register_parameter("sinks", None)

    def _mods(self):
        return dict(softcap=self.softcap, alibi_slopes=self._alibi_slopes, sinks=self.sinks)

    def _check_x(self, x):
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"{type(self).__name__}.forward: x has shape {tuple(x.shape)}, "
                             f"expected (B, N, {self.embed_dim})")

    def _new_cache(self, batch, capacity, k_heads, k_dim, v_heads, v_dim, dtype):
        own = self.q_proj.weight.dtype
        keep = self.window_left if self.causal and self.window_left >= 0 else -1
        cache = KVCache(batch, capacity, k_heads, k_dim, v_heads, v_dim, dtype or own, keep)
        if cache._quant and own not in (torch.float32,) + _HALF:
            raise ValueError(f"{type(self).__name__}.make_cache: an 8-bit cache takes queries of "
                             f"float32, bfloat16 or float16; this module's parameters are {own}")
        return cache

    def _packed(self, x, cu_seqlens, cache):
        """The rotary positions and kernel offsets of a packed x (1, T, E)."""
        name = type(self).__name__
        if cache is not None:
            raise ValueError(f"{name}.forward: cu_seqlens (a packed batch) and a cache exclude "
                             "each other")
        if x.shape[0] != 1:
            raise ValueError(f"{name}.forward: a packed batch is x (1, T, E), got "
                             f"{tuple(x.shape)}")
        try:
            pos = _packed_positions(cu_seqlens, x.shape[1])
        except ValueError as e:
            raise ValueError(f"{name}.forward: {e}") from None
        return pos, _offsets(cu_seqlens, "cu_seqlens")

    def _check_cache_use(self, cache):
        # The cached forward is for inference: it runs under no_grad.
        if not self.causal:
            raise ValueError(f"{type(self).__name__}.forward: a KV cache needs a causal module")
        if not isinstance(cache, KVCache):
            raise ValueError(f"{type(self).__name__}.forward: cache must come from make_cache, "
                             f"got {type(cache).__name__}")

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}" + (f", softcap={self.softcap}" if self.softcap else "")
                + (", alibi=True" if self.alibi else "")
                + (", sinks=True" if self.sinks is not None else ""))


class MultiheadDiffAttnV1(_Module):
    """The Differential Transformer's attention (V1, split heads; Ye et al., ICLR 2025).

    MultiheadDiffAttnV1(embed_dim, depth, num_heads, num_kv_heads=None): num_heads
    DIFF heads, each two query/key halves of head_dim = embed_dim / (2 num_heads)
    and values twice as wide; GQA with num_kv_heads kv pairs. Parameters as the
    reference (q_proj, k_proj, v_proj, out_proj nn.Linear without bias; lambda_q1,
    lambda_k1, lambda_q2, lambda_k2 (head_dim) from N(0, 0.1); subln.weight (2
    head_dim)). forward(x) takes x (B, N, E) and returns (B, N, E); with a cache
    (make_cache) it runs n new tokens after those cached, without autograd; with
    cu_seqlens (the B + 1 offsets of sequences packed in x (1, T, E), or a
    diffattn.PackedSequences) each sequence attends only to itself, its rotary
    positions starting at 0, through the varlen kernels (with autograd).

    Score modifiers, as DiffAttnV1Config: softcap (> 0: softcap tanh(s / softcap)),
    alibi (True: ALiBi with standard_alibi_slopes(2 num_heads), one slope per
    query head of both maps) and sinks (True: a learned sink per query head, the
    parameter `sinks` (2 num_heads), zero-initialised, trained through autograd).
    """

    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None, *, causal=True, rope=True,
                 norm_affine=True, rope_base=10000.0, window_left=-1, window_right=-1,
                 head_dim=None, norm_eps=1e-5, num_threads=0, softcap=0.0, alibi=False,
                 sinks=False, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"MultiheadDiffAttnV1: num_heads {num_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = head_dim or embed_dim // num_heads // 2
        self.depth, self.causal, self.rope, self.rope_base = depth, causal, rope, rope_base
        self.window_left, self.window_right, self.num_threads = window_left, window_right, num_threads
        self.lambda_init = lambda_init(depth)
        d, kw = self.head_dim, dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, 2 * num_heads * d, bias=False, **kw)
        self.k_proj = nn.Linear(embed_dim, 2 * num_kv_heads * d, bias=False, **kw)
        self.v_proj = nn.Linear(embed_dim, 2 * num_kv_heads * d, bias=False, **kw)
        self.out_proj = nn.Linear(2 * num_heads * d, embed_dim, bias=False, **kw)
        self.lambda_q1 = nn.Parameter(torch.zeros(d, **kw).normal_(mean=0, std=0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(d, **kw).normal_(mean=0, std=0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(d, **kw).normal_(mean=0, std=0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(d, **kw).normal_(mean=0, std=0.1))
        self.subln = RMSNorm(2 * d, eps=norm_eps, elementwise_affine=norm_affine, **kw)
        self._init_mods(softcap, alibi, sinks, 2 * num_heads, kw)

    def lambda_full(self):
        """exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init (a 0-d tensor)."""
        l1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1))
        l2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2))
        return l1 - l2 + self.lambda_init

    def _qkv(self, x, offset):
        b, n, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, n, 2 * self.num_heads, d)
        k = self.k_proj(x).view(b, n, 2 * self.num_kv_heads, d)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, 2 * d)
        if self.rope:
            q, k = apply_rope(q, offset, self.rope_base), apply_rope(k, offset, self.rope_base)
        return q, k, v

    def _out(self, attn):
        b, n = attn.shape[:2]
        attn = self.subln(attn) * (1 - self.lambda_init)
        return self.out_proj(attn.reshape(b, n, 2 * self.num_heads * self.head_dim))

    def forward(self, x, cache=None, position_offset=0, cu_seqlens=None):
        self._check_x(x)
        if cu_seqlens is not None:
            pos, cu = self._packed(x, cu_seqlens, cache)
            q, k, v = self._qkv(x, pos)
            attn = DiffAttnV1Function.apply(
                q[0], k[0], v[0], self.lambda_full(), self.causal, self.window_left,
                self.window_right, 0.0, self.num_threads, self.softcap, self._alibi_slopes,
                self.sinks, cu)
            return self._out(attn[None])
        if cache is not None:
            return self._forward_cached(x, cache)
        q, k, v = self._qkv(x, position_offset)
        attn = DiffAttnV1Function.apply(q, k, v, self.lambda_full(), self.causal,
                                        self.window_left, self.window_right, 0.0, self.num_threads,
                                        self.softcap, self._alibi_slopes, self.sinks)
        return self._out(attn)

    def make_cache(self, batch, capacity, dtype=None):
        """A KV cache for batch sequences of up to capacity tokens (dtype: the
        parameters', torch.bfloat16 or torch.float16 for half the bytes, "int8" or
        "float8_e4m3" for a quarter of float32's, with one scale per row)."""
        d = self.head_dim
        return self._new_cache(batch, capacity, 2 * self.num_kv_heads, d, self.num_kv_heads,
                               2 * d, dtype)

    @torch.no_grad()
    def _forward_cached(self, x, cache):
        self._check_cache_use(cache)
        q, k, v = self._qkv(x, cache.size())
        lam = float(self.lambda_full())
        o = _opts(True, self.window_left, -1, 0.0, self.num_threads, **self._mods())

        def attend(a, n, kc, vc, lens, scales):
            out, _ = _C.diff_attention_v1_kvcache(_np(q[:, a:a + n]), kc, vc, lam, lens, **scales,
                                                  **o)
            return _torch(out)

        return self._out(cache._append("MultiheadDiffAttnV1.forward", k, v, attend))


class MultiheadDiffAttnV2(_Module):
    """DIFF V2 attention (doubled query heads): query heads 2h and 2h+1 of one GQA
    group form DIFF head h, out_h = attn(q_2h) - sigmoid(x lambda_proj_h^T) attn(q_2h+1).

    MultiheadDiffAttnV2(embed_dim, depth, num_heads, num_kv_heads=None): num_heads
    DIFF heads (2 num_heads query heads) of head_dim = embed_dim / num_heads,
    num_kv_heads kv heads; q_proj, k_proj, v_proj, o_proj, lambda_proj nn.Linear
    without bias. depth is the reference signature's, unused (no lambda_init).
    forward(x, cache=None, position_offset=0, cu_seqlens=None) as
    MultiheadDiffAttnV1's.

    Score modifiers, as DiffAttnV2Config: softcap, alibi (standard_alibi_slopes(2
    num_heads), one slope per query head) and sinks (the parameter `sinks` (2
    num_heads), zero-initialised, trained through autograd), as MultiheadDiffAttnV1.
    """

    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None, *, head_dim=None,
                 causal=True, rope=True, rope_base=10000.0, window_left=-1, window_right=-1,
                 num_threads=0, softcap=0.0, alibi=False, sinks=False, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"MultiheadDiffAttnV2: num_heads {num_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = head_dim or embed_dim // num_heads
        self.depth, self.causal, self.rope, self.rope_base = depth, causal, rope, rope_base
        self.window_left, self.window_right, self.num_threads = window_left, window_right, num_threads
        hd, kw = self.head_dim, dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, 2 * num_heads * hd, bias=False, **kw)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * hd, bias=False, **kw)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * hd, bias=False, **kw)
        self.o_proj = nn.Linear(num_heads * hd, embed_dim, bias=False, **kw)
        self.lambda_proj = nn.Linear(embed_dim, num_heads, bias=False, **kw)
        self._init_mods(softcap, alibi, sinks, 2 * num_heads, kw)

    def _qkv(self, x, offset):
        b, n, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, n, 2 * self.num_heads, hd)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, hd)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, hd)
        if self.rope:
            q, k = apply_rope(q, offset, self.rope_base), apply_rope(k, offset, self.rope_base)
        return q, k, v, self.lambda_proj(x)

    def _out(self, attn):
        b, n = attn.shape[:2]
        return self.o_proj(attn.reshape(b, n, self.num_heads * self.head_dim))

    def forward(self, x, cache=None, position_offset=0, cu_seqlens=None):
        self._check_x(x)
        if cu_seqlens is not None:
            pos, cu = self._packed(x, cu_seqlens, cache)
            q, k, v, logit = self._qkv(x, pos)
            attn = DiffAttnV2Function.apply(
                q[0], k[0], v[0], logit[0], self.causal, self.window_left, self.window_right,
                0.0, self.num_threads, self.softcap, self._alibi_slopes, self.sinks, cu)
            return self._out(attn[None])
        if cache is not None:
            return self._forward_cached(x, cache)
        q, k, v, logit = self._qkv(x, position_offset)
        attn = DiffAttnV2Function.apply(q, k, v, logit, self.causal, self.window_left,
                                        self.window_right, 0.0, self.num_threads, self.softcap,
                                        self._alibi_slopes, self.sinks)
        return self._out(attn)

    def make_cache(self, batch, capacity, dtype=None):
        """A KV cache for batch sequences of up to capacity tokens: the baseline's,
        num_kv_heads heads of head_dim for keys and values (dtype as
        MultiheadDiffAttnV1.make_cache's)."""
        hd = self.head_dim
        return self._new_cache(batch, capacity, self.num_kv_heads, hd, self.num_kv_heads, hd,
                               dtype)

    @torch.no_grad()
    def _forward_cached(self, x, cache):
        self._check_cache_use(cache)
        q, k, v, logit = self._qkv(x, cache.size())
        o = _opts(True, self.window_left, -1, 0.0, self.num_threads, **self._mods())

        def attend(a, n, kc, vc, lens, scales):
            out, _ = _C.diff_attention_v2_kvcache(_np(q[:, a:a + n]), kc, vc,
                                                  _np(logit[:, a:a + n]), lens, **scales, **o)
            return _torch(out)

        return self._out(cache._append("MultiheadDiffAttnV2.forward", k, v, attend))
