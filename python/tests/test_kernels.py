"""The module's kernels against the float64 numpy reference (reference.py)."""

import threading

import numpy as np
import pytest

import diffattn
import reference as ref

RNG = np.random.default_rng(7)


def rand(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


def tol(dtype):
    return 1e-12 if dtype == np.float64 else 2e-5


def close(a, b, dtype, scale=1.0):
    b = np.asarray(b, dtype=np.float64)
    err = np.max(np.abs(np.asarray(a, dtype=np.float64) - b), initial=0.0)
    assert err <= tol(dtype) * scale * max(1.0, np.max(np.abs(b), initial=0.0)), err


def finite_lse_close(a, b, dtype):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.array_equal(np.isneginf(a), np.isneginf(b))
    m = np.isfinite(b)
    close(a[m], b[m], dtype)


# (N, M, causal, window_left): N != M both ways (N > M causal leaves rows with no key)
CASES = [(7, 13, True, -1), (13, 7, True, -1), (9, 9, False, -1), (11, 17, True, 3)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m,causal,wl", CASES)
def test_v1_scalar_and_per_head(dtype, n, m, causal, wl):
    h, hkv, d = 4, 2, 8  # GQA: 2 DIFF heads per kv pair
    q, k, v = rand(2, n, 2 * h, d, dtype=dtype), rand(2, m, 2 * hkv, d, dtype=dtype), \
        rand(2, m, hkv, 2 * d, dtype=dtype)
    for lam in (0.8, np.array([0.1, 0.5, 0.9, 1.3], dtype=dtype)):
        out, lse = diffattn.diff_attention_v1(q, k, v, lam, causal=causal, window_left=wl)
        want, want_lse = ref.v1(q, k, v, lam, causal=causal, window_left=wl)
        assert out.dtype == dtype and out.shape == (2, n, h, 2 * d) and lse.shape == (2, 2 * h, n)
        close(out, want, dtype)
        finite_lse_close(lse, want_lse, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m,causal,wl", CASES)
def test_v2_and_plain(dtype, n, m, causal, wl):
    h, hkv, d = 4, 2, 8  # V2: 8 query heads on 2 kv heads (groups of 4)
    q, k, v = rand(1, n, 2 * h, d, dtype=dtype), rand(1, m, hkv, d, dtype=dtype), \
        rand(1, m, hkv, d, dtype=dtype)
    logit = rand(1, n, h, dtype=dtype)
    out, lse = diffattn.diff_attention_v2(q, k, v, logit, causal=causal, window_left=wl)
    want, want_lse = ref.v2(q, k, v, logit, causal=causal, window_left=wl)
    close(out, want, dtype)
    finite_lse_close(lse, want_lse, dtype)
    out, lse = diffattn.attention(q, k, v, causal=causal, window_left=wl, scale=0.3)
    want, want_lse = ref.plain(q, k, v, causal=causal, window_left=wl, scale=0.3)
    close(out, want, dtype)
    finite_lse_close(lse, want_lse, dtype)


def test_16bit_storage():
    h, hkv, d, n = 2, 1, 16, 20
    q32, k32, v32 = rand(1, n, 2 * h, d, dtype=np.float32), rand(1, n, hkv, d, dtype=np.float32), \
        rand(1, n, hkv, d, dtype=np.float32)
    logit = rand(1, n, h, dtype=np.float32)
    # bfloat16 as its uint16 bits: the kernel widens them exactly
    qb, kb, vb, lb = (ref.to_bf16_bits(t) for t in (q32, k32, v32, logit))
    out, lse = diffattn.diff_attention_v2(qb, kb, vb, lb, causal=True)
    assert out.dtype == np.uint16 and lse.dtype == np.float32
    want, _ = ref.v2(*(ref.from_bf16_bits(t) for t in (qb, kb, vb, lb)), causal=True)
    assert np.max(np.abs(ref.from_bf16_bits(out) - want)) <= 2 ** -7 * np.max(np.abs(want))
    qh, kh, vh, lh = (t.astype(np.float16) for t in (q32, k32, v32, logit))
    out, _ = diffattn.diff_attention_v2(qh, kh, vh, lh, causal=True)
    want, _ = ref.v2(qh, kh, vh, lh, causal=True)
    assert out.dtype == np.float16
    assert np.max(np.abs(out - want)) <= 2 ** -9 * np.max(np.abs(want))


def loss_grad_check(fn_ref, args, grads, names, eps=1e-6, seed=0):
    """Directional derivatives of L = sum(G * out_ref(args)) against the kernel's gradients."""
    rng = np.random.default_rng(seed)
    out, _ = fn_ref(*args)
    g = rng.standard_normal(out.shape)
    for idx, name in names:
        u = rng.standard_normal(np.shape(args[idx]))
        plus = list(args)
        minus = list(args)
        plus[idx] = args[idx] + eps * u
        minus[idx] = args[idx] - eps * u
        num = (np.sum(g * fn_ref(*plus)[0]) - np.sum(g * fn_ref(*minus)[0])) / (2 * eps)
        ana = np.sum(np.asarray(grads[name]) * u)
        assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)), (name, num, ana)
    return g


@pytest.mark.parametrize("n,m", [(6, 10), (10, 6)])
def test_backward_against_reference(n, m):
    h, hkv, d = 4, 2, 4
    q, k, v = rand(1, n, 2 * h, d), rand(1, m, 2 * hkv, d), rand(1, m, hkv, 2 * d)
    for lam in (0.7, np.array([0.2, 0.4, 0.6, 0.8])):
        out, lse = diffattn.diff_attention_v1(q, k, v, lam, causal=True)
        g = np.random.default_rng(0).standard_normal(out.shape)
        dq, dk, dv, dl = diffattn.diff_attention_v1_backward(q, k, v, lam, out, lse, g, causal=True)
        assert np.shape(dl) == np.shape(lam)
        loss_grad_check(lambda q_, k_, v_, l_: ref.v1(q_, k_, v_, l_, causal=True),
                        (q, k, v, np.asarray(lam, dtype=np.float64)),
                        {"q": dq, "k": dk, "v": dv, "l": dl},
                        [(0, "q"), (1, "k"), (2, "v"), (3, "l")])
    kv2 = rand(1, m, hkv, d), rand(1, m, hkv, d)
    logit = rand(1, n, h)
    out, lse = diffattn.diff_attention_v2(q, *kv2, logit, causal=True)
    g = np.random.default_rng(0).standard_normal(out.shape)
    dq, dk, dv, dlog = diffattn.diff_attention_v2_backward(q, *kv2, logit, out, lse, g, causal=True)
    loss_grad_check(lambda q_, k_, v_, l_: ref.v2(q_, k_, v_, l_, causal=True),
                    (q, kv2[0], kv2[1], logit), {"q": dq, "k": dk, "v": dv, "l": dlog},
                    [(0, "q"), (1, "k"), (2, "v"), (3, "l")])
    out, lse = diffattn.attention(q, *kv2, causal=True)
    g = np.random.default_rng(0).standard_normal(out.shape)
    dq, dk, dv = diffattn.attention_backward(q, *kv2, out, lse, g, causal=True)
    loss_grad_check(lambda q_, k_, v_: ref.plain(q_, k_, v_, causal=True), (q, kv2[0], kv2[1]),
                    {"q": dq, "k": dk, "v": dv}, [(0, "q"), (1, "k"), (2, "v")])


# 16-bit storage: the storage type as numpy holds it, its unit roundoff, to / from float
STORAGE16 = {
    "bfloat16": (2.0 ** -8, ref.to_bf16_bits, lambda a: ref.from_bf16_bits(a).astype(np.float64)),
    "float16": (2.0 ** -11, lambda a: np.asarray(a, np.float32).astype(np.float16),
                lambda a: np.asarray(a, np.float64)),
}


def rel_err(a, b):
    b = np.asarray(b, np.float64)
    return np.max(np.abs(np.asarray(a, np.float64) - b), initial=0.0) / \
        max(np.max(np.abs(b), initial=0.0), 1e-300)


def check16(g16, g32, g64, u, rounded=True):
    """tests/test_half_backward.cpp's bound: with e_f the float path's error (at most twice
    the float32 kernel's measured error, or 5e-5, relative to max |reference|), a gradient
    stored in 16 bits is within u (1 + e_f) + e_f; a float one (dlambda) within e_f."""
    e_f = max(2 * rel_err(g32, g64), 5e-5)
    if not rounded:  # dlambda: relative to max(1, max |reference|)
        scale = max(1.0, np.max(np.abs(np.asarray(g64, np.float64))))
        err = np.max(np.abs(np.asarray(g16, np.float64) - g64)) / scale
        assert err <= e_f, (err, e_f)
        return
    err = rel_err(g16, g64)
    assert err <= u * (1 + e_f) + e_f, (err, u, e_f)


def bf16_products():
    """The variant that runs has the bf16 backward's gradient products (dS and W rounded)."""
    return "bf16" in diffattn.isa()


def check16_elementwise(g16, g32, g64, mag):
    """tests/test_half_backward.cpp's bound for the bf16 gradient products: dS and W rounded
    to bfloat16 add at most 2^-8 mag to each element (reference.grad_magnitudes), so
    |g - y| <= u (|y| + delta) + delta, delta = e_f max |y| + 2^-8 (1 + 2^-6) mag."""
    u = 2.0 ** -8
    y = np.asarray(g64, np.float64)
    e_f = max(2 * rel_err(g32, g64), 5e-5)
    delta = e_f * np.max(np.abs(y)) + 2.0 ** -8 * (1 + 2.0 ** -6) * mag
    err = np.abs(np.asarray(g16, np.float64) - y)
    assert np.all(err <= u * (np.abs(y) + delta) + delta), np.max(err / (u * (np.abs(y) + delta) + delta))


def check_grads16(kind, g16, g32, g64, u, wide, mags):
    """dq, dk, dv: check16, or the elementwise bound where bfloat16 takes the bf16 products."""
    for i in range(3):
        if kind == "bfloat16" and bf16_products():
            check16_elementwise(wide(g16[i]), g32[i], g64[i], mags[i])
        else:
            check16(wide(g16[i]), g32[i], g64[i], u)


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
@pytest.mark.parametrize("n,m,causal,wl", CASES)
def test_backward_16bit_storage(kind, n, m, causal, wl):
    u, to16, wide = STORAGE16[kind]
    h, hkv, d = 4, 2, 8  # GQA
    rng = np.random.default_rng(n * 100 + m)

    def r16(*shape):
        return to16(rng.standard_normal(shape).astype(np.float32))

    kw = dict(causal=causal, window_left=wl)
    vis = ref.visible(n, m, causal, wl)
    q = r16(2, n, 2 * h, d)
    k1, v1 = r16(2, m, 2 * hkv, d), r16(2, m, hkv, 2 * d)
    k2, v2, logit = r16(2, m, hkv, d), r16(2, m, hkv, d), r16(2, n, h)

    def three(call, args16, out, lse, dout, wide_args):
        """The backward on the 16-bit arrays, then on float32 and float64 copies of the same
        values (and of the forward's 16-bit out, its float32 lse and the 16-bit dout): the
        float64 kernel is the reference (test_backward_against_reference holds it to the
        numpy reference's finite differences)."""
        g16 = call(*args16, out, lse, dout)
        res = [g16]
        for t in (np.float32, np.float64):
            conv = [wide(a).astype(t) if w else a for a, w in zip(args16, wide_args)]
            res.append(call(*conv, wide(out).astype(t), lse.astype(t), wide(dout).astype(t)))
        return res

    # V1, one lambda and one per head (lambda_, dlambda float32)
    for lam in (0.8, np.array([0.1, 0.5, 0.9, 1.3], np.float32)):
        out, lse = diffattn.diff_attention_v1(q, k1, v1, lam, **kw)
        assert lse.dtype == np.float32
        dout = r16(*out.shape)
        g16, g32, g64 = three(
            lambda q_, k_, v_, l_, o_, s_, g_: diffattn.diff_attention_v1_backward(
                q_, k_, v_, l_, o_, s_, g_, **kw), (q, k1, v1, lam), out, lse, dout,
            (True, True, True, False))
        for i, like in enumerate((q, k1, v1)):
            assert g16[i].dtype == like.dtype and g16[i].shape == like.shape
        check_grads16(kind, g16, g32, g64, u, wide, ref.grad_magnitudes(
            "v1", wide(q), wide(k1), wide(v1), lam, wide(dout), vis) if kind == "bfloat16" else None)
        assert np.shape(g16[3]) == np.shape(lam)
        if np.ndim(lam):
            assert g16[3].dtype == np.float32
        check16(g16[3], g32[3], g64[3], u, rounded=False)
    # V2 (dlambda_logit in the storage type) and plain attention
    out, lse = diffattn.diff_attention_v2(q, k2, v2, logit, **kw)
    dout = r16(*out.shape)
    g16, g32, g64 = three(
        lambda q_, k_, v_, l_, o_, s_, g_: diffattn.diff_attention_v2_backward(
            q_, k_, v_, l_, o_, s_, g_, **kw), (q, k2, v2, logit), out, lse, dout,
        (True, True, True, True))
    for i, like in enumerate((q, k2, v2, logit)):
        assert g16[i].dtype == like.dtype and g16[i].shape == like.shape
    check_grads16(kind, g16, g32, g64, u, wide, ref.grad_magnitudes(
        "v2", wide(q), wide(k2), wide(v2), wide(logit), wide(dout), vis)
        if kind == "bfloat16" else None)
    check16(wide(g16[3]), g32[3], g64[3], u)
    out, lse = diffattn.attention(q, k2, v2, scale=0.3, **kw)
    dout = r16(*out.shape)
    g16, g32, g64 = three(
        lambda q_, k_, v_, o_, s_, g_: diffattn.attention_backward(
            q_, k_, v_, o_, s_, g_, scale=0.3, **kw), (q, k2, v2), out, lse, dout,
        (True, True, True))
    for i, like in enumerate((q, k2, v2)):
        assert g16[i].dtype == like.dtype
    check_grads16(kind, g16, g32, g64, u, wide, ref.grad_magnitudes(
        "plain", wide(q), wide(k2), wide(v2), None, wide(dout), vis, scale=0.3)
        if kind == "bfloat16" else None)


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_varlen_backward_16bit_storage(kind):
    u, to16, wide = STORAGE16[kind]
    rng = np.random.default_rng(5)
    seqs = diffattn.PackedSequences.from_lengths([5, 0, 11, 3])
    t, h, hkv, d = 19, 2, 1, 8
    q, k, v = (to16(rng.standard_normal(s).astype(np.float32))
               for s in ((t, 2 * h, d), (t, 2 * hkv, d), (t, hkv, 2 * d)))
    logit = to16(rng.standard_normal((t, h)).astype(np.float32))
    kv2 = k[:, :1], v[:, :, :d]
    for name, fwd, bwd, args, lam_index in (
            ("v1", diffattn.diff_attention_v1_varlen, diffattn.diff_attention_v1_varlen_backward,
             (q, k, v, 0.5), 3),
            ("v2", diffattn.diff_attention_v2_varlen, diffattn.diff_attention_v2_varlen_backward,
             (q, *kv2, logit), None),
            ("plain", diffattn.attention_varlen, diffattn.attention_varlen_backward,
             (q, *kv2), None)):
        out, lse = fwd(*args, seqs, causal=True)
        dout = to16(rng.standard_normal(out.shape).astype(np.float32))
        g16 = bwd(*args, out, lse, dout, seqs, causal=True)
        res = []
        for tp in (np.float32, np.float64):
            conv = [a if i == lam_index else wide(a).astype(tp) for i, a in enumerate(args)]
            res.append(bwd(*conv, wide(out).astype(tp), lse.astype(tp), wide(dout).astype(tp),
                           seqs, causal=True))
        mags = None
        if kind == "bfloat16" and bf16_products():  # per sequence, rows of the packed arrays
            mags = [np.zeros(a.shape) for a in g16[:3]]
            cu = seqs.cu_seqlens_q
            for a, e in zip(cu[:-1], cu[1:]):
                lam = args[3] if name == "v1" else (wide(args[3])[None, a:e] if name == "v2" else None)
                sub = ref.grad_magnitudes(name, *(wide(x)[None, a:e] for x in args[:3]), lam,
                                          wide(dout)[None, a:e], ref.visible(e - a, e - a, True))
                for mg, sm in zip(mags, sub):
                    mg[a:e] = sm[0]
        for i in range(len(g16)):
            if i == lam_index:
                check16(g16[i], res[0][i], res[1][i], u, rounded=False)
            else:
                assert g16[i].dtype == args[i].dtype, name
                if mags is not None and i < 3:
                    check16_elementwise(wide(g16[i]), res[0][i], res[1][i], mags[i])
                else:
                    check16(wide(g16[i]), res[0][i], res[1][i], u)


def test_backward_16bit_refuses_mixed_storage():
    q = np.zeros((1, 4, 2, 8), np.float16)
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="diff_attention_v2_backward: k has dtype float32"):
        diffattn.diff_attention_v2_backward(q, q[:, :, :1].astype(np.float32), q[:, :, :1],
                                            q[..., 0], q[:, :, :1], lse, q[:, :, :1])
    with pytest.raises(ValueError, match="diff_attention_v2_backward: lse has dtype float16"):
        diffattn.diff_attention_v2_backward(q, q[:, :, :1], q[:, :, :1], q[..., 0], q[:, :, :1],
                                            lse.astype(np.float16), q[:, :, :1])
    with pytest.raises(ValueError, match="attention_backward: q has dtype int8"):
        diffattn.attention_backward(q.astype(np.int8), q, q, q, lse, q)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kvcache_contiguous_and_paged(dtype):
    b, cap, h, hkv, d, n = 3, 40, 4, 2, 8, 2
    lens = np.array([40, 17, 2])
    q = rand(b, n, 2 * h, d, dtype=dtype)
    logit = rand(b, n, h, dtype=dtype)
    kc, vc = rand(b, cap, hkv, d, dtype=dtype), rand(b, cap, hkv, d, dtype=dtype)
    k1, v1 = rand(b, cap, 2 * hkv, d, dtype=dtype), rand(b, cap, hkv, 2 * d, dtype=dtype)
    out2, lse2 = diffattn.diff_attention_v2_kvcache(q, kc, vc, logit, lens, causal=True)
    outp, _ = diffattn.attention_kvcache(q, kc, vc, lens, causal=True, split_keys=8)
    out1, _ = diffattn.diff_attention_v1_kvcache(q, k1, v1, 0.6, lens, causal=True)
    for i, m in enumerate(lens):
        s = slice(i, i + 1)
        close(out2[s], ref.v2(q[s], kc[s, :m], vc[s, :m], logit[s], causal=True)[0], dtype)
        close(outp[s], ref.plain(q[s], kc[s, :m], vc[s, :m], causal=True)[0], dtype)
        close(out1[s], ref.v1(q[s], k1[s, :m], v1[s, :m], 0.6, causal=True)[0], dtype)
    # paged: the same rows in blocks of 8, scattered over a pool
    bs, nb = 8, cap // 8
    perm = RNG.permutation(b * nb)
    table = perm.reshape(b, nb)
    kpool = np.zeros((b * nb, bs, hkv, d), dtype)
    vpool = np.zeros_like(kpool)
    for i in range(b):
        for j in range(nb):
            kpool[table[i, j]] = kc[i, j * bs:(j + 1) * bs]
            vpool[table[i, j]] = vc[i, j * bs:(j + 1) * bs]
    outg, lseg = diffattn.diff_attention_v2_kvcache(q, kpool, vpool, logit, lens, block_table=table,
                                                    causal=True)
    close(outg, out2, dtype)


@pytest.mark.parametrize("kind", ["bfloat16", "float16", "int8", "float8_e4m3"])
def test_kvcache_low_precision(kind):
    b, cap, h, hkv, d, n = 2, 24, 2, 1, 16, 1
    lens = np.array([24, 9])
    q = rand(b, n, 2 * h, d, dtype=np.float32)
    logit = rand(b, n, h, dtype=np.float32)
    k, v = rand(b, cap, hkv, d, dtype=np.float32), rand(b, cap, hkv, d, dtype=np.float32)
    extra = {}
    if kind == "bfloat16":
        kc, vc = ref.to_bf16_bits(k), ref.to_bf16_bits(v)
        kd, vd = ref.from_bf16_bits(kc), ref.from_bf16_bits(vc)
    elif kind == "float16":
        kc, vc = k.astype(np.float16), v.astype(np.float16)
        kd, vd = kc, vc
    else:
        kc, ks = diffattn.quantize_rows(k, kind)
        vc, vs = diffattn.quantize_rows(v, kind)
        assert ks.shape == (b, cap, hkv) and ks.dtype == np.float32
        dec = (lambda t: t.astype(np.float64)) if kind == "int8" else ref.from_e4m3_bits
        kd, vd = dec(kc) * ks[..., None], dec(vc) * vs[..., None]
        bound = 1 / 254 if kind == "int8" else 2 ** -4
        assert np.max(np.abs(kd - k)) <= bound * np.max(np.abs(k)) * 1.0001
        extra = dict(k_scale=ks, v_scale=vs)
    out, _ = diffattn.diff_attention_v2_kvcache(q, kc, vc, logit, lens, causal=True, **extra)
    assert out.dtype == np.float32
    for i, m in enumerate(lens):
        s = slice(i, i + 1)
        close(out[s], ref.v2(q[s], kd[s, :m], vd[s, :m], logit[s], causal=True)[0], np.float32,
              scale=4)


def test_kvcache_refuses_bad_pairs_and_scales():
    q = np.zeros((1, 1, 2, 8), np.float64)
    k8 = np.zeros((1, 4, 1, 8), np.int8)
    with pytest.raises(ValueError, match="no kernel for q of dtype float64 over a cache of dtype int8"):
        diffattn.attention_kvcache(q, k8, k8, [4])
    q = q.astype(np.float32)
    with pytest.raises(ValueError, match="attention_kvcache: k_scale is missing"):
        diffattn.attention_kvcache(q, k8, k8, [4])
    # lengths, tables and offsets must be integers: a float or bool array would be truncated
    kf = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="cache_seqlens has dtype float64, expected integers"):
        diffattn.attention_kvcache(q, kf, kf, np.array([3.5]))
    with pytest.raises(ValueError, match="cache_seqlens has dtype bool, expected integers"):
        diffattn.attention_kvcache(q, kf, kf, np.array([True]))
    with pytest.raises(ValueError, match="block_table has dtype float32, expected integers"):
        diffattn.attention_kvcache(q, kf, kf, [3], block_table=np.zeros((1, 1), np.float32))
    with pytest.raises(ValueError, match="cu_seqlens_q has dtype float64, expected integers"):
        diffattn.attention_varlen(q[0], kf[0], kf[0], np.array([0.0, 1.0]))
    for lens in ([3], np.array([3], np.uint8), np.array([3], np.int16)):
        out, _ = diffattn.attention_kvcache(q, kf, kf, lens)
        assert out.shape == q.shape


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_varlen(dtype):
    lengths = [5, 0, 11, 3]
    seqs = diffattn.PackedSequences.from_lengths(lengths)
    assert seqs.cu_seqlens_q == [0, 5, 5, 16, 19] and seqs.size() == 4
    t, h, hkv, d = 19, 2, 1, 8
    q, k, v = rand(t, 2 * h, d, dtype=dtype), rand(t, 2 * hkv, d, dtype=dtype), \
        rand(t, hkv, 2 * d, dtype=dtype)
    logit = rand(t, h, dtype=dtype)
    out1, lse1 = diffattn.diff_attention_v1_varlen(q, k, v, 0.5, seqs, causal=True)
    kv2 = k[:, :1], v[:, :, :d]
    out2, lse2 = diffattn.diff_attention_v2_varlen(q, *kv2, logit, seqs.cu_seqlens_q, causal=True)
    outp, lsep = diffattn.attention_varlen(q, *kv2, np.array(seqs.cu_seqlens_q), causal=True)
    cu = seqs.cu_seqlens_q
    for s in range(4):
        r = slice(cu[s], cu[s + 1])
        if cu[s] == cu[s + 1]:
            continue
        close(out1[r], ref.v1(q[None, r], k[None, r], v[None, r], 0.5, causal=True)[0][0], dtype)
        close(out2[r], ref.v2(q[None, r], kv2[0][None, r], kv2[1][None, r], logit[None, r],
                              causal=True)[0][0], dtype)
        close(outp[r], ref.plain(q[None, r], kv2[0][None, r], kv2[1][None, r], causal=True)[0][0],
              dtype)
    # backward: a packed call equals one call per sequence
    g = rand(*out1.shape, dtype=dtype)
    dq, dk, dv, dl = diffattn.diff_attention_v1_varlen_backward(q, k, v, 0.5, out1, lse1, g, seqs,
                                                                causal=True)
    g2 = rand(*out2.shape, dtype=dtype)
    dq2, dk2, dv2, dlog = diffattn.diff_attention_v2_varlen_backward(q, *kv2, logit, out2, lse2, g2,
                                                                     seqs, causal=True)
    dqp, dkp, dvp = diffattn.attention_varlen_backward(q, *kv2, outp, lsep,
                                                       rand(*outp.shape, dtype=dtype), seqs,
                                                       causal=True)
    assert dqp.shape == q.shape and dkp.shape == kv2[0].shape
    total = 0.0
    for s in range(4):
        r = slice(cu[s], cu[s + 1])
        if cu[s] == cu[s + 1]:
            continue
        o, l_ = diffattn.diff_attention_v1(q[None, r], k[None, r], v[None, r], 0.5, causal=True)
        a = diffattn.diff_attention_v1_backward(q[None, r], k[None, r], v[None, r], 0.5, o, l_,
                                                g[None, r], causal=True)
        close(dq[r], a[0][0], dtype)
        close(dk[r], a[1][0], dtype)
        close(dv[r], a[2][0], dtype)
        total += a[3]
        o, l_ = diffattn.diff_attention_v2(q[None, r], kv2[0][None, r], kv2[1][None, r],
                                           logit[None, r], causal=True)
        a = diffattn.diff_attention_v2_backward(q[None, r], kv2[0][None, r], kv2[1][None, r],
                                                logit[None, r], o, l_, g2[None, r], causal=True)
        close(dq2[r], a[0][0], dtype)
        close(dlog[r], a[3][0], dtype)
    assert abs(dl - total) <= tol(dtype) * 10 * max(1.0, abs(total))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_states(dtype):
    n, m, hq, d = 5, 20, 3, 8
    q, k, v = rand(1, n, hq, d, dtype=dtype), rand(1, m, hq, d, dtype=dtype), \
        rand(1, m, hq, d, dtype=dtype)
    full, lse_full = diffattn.attention(q, k, v)
    oa, la = diffattn.attention(q, k[:, :7], v[:, :7])
    ob, lb = diffattn.attention(q, k[:, 7:], v[:, 7:])
    o, l_ = diffattn.merge_states(oa, la, ob, lb)
    assert o is oa and l_ is la  # in place
    close(oa, full, dtype, scale=4)
    close(la, lse_full, dtype, scale=4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_diff_weights(dtype):
    n, m, d = 5, 8, 4
    q1, k1, q2, k2 = rand(n, d, dtype=dtype), rand(m, d, dtype=dtype), rand(n, d, dtype=dtype), \
        rand(m, d, dtype=dtype)
    w, l1, l2 = diffattn.diff_weights(q1, k1, q2, k2, 0.8, causal=True, return_lse=True)
    vis = ref.visible(n, m, causal=True)
    a1, r1 = ref.softmax_map(q1, k1, 1 / np.sqrt(d), vis)
    a2, r2 = ref.softmax_map(q2, k2, 1 / np.sqrt(d), vis)
    close(w, a1 - 0.8 * a2, dtype)
    close(l1, r1, dtype)
    np.testing.assert_allclose(w.sum(axis=1), 0.2, atol=1e-5)
    # rows with a stride (every other row of a bigger array)
    big = np.repeat(q1, 2, axis=0)
    close(diffattn.diff_weights(big[::2], k1, q2, k2, 0.8, causal=True), w, dtype)


def test_quantize_rows_ranks():
    x = rand(3, 4, 8, dtype=np.float32)
    q, s = diffattn.quantize_rows(x, "int8")
    assert q.dtype == np.int8 and s.shape == (3, 4)
    np.testing.assert_allclose(s, np.abs(x).max(axis=-1) / 127, rtol=1e-6)
    e, se = diffattn.quantize_rows(x[0], "float8_e4m3")
    assert e.dtype == np.uint8 and se.shape == (4,)
    with pytest.raises(ValueError, match="quantize_rows: src .* holds nan"):
        bad = x.copy()
        bad[1, 2, 3] = np.nan
        diffattn.quantize_rows(bad)


# ---- zero copy, strides, out= ------------------------------------------------------

def test_strided_inputs_and_out():
    b, n, h, d = 2, 9, 2, 8
    # (B, H, N, D) memory seen as (B, N, H, D): passed by strides, not copied
    qm, km, vm = rand(b, 2 * h, n, d), rand(b, 2 * h, n, d), rand(b, h, n, 2 * d)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (qm, km, vm))
    assert not q.flags.c_contiguous
    out = np.empty((b, n, h, 2 * d))
    lse = np.empty((b, 2 * h, n))
    o, l_ = diffattn.diff_attention_v1(q, k, v, 0.5, causal=True, out=out, lse=lse)
    assert o is out and l_ is lse
    assert o.__array_interface__["data"][0] == out.__array_interface__["data"][0]
    close(out, ref.v1(q, k, v, 0.5, causal=True)[0], np.float64)
    # a strided output (every other head of a wider buffer) is written in place
    wide = np.zeros((b, n, 2 * h, 2 * d))
    diffattn.diff_attention_v1(q, k, v, 0.5, causal=True, out=wide[:, :, ::2])
    close(wide[:, :, ::2], out, np.float64)
    assert np.all(wide[:, :, 1::2] == 0)


def test_inputs_are_not_copied():
    # out overlapping an input is refused: the kernel sees the caller's memory itself
    q = rand(1, 6, 2, 8)
    with pytest.raises(ValueError, match="overlap"):
        diffattn.diff_attention_v2(q, q[:, :, :1], q[:, :, 1:], np.zeros((1, 6, 1)), out=q[:, :, :1])


def test_empty_batches_and_sequences():
    # numpy may give an empty array zero strides; no element is read, so none is refused
    z = lambda *s: np.zeros(s)  # noqa: E731
    out, lse = diffattn.diff_attention_v2(z(1, 0, 4, 8), z(1, 5, 2, 8), z(1, 5, 2, 8), z(1, 0, 2))
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 4, 0)
    out, lse = diffattn.attention(z(0, 3, 4, 8), z(0, 5, 2, 8), z(0, 5, 2, 8))
    assert out.shape == (0, 3, 4, 8) and lse.shape == (0, 4, 3)
    # no key: every row sees none, so out is 0 and lse -inf, as in C++
    out, lse = diffattn.diff_attention_v1(rand(1, 3, 4, 8), z(1, 0, 4, 8), z(1, 0, 2, 16), 0.5)
    assert out.shape == (1, 3, 2, 16) and np.all(out == 0) and np.all(np.isneginf(lse))
    # no query: the key and value gradients are zero
    q, k, v = z(1, 0, 4, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    o, lse = diffattn.attention(q, k, v)
    dq, dk, dv = diffattn.attention_backward(q, k, v, o, lse, z(1, 0, 4, 8))
    assert dq.shape == q.shape and np.all(dk == 0) and np.all(dv == 0)
    dst, scale = diffattn.quantize_rows(np.zeros((0, 3, 8), np.float32))
    assert dst.shape == (0, 3, 8) and scale.shape == (0, 3)
    out, lse = diffattn.attention_kvcache(z(0, 1, 4, 8), z(0, 5, 2, 8), z(0, 5, 2, 8),
                                          np.zeros(0, np.int32))
    assert out.shape == (0, 1, 4, 8)


def test_errors_carry_the_cpp_message():
    q, k, v = rand(1, 4, 4, 8), rand(1, 4, 3, 8), rand(1, 4, 1, 16)
    with pytest.raises(diffattn.Error) as e:
        diffattn.diff_attention_v1(q, k, v, 0.5)
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith("diff_attention_v1: k ")
    assert "(1, 4, 3, 8)" in str(e.value)
    with pytest.raises(ValueError, match="diff_attention_v1: .*lambda"):
        diffattn.diff_attention_v1(q, rand(1, 4, 2, 8), v, float("nan"))
    with pytest.raises(ValueError, match="causal"):
        diffattn.attention(q, q, q, causal=True, window_right=2)
    with pytest.raises(ValueError, match="contiguous"):
        diffattn.attention(q[..., ::2], q[..., ::2], q[..., ::2])
    with pytest.raises(ValueError, match="attention: q has 3 dimensions, expected 4"):
        diffattn.attention(q[0], q, q)
    with pytest.raises(ValueError, match="attention: k has dtype float32, expected float64"):
        diffattn.attention(q, q.astype(np.float32), q)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((1, 4, 4, 8))
        ro.flags.writeable = False
        diffattn.attention(q, q, q, out=ro)


def test_threads_and_gil():
    q, k, v = rand(1, 64, 4, 16), rand(1, 64, 2, 16), rand(1, 64, 2, 16)
    logit = rand(1, 64, 2)
    want, _ = diffattn.diff_attention_v2(q, k, v, logit, causal=True, num_threads=1)
    results = [None] * 4

    def run(i):
        results[i] = diffattn.diff_attention_v2(q, k, v, logit, causal=True, num_threads=2)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert np.array_equal(r, want)  # bitwise for any thread count


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_score_modifiers(dtype):
    n, m, h, hkv, d = 7, 12, 2, 1, 8
    q, k, v = rand(1, n, 2 * h, d, dtype=dtype), rand(1, m, hkv, d, dtype=dtype), \
        rand(1, m, hkv, d, dtype=dtype)
    logit = rand(1, n, h, dtype=dtype)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    sinks = np.array([0.25, -1.0, 2.0, 0.0])  # float32 values: the options hold float32
    mods = dict(softcap=5.0, alibi_slopes=slopes, sinks=sinks)
    out, lse = diffattn.attention(q, k, v, causal=True, **mods)
    want, want_lse = ref.plain(q, k, v, causal=True, softcap=5.0, alibi=slopes, sinks=sinks)
    close(out, want, dtype, scale=4)
    close(lse, want_lse, dtype, scale=4)
    out, lse = diffattn.diff_attention_v2(q, k, v, logit, causal=True, **mods)
    want, _ = ref.v2(q, k, v, logit, causal=True, softcap=5.0, alibi=slopes, sinks=sinks)
    close(out, want, dtype, scale=4)
    if dtype == np.float64:  # dsinks against finite differences of the reference
        g = np.random.default_rng(1).standard_normal(out.shape)
        dsinks = np.zeros(4)
        diffattn.diff_attention_v2_backward(q, k, v, logit, out, lse, g, causal=True, dsinks=dsinks,
                                            **mods)
        u = np.random.default_rng(2).standard_normal(4)
        eps = 1e-6
        f = lambda sk: np.sum(g * ref.v2(q, k, v, logit, causal=True, softcap=5.0, alibi=slopes,
                                         sinks=sk)[0])
        num = (f(sinks + eps * u) - f(sinks - eps * u)) / (2 * eps)
        assert abs(num - np.sum(dsinks * u)) <= 1e-6 * max(1, abs(num))
    with pytest.raises(ValueError, match="sinks"):
        diffattn.attention(q, k, v, sinks=np.zeros(3))


def test_isa():
    assert diffattn.isa() in diffattn.isa_variants()
    assert diffattn.isa() != "native"  # the module runs the dispatch library
    assert abs(diffattn.lambda_init(3) - (0.8 - 0.6 * np.exp(-0.9))) < 1e-15


def _attention_in_child(args):
    q, threads = args
    return diffattn.attention(q, q, q, causal=True, num_threads=threads)[0]


def test_forked_processes_after_a_two_thread_call():
    # multiprocessing forks by default on Linux; GNU OpenMP would make the
    # children's two-thread calls wait forever for the parent's team
    import multiprocessing

    q = rand(1, 300, 4, 32).astype(np.float32)
    want, _ = diffattn.attention(q, q, q, causal=True, num_threads=2)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.map_async(_attention_in_child, [(q, 2), (q, 0)]).get(timeout=120)
    for g in got:
        assert np.array_equal(g, want)
