"""The papers' attention modules in plain PyTorch (eager math: materialised
N x N maps, torch autograd): the oracle of the tests and the baseline of
examples/python/bench_torch.py.

EagerDiffAttnV1 follows microsoft/unilm Diff-Transformer multihead_diffattn.py,
with the GQA pairing of DESIGN.md (DIFF head h reads key heads 2g and 2g+1 and
value head g, g = h / (H / Hkv)); EagerDiffAttnV2 the DIFF V2 module (query
heads 2h and 2h+1 of one GQA group, lambda = sigmoid(lambda_proj(x)) per token
and head). Rotary embedding on interleaved pairs, base 10000.

Score modifiers (off by default), one per query head j (the 2H heads of both
maps): softcap (s -> softcap tanh(s / softcap)), an ALiBi slope (s -= slope_j
|i + M - N - key|) and a sink (a logit sink_j without value joins each row's
softmax), as the C++ layer configs' softcap, alibi and sinks."""

import math

import torch
from torch import nn


def rope(x, offset=0, base=10000.0):
    """x (B, N, H, D), interleaved pairs (2i, 2i+1); angles in float64."""
    n, d = x.shape[1], x.shape[-1]
    inv = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    ang = torch.arange(offset, offset + n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[None, :, None, :], ang.sin().to(x.dtype)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def masked(n, m):
    """(N, M) True where query i must not see key j (causal, aligned bottom-right)."""
    return torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n)


def alibi_slopes(n):
    """The standard ALiBi slopes of n heads (Press et al.; non-powers of two as the
    reference implementation), rounded to float32 as the kernel options hold them."""
    def pow2(c):
        return [2.0 ** (-8.0 * (i + 1) / c) for i in range(c)]
    m = 2 ** int(math.floor(math.log2(n)))
    s = pow2(m) + pow2(2 * m)[0::2][:n - m]
    return torch.tensor(s, dtype=torch.float32).double()


def softmax_mods(s, softcap=0.0, slopes=None, sinks=None, causal=True):
    """softmax of scores s (B, Hq, N, M) with the score modifiers and the causal mask."""
    n, m = s.shape[-2:]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        dist = (torch.arange(n)[:, None] + (m - n) - torch.arange(m)[None, :]).abs()
        s = s - slopes.to(s.dtype)[:, None, None] * dist.to(s.dtype)
    if causal:
        s = s.masked_fill(masked(n, m), float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1)
    col = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat((s, col), dim=-1), dim=-1)[..., :m]


def eager_v2(q, k, v, logit, causal=True, softcap=0.0, slopes=None, sinks=None):
    """q (B, N, 2H, d), k, v (B, M, Hkv, d), logit (B, N, H) -> (B, N, H, d)."""
    b, n, h2, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    q = q.transpose(1, 2) * (1 / math.sqrt(d))              # (B, 2H, N, d), scaled as the reference
    k = k.transpose(1, 2).repeat_interleave(h2 // hkv, 1)  # (B, 2H, M, d)
    v = v.transpose(1, 2).repeat_interleave(h2 // hkv, 1)
    s = q @ k.transpose(-1, -2)
    if softcap > 0 or slopes is not None or sinks is not None:
        a = softmax_mods(s, softcap, slopes, sinks, causal)
    else:
        if causal:
            s.masked_fill_(masked(n, m), float("-inf"))     # in place, as the reference's +=
        a = torch.softmax(s, dim=-1)
    o = (a @ v).view(b, h2 // 2, 2, n, d)
    lam = torch.sigmoid(logit).transpose(1, 2)[..., None]  # (B, H, N, 1)
    return (o[:, :, 0] - lam * o[:, :, 1]).transpose(1, 2)


def eager_v1(q, k, v, lam, causal=True, softcap=0.0, slopes=None, sinks=None):
    """q (B, N, 2H, d), k (B, M, 2Hkv, d), v (B, M, Hkv, 2d) -> (B, N, H, 2d)."""
    b, n, h2, d = q.shape
    m, hkv = k.shape[1], v.shape[2]
    rep = h2 // 2 // hkv
    q = q.transpose(1, 2) * (1 / math.sqrt(d))                             # (B, 2H, N, d)
    k = k.transpose(1, 2).reshape(b, hkv, 2, m, d).repeat_interleave(rep, 1).reshape(b, h2, m, d)
    v = v.transpose(1, 2).repeat_interleave(rep, 1)                        # (B, H, M, 2d)
    s = q @ k.transpose(-1, -2)
    if softcap > 0 or slopes is not None or sinks is not None:
        a = softmax_mods(s, softcap, slopes, sinks, causal).view(b, h2 // 2, 2, n, m)
    else:
        if causal:
            s.masked_fill_(masked(n, m), float("-inf"))
        a = torch.softmax(s, dim=-1).view(b, h2 // 2, 2, n, m)
    w = a[:, :, 0] - lam * a[:, :, 1]
    return (w @ v).transpose(1, 2)


class _Mods(nn.Module):
    def _init_mods(self, softcap, alibi, sinks, query_heads):
        self.softcap = softcap
        self.slopes = alibi_slopes(query_heads) if alibi else None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(query_heads))
        else:
            self.sinks = None

    def mods(self):
        return dict(softcap=self.softcap, slopes=self.slopes, sinks=self.sinks)


class EagerDiffAttnV1(_Mods):
    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None, softcap=0.0, alibi=False,
                 sinks=False):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.n_rep = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads // 2
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        d = self.head_dim
        self.lambda_q1 = nn.Parameter(torch.zeros(d).normal_(mean=0, std=0.1))
        self.lambda_k1 = nn.Parameter(torch.zeros(d).normal_(mean=0, std=0.1))
        self.lambda_q2 = nn.Parameter(torch.zeros(d).normal_(mean=0, std=0.1))
        self.lambda_k2 = nn.Parameter(torch.zeros(d).normal_(mean=0, std=0.1))
        self.subln = RMSNorm(2 * d, eps=1e-5)
        self._init_mods(softcap, alibi, sinks, 2 * num_heads)

    def forward(self, x):
        b, n, e = x.shape
        d = self.head_dim
        q = rope(self.q_proj(x).view(b, n, 2 * self.num_heads, d))
        k = rope(self.k_proj(x).view(b, n, 2 * self.num_kv_heads, d))
        v = self.v_proj(x).view(b, n, self.num_kv_heads, 2 * d)
        lam = (torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1))
               - torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2)) + self.lambda_init)
        attn = eager_v1(q, k, v, lam, **self.mods())
        attn = self.subln(attn) * (1 - self.lambda_init)
        return self.out_proj(attn.reshape(b, n, 2 * self.num_heads * d))


class EagerDiffAttnV2(_Mods):
    def __init__(self, embed_dim, depth, num_heads, num_kv_heads=None, softcap=0.0, alibi=False,
                 sinks=False):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hd = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, 2 * num_heads * hd, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(num_heads * hd, embed_dim, bias=False)
        self.lambda_proj = nn.Linear(embed_dim, num_heads, bias=False)
        self._init_mods(softcap, alibi, sinks, 2 * num_heads)

    def forward(self, x):
        b, n, _ = x.shape
        hd = self.head_dim
        q = rope(self.q_proj(x).view(b, n, 2 * self.num_heads, hd))
        k = rope(self.k_proj(x).view(b, n, self.num_kv_heads, hd))
        v = self.v_proj(x).view(b, n, self.num_kv_heads, hd)
        attn = eager_v2(q, k, v, self.lambda_proj(x), **self.mods())
        return self.o_proj(attn.reshape(b, n, self.num_heads * hd))
