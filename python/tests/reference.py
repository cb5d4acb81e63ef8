"""The plain float64 numpy oracle of the tests: materialised softmax maps, the
causal mask aligned bottom-right, windows, GQA as DESIGN.md describes it."""

import numpy as np


def visible(n, m, causal=False, window_left=-1, window_right=-1):
    """(N, M) mask: query i sees key j iff c - wl <= j <= c + wr, c = i + M - N."""
    if causal:
        window_right = 0
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    c = i + (m - n)
    vis = np.ones((n, m), dtype=bool)
    if window_left >= 0:
        vis &= j >= c - window_left
    if window_right >= 0:
        vis &= j <= c + window_right
    return vis


def softmax_map(q, k, scale, vis, softcap=0.0, slope=None, sink=None):
    """A (N, M) and lse (N) of softmax(scale q k^T) over the visible keys;
    rows that see no key: zeros and -inf. Score modifiers: softcap
    (softcap tanh(s / softcap)), then an ALiBi slope (s -= slope |i + M - N - j|),
    and a sink (exp(sink) joins each row's denominator)."""
    s = scale * (q.astype(np.float64) @ k.astype(np.float64).T)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    n, m = s.shape
    if slope is not None:
        s = s - slope * np.abs(np.arange(n)[:, None] + m - n - np.arange(m)[None, :])
    s = np.where(vis, s, -np.inf)
    mx = s.max(axis=1, keepdims=True) if s.shape[1] else np.full((s.shape[0], 1), -np.inf)
    if sink is not None:
        mx = np.maximum(mx, sink)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(vis, np.exp(s - mx), 0.0)
    tot = e.sum(axis=1, keepdims=True)
    if sink is not None:
        tot = tot + np.exp(sink - mx)
    a = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(tot[:, 0] > 0, np.log(np.where(tot[:, 0] > 0, tot[:, 0], 1.0)) + mx[:, 0],
                       -np.inf)
    return a, lse


def _scale(scale, d):
    return scale if scale > 0 else 1.0 / np.sqrt(d)


def v1(q, k, v, lam, causal=False, window_left=-1, window_right=-1, scale=0.0):
    """q (B, N, 2H, d), k (B, M, 2Hkv, d), v (B, M, Hkv, 2d) -> out (B, N, H, 2d), lse (B, 2H, N)."""
    b_, n, h2, d = q.shape
    m, hkv = k.shape[1], v.shape[2]
    h = h2 // 2
    rep = h // hkv
    s = _scale(scale, d)
    vis = visible(n, m, causal, window_left, window_right)
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), (h,))
    out = np.zeros((b_, n, h, v.shape[3]))
    lse = np.zeros((b_, 2 * h, n))
    for b in range(b_):
        for hh in range(h):
            g = hh // rep
            a1, l1 = softmax_map(q[b, :, 2 * hh], k[b, :, 2 * g], s, vis)
            a2, l2 = softmax_map(q[b, :, 2 * hh + 1], k[b, :, 2 * g + 1], s, vis)
            out[b, :, hh] = (a1 - lam[hh] * a2) @ v[b, :, g].astype(np.float64)
            lse[b, 2 * hh], lse[b, 2 * hh + 1] = l1, l2
    return out, lse


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _mods(j, softcap, alibi, sinks):
    return dict(softcap=softcap, slope=None if alibi is None else float(alibi[j]),
                sink=None if sinks is None else float(sinks[j]))


def v2(q, k, v, logit, causal=False, window_left=-1, window_right=-1, scale=0.0, softcap=0.0,
       alibi=None, sinks=None):
    """q (B, N, 2H, d), k, v (B, M, Hkv, d), logit (B, N, H) -> out (B, N, H, d), lse (B, 2H, N)."""
    b_, n, h2, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    h = h2 // 2
    group = h2 // hkv
    s = _scale(scale, d)
    vis = visible(n, m, causal, window_left, window_right)
    out = np.zeros((b_, n, h, v.shape[3]))
    lse = np.zeros((b_, h2, n))
    for b in range(b_):
        for hh in range(h):
            g = 2 * hh // group
            a1, l1 = softmax_map(q[b, :, 2 * hh], k[b, :, g], s, vis,
                                 **_mods(2 * hh, softcap, alibi, sinks))
            a2, l2 = softmax_map(q[b, :, 2 * hh + 1], k[b, :, g], s, vis,
                                 **_mods(2 * hh + 1, softcap, alibi, sinks))
            lam = sigmoid(logit[b, :, hh].astype(np.float64))[:, None]
            out[b, :, hh] = (a1 - lam * a2) @ v[b, :, g].astype(np.float64)
            lse[b, 2 * hh], lse[b, 2 * hh + 1] = l1, l2
    return out, lse


def plain(q, k, v, causal=False, window_left=-1, window_right=-1, scale=0.0, softcap=0.0,
          alibi=None, sinks=None):
    """q (B, N, Hq, d), k (B, M, Hkv, d), v (B, M, Hkv, dv) -> out (B, N, Hq, dv), lse (B, Hq, N)."""
    b_, n, hq, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    s = _scale(scale, d)
    vis = visible(n, m, causal, window_left, window_right)
    out = np.zeros((b_, n, hq, v.shape[3]))
    lse = np.zeros((b_, hq, n))
    for b in range(b_):
        for j in range(hq):
            a, l_ = softmax_map(q[b, :, j], k[b, :, j // group], s, vis,
                                **_mods(j, softcap, alibi, sinks))
            out[b, :, j] = a @ v[b, :, j // group].astype(np.float64)
            lse[b, j] = l_
    return out, lse


# ---- storage formats ----------------------------------------------------------

def to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def from_bf16_bits(u):
    return (np.asarray(u).astype(np.uint32) << 16).view(np.float32)


def from_e4m3_bits(u):
    u = np.asarray(u).astype(np.int64)
    sign = np.where(u & 0x80, -1.0, 1.0)
    e = (u >> 3) & 0xF
    mant = u & 7
    val = np.where(e == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (e - 7))
    val = np.where((u & 0x7F) == 0x7F, np.nan, val)
    return sign * val


def grad_magnitudes(kind, q, k, v, lam, dout, vis, scale=0.0, sinks=None):
    """For the bf16 backward's gradient products (detail/backward/bf16_backward.hpp), which
    round each element of dS_m and W to bfloat16: per element of dq, dk and dv the sum m of
    the magnitudes of its product's terms, s sum_j |dS_ij| |k_jc| (dq), s sum_i |dS_ij| |q_ic|
    (dk, over the maps and query heads a key head serves) and sum_i |w_ij| |do_ic| (dv), so
    that the rounding adds at most 2^-8 m. kind "v1", "v2" or "plain"; lam: V1's lambda
    (a scalar or one per head), V2's logits (B, N, H); sinks: one per query head or None
    (the sink joins each map's denominator, as in softmax_map)."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    b_, n, hq, d = q.shape
    h = dout.shape[2]
    hkv = v.shape[2]
    group = h // hkv
    s = _scale(scale, d)
    maps = 1 if kind == "plain" else 2
    mq, mk, mv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(b_):
        for oh in range(h):
            hv = oh // group
            dw = dout[b, :, oh] @ v[b, :, hv].T  # (N, M)
            if kind == "v2":
                lam_i = sigmoid(np.asarray(lam, np.float64)[b, :, oh])
            elif kind == "v1":
                lam_i = np.full(n, float(np.asarray(lam).reshape(-1)[oh if np.ndim(lam) else 0]))
            w = np.zeros_like(dw)
            for m in range(maps):
                qh = oh if maps == 1 else 2 * oh + m
                kh = 2 * hv + m if kind == "v1" else hv
                sink = None if sinks is None else float(sinks[qh])
                a, _ = softmax_map(q[b, :, qh], k[b, :, kh], s, vis, sink=sink)
                coef = np.ones(n) if m == 0 else -lam_i
                ds = np.abs(coef[:, None] * a * (dw - (a * dw).sum(axis=1, keepdims=True)))
                w += coef[:, None] * a
                mq[b, :, qh] += s * ds @ np.abs(k[b, :, kh])
                mk[b, :, kh] += s * ds.T @ np.abs(q[b, :, qh])
            mv[b, :, hv] += np.abs(w).T @ np.abs(dout[b, :, oh])
    return mq, mk, mv
