"""The statistics functions (diff_attention_v1_stats, diff_attention_v2_stats,
attention_stats) against float64 numpy on materialised maps (reference.py)."""

import numpy as np
import pytest

import diffattn
import reference as ref

RNG = np.random.default_rng(11)


def rand(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


def oracle(maps_of, out, n, m, needle, rows, vis):
    """The stats of AttentionStats from the maps: maps_of(b, h) gives
    [(A, logits)] per map and W (N, M); out (B, N, H, dv) the output."""
    b_, _, h, dv = out.shape
    nb, ne = needle
    measured = [i for i in range(rows[0], rows[1]) if vis[i].any()]
    count = b_ * len(measured)
    maps = len(maps_of(0, 0)[0])
    st = {k: np.zeros((h, maps)) for k in ("max_abs_logit", "entropy", "map_needle_mass")}
    for k in ("needle_mass", "context_mass", "context_abs_mass", "negative_mass", "context_rms"):
        st[k] = np.zeros(h)
    for b in range(b_):
        for hh in range(h):
            pairs, w = maps_of(b, hh)
            for j, (a, s) in enumerate(pairs):
                for i in measured:
                    st["max_abs_logit"][hh, j] = max(st["max_abs_logit"][hh, j],
                                                     np.abs(s[i][vis[i]]).max())
                    p = a[i][vis[i]]
                    st["entropy"][hh, j] += -np.sum(p[p > 0] * np.log(p[p > 0]))
                    st["map_needle_mass"][hh, j] += a[i, nb:ne].sum()
            for i in measured:
                inside = np.zeros(m, dtype=bool)
                inside[nb:ne] = True
                st["needle_mass"][hh] += w[i, inside].sum()
                st["context_mass"][hh] += w[i, vis[i] & ~inside].sum()
                st["context_abs_mass"][hh] += np.abs(w[i, vis[i] & ~inside]).sum()
                st["negative_mass"][hh] += np.minimum(w[i, vis[i]], 0).sum()
                st["context_rms"][hh] += np.sum(out[b, i, hh].astype(np.float64) ** 2)
    for k in st:
        if k == "max_abs_logit":
            continue
        st[k] /= count
    st["context_rms"] = np.sqrt(st["context_rms"] / dv)
    st["rows"] = count
    return st


def check(got, want, tol):
    assert got["rows"] == want["rows"]
    for k, v in want.items():
        if k == "rows":
            continue
        g = np.asarray(got[k])
        assert g.shape == np.shape(v), k
        assert np.max(np.abs(g - v), initial=0.0) <= tol * max(1.0, np.max(np.abs(v))), k


def logits(q, k, s):
    return s * (q.astype(np.float64) @ k.astype(np.float64).T)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_v1_stats_match_the_maps(dtype):
    b_, n, m, h, hkv, d = 2, 37, 41, 2, 1, 8
    q, k, v = rand(b_, n, 2 * h, d, dtype=dtype), rand(b_, m, 2 * hkv, d, dtype=dtype), \
        rand(b_, m, hkv, 2 * d, dtype=dtype)
    lam, needle, rows = 0.35, (5, 12), (3, 30)
    got, out = diffattn.diff_attention_v1_stats(
        q, k, v, lam, causal=True, needle_begin=needle[0], needle_end=needle[1],
        query_begin=rows[0], query_end=rows[1], return_out=True)
    # exact logits: the fused kernel's output, bit for bit
    assert np.array_equal(out, diffattn.diff_attention_v1(q, k, v, lam, causal=True)[0])
    vis = ref.visible(n, m, causal=True)
    s = 1 / np.sqrt(d)
    ref_out, _ = ref.v1(q, k, v, lam, causal=True)

    def maps_of(b, hh):
        g = hh // (h // hkv)
        a1, _ = ref.softmax_map(q[b, :, 2 * hh], k[b, :, 2 * g], s, vis)
        a2, _ = ref.softmax_map(q[b, :, 2 * hh + 1], k[b, :, 2 * g + 1], s, vis)
        return [(a1, logits(q[b, :, 2 * hh], k[b, :, 2 * g], s)),
                (a2, logits(q[b, :, 2 * hh + 1], k[b, :, 2 * g + 1], s))], a1 - lam * a2

    check(got, oracle(maps_of, ref_out, n, m, needle, rows, vis),
          1e-10 if dtype == np.float64 else 1e-4)
    # rows before and after the span unmeasured; without out= the same numbers
    alone = diffattn.diff_attention_v1_stats(q, k, v, lam, causal=True, needle_begin=5,
                                             needle_end=12, query_begin=3, query_end=30)
    for key in got:
        assert np.array_equal(np.asarray(alone[key]), np.asarray(got[key])), key


def test_v2_and_plain_stats_with_a_window():
    b_, n, m, h, hkv, d = 1, 29, 33, 2, 2, 8
    q, k, v = rand(b_, n, 2 * h, d), rand(b_, m, hkv, d), rand(b_, m, hkv, d + 3)
    logit = rand(b_, n, h)
    needle, rows, wl = (10, 14), (0, n), 9
    got, out = diffattn.diff_attention_v2_stats(
        q, k, v, logit, causal=True, window_left=wl, needle_begin=needle[0],
        needle_end=needle[1], return_out=True, num_threads=2)
    vis = ref.visible(n, m, causal=True, window_left=wl)
    s = 1 / np.sqrt(d)
    ref_out, _ = ref.v2(q, k, v, logit, causal=True, window_left=wl)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)

    def maps_v2(b, hh):
        g = 2 * hh // (2 * h // hkv)
        a1, _ = ref.softmax_map(q[b, :, 2 * hh], k[b, :, g], s, vis)
        a2, _ = ref.softmax_map(q[b, :, 2 * hh + 1], k[b, :, g], s, vis)
        lam = ref.sigmoid(logit[b, :, hh])[:, None]
        return [(a1, logits(q[b, :, 2 * hh], k[b, :, g], s)),
                (a2, logits(q[b, :, 2 * hh + 1], k[b, :, g], s))], a1 - lam * a2

    want = oracle(maps_v2, ref_out, n, m, needle, rows, vis)
    check(got, want, 1e-10)
    assert np.all(got["negative_mass"] < 0)

    qp = rand(b_, n, 4, d)
    got_p = diffattn.attention_stats(qp, k, v, causal=True, window_left=wl,
                                     needle_begin=needle[0], needle_end=needle[1])
    p_out, _ = ref.plain(qp, k, v, causal=True, window_left=wl)

    def maps_plain(b, j):
        a, _ = ref.softmax_map(qp[b, :, j], k[b, :, j // 2], s, vis)
        return [(a, logits(qp[b, :, j], k[b, :, j // 2], s))], a

    check(got_p, oracle(maps_plain, p_out, n, m, needle, rows, vis), 1e-10)
    assert np.all(got_p["negative_mass"] == 0)
    np.testing.assert_allclose(got_p["needle_mass"] + got_p["context_mass"], 1.0, atol=1e-12)


def test_quantised_logits_move_the_statistics():
    q, k, v = rand(1, 40, 4, 16), rand(1, 40, 4, 16), rand(1, 40, 2, 32)
    exact = diffattn.diff_attention_v1_stats(q, k, v, 0.5, causal=True, needle_end=4)
    fine = diffattn.diff_attention_v1_stats(q, k, v, 0.5, causal=True, needle_end=4,
                                            logit_bits=16)
    coarse = diffattn.diff_attention_v1_stats(q, k, v, 0.5, causal=True, needle_end=4,
                                              logit_bits=2)
    d_fine = np.max(np.abs(fine["entropy"] - exact["entropy"]))
    d_coarse = np.max(np.abs(coarse["entropy"] - exact["entropy"]))
    assert d_fine < 1e-3 < d_coarse
    # max_abs_logit is measured before quantisation
    assert np.array_equal(coarse["max_abs_logit"], exact["max_abs_logit"])


def test_bad_input_names_the_function():
    q, k, v = rand(1, 8, 2, 4), rand(1, 8, 2, 4), rand(1, 8, 1, 8)
    with pytest.raises(diffattn.Error, match=r"diff_attention_v1_stats: .*needle"):
        diffattn.diff_attention_v1_stats(q, k, v, 0.5, needle_begin=3, needle_end=9)
    with pytest.raises(diffattn.Error, match=r"diff_attention_v1_stats: .*logit_bits"):
        diffattn.diff_attention_v1_stats(q, k, v, 0.5, logit_bits=1)
    with pytest.raises(diffattn.Error, match=r"diff_attention_v1_stats: .*k"):
        diffattn.diff_attention_v1_stats(q, rand(1, 8, 3, 4), v, 0.5)
    with pytest.raises(diffattn.Error, match=r"attention_stats: q has dtype float16"):
        diffattn.attention_stats(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
    with pytest.raises(diffattn.Error, match=r"out"):
        diffattn.diff_attention_v1_stats(q, k, v, 0.5, out=np.zeros((1, 8, 1, 7)))
