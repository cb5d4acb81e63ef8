"""diffattn.torch: gradcheck of the autograd Functions and the modules, the
modules against the papers' eager PyTorch modules, zero-copy hand-over, 16-bit
forward, cached decoding, training with a torch optimizer."""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import diffattn  # noqa: E402
import diffattn.torch as dt  # noqa: E402
import eager_modules as eager  # noqa: E402
import reference as ref  # noqa: E402

torch.manual_seed(0)


def r(*shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def test_gradcheck_kernels():
    n, m, h, hkv, d = 4, 6, 2, 1, 4  # causal with N < M, GQA
    q, k, v = r(1, n, 2 * h, d), r(1, m, 2 * hkv, d), r(1, m, hkv, 2 * d)
    lam = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: dt.diff_attention_v1(*a, causal=True), (q, k, v, lam))
    lam_h = torch.tensor([0.3, 0.9], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: dt.diff_attention_v1(*a, causal=True, window_left=2), (q, k, v, lam_h))
    k2, v2, logit = r(1, m, hkv, d), r(1, m, hkv, d), r(1, n, h)
    assert torch.autograd.gradcheck(
        lambda *a: dt.diff_attention_v2(*a, causal=True), (q, k2, v2, logit))
    assert torch.autograd.gradcheck(lambda *a: dt.attention(*a, causal=True), (q, k2, v2))


def test_gradcheck_varlen_kernels():
    # three sequences, one empty, key lengths other than the query lengths;
    # sinks of a few bits and a step of 2^-16, as in the modules' gradcheck
    torch.manual_seed(13)
    cu, cuk = [0, 3, 3, 8], [0, 4, 6, 11]
    h, hkv, d = 2, 1, 4
    q, k, v = r(8, 2 * h, d), r(11, 2 * hkv, d), r(11, hkv, 2 * d)
    lam = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    lam_h = torch.tensor([0.3, 0.9], dtype=torch.float64, requires_grad=True)
    sinks = (torch.randint(-8, 8, (2 * h,)) / 4.0).double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *a: dt.diff_attention_v1_varlen(*a, cu, cuk, causal=True), (q, k, v, lam))
    assert torch.autograd.gradcheck(
        lambda *a: dt.diff_attention_v1_varlen(*a[:4], torch.tensor(cu), torch.tensor(cuk),
                                               window_left=2, sinks=a[4]),
        (q, k, v, lam_h, sinks), eps=2.0 ** -16)
    k2, v2, logit = r(11, hkv, d), r(11, hkv, d), r(8, h)
    assert torch.autograd.gradcheck(
        lambda *a: dt.diff_attention_v2_varlen(*a[:4], cu, cuk, causal=True, softcap=2.0,
                                               sinks=a[4]),
        (q, k2, v2, logit, sinks), eps=2.0 ** -16)
    seqs = diffattn.PackedSequences.from_lengths([3, 0, 5])
    assert torch.autograd.gradcheck(
        lambda *a: dt.attention_varlen(*a[:3], seqs, causal=True,
                                       alibi_slopes=dt.standard_alibi_slopes(4), sinks=a[3]),
        (q, k2[:8], v2[:8], sinks), eps=2.0 ** -16)


def test_varlen_matches_one_call_per_sequence():
    torch.manual_seed(14)
    lengths = [5, 1, 0, 7]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v, logit = r(13, 4, 8), r(13, 2, 8), r(13, 2, 8), r(13, 2)
    out = dt.diff_attention_v2_varlen(q, k, v, logit, torch.tensor(cu), causal=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v, logit))
    for b, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        if s == e:
            continue
        parts = [t[s:e].detach().clone().requires_grad_() for t in (q, k, v, logit)]
        one = dt.diff_attention_v2(*[t[None] for t in parts], causal=True)[0]
        assert torch.allclose(out[s:e], one, atol=1e-13)
        want = torch.autograd.grad((one * g[s:e]).sum(), parts)
        for got, w in zip(grads, want):
            assert torch.allclose(got[s:e], w, atol=1e-12)
    with pytest.raises(ValueError, match="cu_seqlens_q has dtype float32, expected integers"):
        dt.attention_varlen(q, k, v, torch.tensor(cu, dtype=torch.float32))
    # bfloat16 through the 16-bit varlen kernels, against float64 on the same values:
    # the output's rounding, u |y|, and where the kernels round W = A1 - lambda A2 to
    # bfloat16 (AVX512-BF16), u sum_j |w_ij| |v_jc| <= u (1 + lambda) max |v| <= 2 u max |v|
    qb, kb, vb, lb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v, logit))
    ob = dt.diff_attention_v2_varlen(qb, kb, vb, lb, cu, causal=True)
    assert ob.dtype == torch.bfloat16
    o64 = dt.diff_attention_v2_varlen(*(t.detach().double() for t in (qb, kb, vb, lb)), cu,
                                      causal=True)
    u = 2.0 ** -8
    bound = u * (1 + 2.0 ** -6) * (o64.abs() + 2 * vb.detach().double().abs().max()) + 1e-5
    assert torch.all((ob.double() - o64).abs() <= bound)
    ob.float().sum().backward()
    assert qb.grad.dtype == torch.bfloat16 and lb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("version", [1, 2])
def test_modules_on_packed_batches(version):
    # cu_seqlens: each sequence alone (rotary from 0, causal and window within it),
    # values and every gradient as one call per sequence; the C++ layer's packed
    # forward on the same parameters
    torch.manual_seed(15)
    cls = dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2
    mod = cls(32, 1, 2, 1, window_left=3, sinks=True, dtype=torch.float64)
    with torch.no_grad():
        mod.sinks.copy_(torch.tensor([0.5, -1.0, 0.25, 1.5]))
    lengths = [5, 0, 7, 1]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    x = r(1, 13, 32)
    y = mod(x, cu_seqlens=torch.tensor(cu))
    g = torch.randn_like(y)
    params = [p for _, p in mod.named_parameters()]
    got = torch.autograd.grad((y * g).sum(), [x] + params)
    one = torch.cat([mod(x[:, s:e]) for s, e in zip(cu[:-1], cu[1:]) if e > s], 1)
    assert torch.allclose(y, one, atol=1e-13)
    want = torch.autograd.grad((one * g).sum(), [x] + params)
    for (name, _), a, b in zip([("x", None)] + list(mod.named_parameters()), got, want):
        assert torch.allclose(a, b, atol=1e-12), name
    layer_cls = diffattn.MultiheadDiffAttnV1 if version == 1 else diffattn.MultiheadDiffAttnV2
    layer = layer_cls(32, 1, 2, 1, dtype=np.float64, window_left=3, sinks=True)
    for name, p in layer.parameters().items():
        p[...] = mod.state_dict()[name].numpy()
    seqs = diffattn.PackedSequences.from_lengths(lengths)
    assert np.allclose(layer.forward(x.detach().numpy(), seqs), y.detach().numpy(), atol=1e-13)
    assert torch.equal(mod(x, cu_seqlens=seqs), y)
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the 13 tokens"):
        mod(x, cu_seqlens=[0, 5, 12])
    with pytest.raises(ValueError, match=r"a packed batch is x \(1, T, E\)"):
        mod(torch.cat([x, x]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="exclude each other"):
        mod(x, mod.make_cache(1, 16), cu_seqlens=cu)


def test_gradcheck_modules():
    x = r(1, 5, 16)
    v1 = dt.MultiheadDiffAttnV1(16, 1, 2, 1, dtype=torch.float64)
    assert torch.autograd.gradcheck(v1, (x,))
    v2 = dt.MultiheadDiffAttnV2(16, 0, 2, 1, dtype=torch.float64)
    assert torch.autograd.gradcheck(v2, (x,))


def eager_plain(q, k, v, causal=True, sinks=None):
    """Plain GQA attention in torch operations: q (B, N, Hq, d), k, v (B, M, Hkv, d)."""
    hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    s = q.transpose(1, 2) @ k.transpose(1, 2).repeat_interleave(hq // hkv, 1).transpose(-1, -2)
    a = eager.softmax_mods(s / math.sqrt(d), sinks=sinks, causal=causal)
    return (a @ v.transpose(1, 2).repeat_interleave(hq // hkv, 1)).transpose(1, 2)


class _Recorder:
    """Stands for the extension module: records the arrays each *_backward call receives."""

    def __init__(self, mod):
        self.mod, self.calls = mod, []

    def __getattr__(self, name):
        f = getattr(self.mod, name)
        if not name.endswith("_backward"):
            return f

        def call(*args, **kw):
            self.calls.append((name, args))
            return f(*args, **kw)
        return call


@pytest.mark.parametrize("dtype,u", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("kind", ["v1", "v1_heads", "v2", "plain_sinks"])
def test_16bit_backward_runs_the_16bit_kernels(monkeypatch, dtype, u, kind):
    """Gradients of 16-bit tensors come from the 16-bit backward kernels, on the saved tensors
    themselves (no float32 copies), in the tensors' dtype; lambda_'s and the sinks' (float32
    leaves) in float32. Against the float64 eager autograd on the same values, with e_f the
    float path's error (at most twice the float32 path's measured error, or 5e-5, relative to
    max |reference|), as tests/test_half_backward.cpp:
        max |g - reference| / max |reference| <= u (1 + e_f) + e_f   (16-bit gradients)
        max |g - reference| / max(1, max |reference|) <= e_f           (float32 gradients)
    (the backward recomputes the maps; it does not read the forward's rounded out). Where
    bfloat16 runs the bf16 gradient products (dS and W rounded), q, k and v's gradients are
    held to that file's elementwise bound instead."""
    gen = torch.Generator().manual_seed(11)
    n, m, h, hkv, d = 7, 12, 2, 1, 8  # causal with an offset, GQA

    def rand(*shape, dt_=dtype):
        return torch.randn(*shape, generator=gen).to(dt_)

    q = rand(1, n, 2 * h, d)
    if kind.startswith("v1"):
        k, v = rand(1, m, 2 * hkv, d), rand(1, m, hkv, 2 * d)
        extra = torch.tensor(0.7) if kind == "v1" else torch.tensor([0.3, 0.9])
    else:
        k, v = rand(1, m, hkv, d), rand(1, m, hkv, d)
        extra = rand(1, n, h) if kind == "v2" else rand(2 * h, dt_=torch.float32)  # sinks

    def run(fn_dtype, eager_run):
        """Leaves of q, k, v (fn_dtype) and lambda_ / logit / sinks, and the output."""
        leaves = [t.detach().to(fn_dtype).requires_grad_() for t in (q, k, v)]
        e = extra.detach().to(fn_dtype if extra.dtype == dtype else
                              (torch.float64 if eager_run else torch.float32))
        leaves.append(e.requires_grad_())
        qq, kk, vv, ee = leaves
        if kind.startswith("v1"):
            out = eager.eager_v1(qq, kk, vv, ee if ee.dim() == 0 else ee[None, :, None, None]) \
                if eager_run else dt.diff_attention_v1(qq, kk, vv, ee, causal=True)
        elif kind == "v2":
            out = eager.eager_v2(qq, kk, vv, ee) if eager_run else \
                dt.diff_attention_v2(qq, kk, vv, ee, causal=True)
        else:
            out = eager_plain(qq, kk, vv, sinks=ee) if eager_run else \
                dt.attention(qq, kk, vv, causal=True, sinks=ee)
        return out, leaves

    rec = _Recorder(dt._C)
    monkeypatch.setattr(dt, "_C", rec)
    out16, leaves16 = run(dtype, False)
    assert out16.dtype == dtype
    dout = rand(*out16.shape)
    out16.backward(dout)
    (name, args), = rec.calls
    assert name.endswith("_backward")
    # q, k, v and dout reach the kernel as the 16-bit tensors themselves
    np16 = np.uint16 if dtype == torch.bfloat16 else np.float16
    for a, t in zip(args[:3], leaves16[:3]):
        assert a.dtype == np16 and a.__array_interface__["data"][0] == t.data_ptr()
    assert args[-1].dtype == np16 and args[-1].__array_interface__["data"][0] == dout.data_ptr()
    for t in leaves16:
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
    assert leaves16[3].dtype == (dtype if kind == "v2" else torch.float32)
    monkeypatch.setattr(dt, "_C", rec.mod)

    out64, leaves64 = run(torch.float64, True)
    out64.backward(dout.to(torch.float64))
    out32, leaves32 = run(torch.float32, False)
    out32.backward(dout.to(torch.float32))
    mags = [None] * 4
    if dtype == torch.bfloat16 and "bf16" in diffattn.isa():
        # dS and W rounded to bfloat16 for the gradient products: the elementwise bound of
        # tests/test_half_backward.cpp, with the magnitudes of reference.grad_magnitudes
        np64 = [t.detach().double().numpy() for t in (q, k, v, extra, dout)]
        mags[:3] = ref.grad_magnitudes(
            kind[:2] if kind != "plain_sinks" else "plain", *np64[:3],
            np64[3] if kind != "plain_sinks" else None, np64[4], ref.visible(n, m, True),
            sinks=np64[3] if kind == "plain_sinks" else None)
    for t16, t32, t64, mag in zip(leaves16, leaves32, leaves64, mags):
        ref_g = t64.grad
        if t16.dtype == dtype:
            scale = ref_g.abs().max().item()
        else:
            scale = max(1.0, ref_g.abs().max().item())
        e_f = max(2 * (t32.grad.double() - ref_g).abs().max().item() / scale, 5e-5)
        if mag is not None:
            y = ref_g.numpy()
            delta = e_f * scale + 2.0 ** -8 * (1 + 2.0 ** -6) * mag
            err = np.abs(t16.grad.double().numpy() - y)
            assert np.all(err <= u * (np.abs(y) + delta) + delta), (kind, tuple(t16.shape))
            continue
        err = (t16.grad.double() - ref_g).abs().max().item() / scale
        bound = u * (1 + e_f) + e_f if t16.dtype == dtype else e_f
        assert err <= bound, (kind, tuple(t16.shape), err, bound)


@pytest.mark.parametrize("version", [1, 2])
def test_module_matches_eager_reference(version):
    e, h, hkv, n = 32, 4, 2, 9
    torch.manual_seed(version)
    if version == 1:
        ref, mod = eager.EagerDiffAttnV1(e, 2, h, hkv), dt.MultiheadDiffAttnV1(e, 2, h, hkv)
    else:
        ref, mod = eager.EagerDiffAttnV2(e, 2, h, hkv), dt.MultiheadDiffAttnV2(e, 2, h, hkv)
    ref.double()
    mod.double()
    assert set(mod.state_dict()) == set(ref.state_dict())
    mod.load_state_dict(ref.state_dict())
    x = r(2, n, e)
    y_ref, y = ref(x), mod(x)
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    g = torch.randn_like(y)
    dx_ref, = torch.autograd.grad(y_ref, x, g, retain_graph=True)
    dx, = torch.autograd.grad(y, x, g, retain_graph=True)
    assert torch.allclose(dx, dx_ref, rtol=0, atol=1e-11)
    y_ref.backward(g)
    y.backward(g)
    ref_params = dict(ref.named_parameters())
    for name, p in mod.named_parameters():
        assert torch.allclose(p.grad, ref_params[name].grad, rtol=0, atol=1e-11), name
    sd = mod.state_dict()
    mod2 = type(mod)(e, 2, h, hkv, dtype=torch.float64)
    mod2.load_state_dict(sd)
    assert torch.equal(mod2(x), y)


def test_zero_copy_handover():
    t = torch.randn(2, 8, 4, 16)
    assert dt._np(t).__array_interface__["data"][0] == t.data_ptr()
    s = t.transpose(1, 2)  # (B, H, N, D) strides: still no copy
    a = dt._np(s)
    assert a.__array_interface__["data"][0] == s.data_ptr()
    assert a.strides == tuple(x * 4 for x in s.stride())
    b = t.to(torch.bfloat16)
    ab = dt._np(b)
    assert ab.dtype == np.uint16 and ab.__array_interface__["data"][0] == b.data_ptr()
    back = dt._torch(ab)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == b.data_ptr()
    # kernel outputs come back as tensors over the kernel's arrays
    q = torch.randn(1, 8, 4, 16)
    out = dt.diff_attention_v2(q, q[:, :, :2], q[:, :, 2:], torch.zeros(1, 8, 2))
    assert out.shape == (1, 8, 2, 16)


def test_bfloat16_forward_and_backward():
    q, k, v = r(1, 16, 4, 32, dtype=torch.float32), r(1, 16, 2, 32, dtype=torch.float32), \
        r(1, 16, 2, 32, dtype=torch.float32)
    logit = r(1, 16, 2, dtype=torch.float32)
    want = dt.diff_attention_v2(q, k, v, logit, causal=True)
    args16 = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v, logit)]
    out = dt.diff_attention_v2(*args16, causal=True)
    assert out.dtype == torch.bfloat16
    assert (out.float() - want).abs().max() <= 0.03 * want.abs().max()
    out.float().sum().backward()  # the bfloat16 backward kernel: gradients rounded to bfloat16
    assert args16[0].grad.dtype == torch.bfloat16 and torch.isfinite(args16[0].grad.float()).all()
    layer = dt.MultiheadDiffAttnV2(64, 0, 2, 1, dtype=torch.bfloat16)
    y = layer(torch.randn(1, 7, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (1, 7, 64)


@pytest.mark.parametrize("version", [1, 2])
def test_cached_decoding(version):
    e, h, hkv = 32, 2, 1
    cls = dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2
    layer = cls(e, 1, h, hkv, dtype=torch.float64)
    x = torch.randn(2, 10, e, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = layer.make_cache(2, 16)
        parts = [layer(x[:, :6], cache)] + [layer(x[:, i:i + 1], cache) for i in range(6, 10)]
    assert cache.size() == 10
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12)
    with pytest.raises(ValueError, match="cannot append"):
        layer(torch.randn(2, 7, e, dtype=torch.float64), cache)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind,tol", [("int8", 1e-2), ("float8_e4m3", 6e-2)])
def test_cached_decoding_from_8bit_caches(version, kind, tol):
    # tol: the C++ layers' 8-bit tolerance (test_quant.cpp), relative to max |y|
    torch.manual_seed(11)
    cls = dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2
    layer = cls(64, 2, 2, 1)
    x = torch.randn(2, 40, 64)

    def decode(lay, xs, cache):
        with torch.no_grad():
            return torch.cat([lay(xs[:, :9], cache)] +
                             [lay(xs[:, i:i + 1], cache) for i in range(9, 40)], 1)

    with torch.no_grad():
        full = layer(x)
    c8, cf = layer.make_cache(2, 48, kind), layer.make_cache(2, 48)
    y8, yf = decode(layer, x, c8), decode(layer, x, cf)
    assert torch.allclose(yf, full, atol=1e-5)
    # the rows held are quantize_rows of the float cache's rows, bit for bit
    for rows, scale, wide in ((c8.k, c8.k_scale, cf.k), (c8.v, c8.v_scale, cf.v)):
        q, s = diffattn.quantize_rows(wide[:, :40].numpy(), kind)
        assert np.array_equal(rows[:, :40].numpy(), q) and np.array_equal(scale[:, :40].numpy(), s)
    err = ((y8 - full).abs().max() / full.abs().max()).item()
    assert 0 < err <= tol, err
    # one byte a value and a float scale a row, against four bytes a value
    rows = [t.numel() // t.shape[-1] for t in (cf.k, cf.v)]
    widths = [t.shape[-1] for t in (cf.k, cf.v)]
    assert c8.bytes() == sum(r * (w + 4) for r, w in zip(rows, widths))
    assert cf.bytes() == sum(r * w * 4 for r, w in zip(rows, widths))
    # a bfloat16 twin reads the same 8-bit rows with bfloat16 queries: within tol
    # plus twice its own error on the whole sequence, as in C++
    narrow = cls(64, 2, 2, 1, dtype=torch.bfloat16)
    narrow.load_state_dict(layer.state_dict())
    xb = x.bfloat16()
    with torch.no_grad():
        e_b = ((narrow(xb).float() - layer(xb.float())).abs().max() / full.abs().max()).item()
    yb = decode(narrow, xb, narrow.make_cache(2, 48, kind)).float()
    with torch.no_grad():
        ref_b = layer(xb.float())
    assert ((yb - ref_b).abs().max() / ref_b.abs().max()).item() <= tol + 2 * e_b
    # a non-finite value has no scale: the append fails and the cache is as it was
    bad = torch.randn(2, 3, 64)
    bad[1, 2, 5] = float("inf")
    held = c8.k.clone(), c8.k_scale.clone()
    msg = f"{cls.__name__}.forward: quantize_rows: .* only finite values have a scale"
    with pytest.raises(ValueError, match=msg):
        with torch.no_grad():
            layer(bad, c8)
    assert c8.size() == 40
    assert torch.equal(c8.k[:, :40], held[0][:, :40])
    assert torch.equal(c8.k_scale[:, :40], held[1][:, :40])
    with pytest.raises(ValueError, match="8-bit cache takes queries of float32, bfloat16"):
        cls(64, 2, 2, 1, dtype=torch.float64).make_cache(2, 8, kind)
    with pytest.raises(ValueError, match="make_cache: dtype must be"):
        layer.make_cache(2, 8, "int4")
    with pytest.raises(ValueError, match=r"x has shape \(2, 5, 32\), expected \(B, N, 64\)"):
        layer(torch.randn(2, 5, 32))


@pytest.mark.parametrize("version", [1, 2])
def test_windowed_caches_hold_the_window(version):
    # window_left = 5: at most 2 (5 + 1) rows, whatever the sequence; decoding in
    # pieces of any length (some longer than the room left) equals the forward
    torch.manual_seed(16)
    cls = dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2
    layer = cls(32, 1, 2, 1, window_left=5, dtype=torch.float64)
    x = torch.randn(2, 100, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        for plan in ([1] * 100, [17, 1, 30, 2, 50], [100]):
            cache = layer.make_cache(2, 100)
            assert cache.k.shape[1] == 12
            assert cache.bytes() == layer.make_cache(2, 10 ** 6).bytes()
            parts, a = [], 0
            for n in plan:
                parts.append(layer(x[:, a:a + n], cache))
                a += n
            assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12), plan[:3]
            assert cache.size() == 100 and cache.stored() == 5
            assert cache.keys().shape[1] == 5
        with pytest.raises(ValueError, match="cannot append 1 tokens"):
            layer(x[:, :1], cache)
    # an 8-bit windowed cache: a non-finite value in the last piece of a long
    # append leaves the cache as it was
    layer32 = cls(32, 1, 2, 1, window_left=5)
    x32 = x.float()
    with torch.no_grad():
        c8 = layer32.make_cache(2, 100, "int8")
        layer32(x32[:, :20], c8)
        held = c8.keys().clone(), c8.size(), c8.stored()
        bad = x32[:, 20:50].clone()
        bad[0, 28, 0] = float("nan")
        with pytest.raises(ValueError, match="only finite values have a scale"):
            layer32(bad, c8)
        assert torch.equal(c8.keys(), held[0]) and (c8.size(), c8.stored()) == held[1:]
        y = torch.cat([layer32(x32[:, 20:60], c8)] +
                      [layer32(x32[:, i:i + 1], c8) for i in range(60, 100)], 1)
        ref = layer32(x32)[:, 20:]
    assert ((y - ref).abs().max() / ref.abs().max()).item() <= 1e-2


def test_training_with_a_torch_optimizer():
    torch.manual_seed(3)
    layer = dt.MultiheadDiffAttnV2(32, 0, 2, 1)
    head = torch.nn.Linear(32, 4)
    opt = torch.optim.AdamW(list(layer.parameters()) + list(head.parameters()), lr=1e-2)
    x = torch.randn(8, 12, 32)
    target = torch.randint(0, 4, (8,))
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(layer(x)[:, -1]), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in layer.parameters())


def test_errors_from_torch():
    q = torch.randn(1, 4, 3, 8)  # an odd number of query heads
    with pytest.raises(ValueError, match="diff_attention_v2: q"):
        dt.diff_attention_v2(q, q[:, :, :1], q[:, :, :1], torch.zeros(1, 4, 1))
    with pytest.raises(ValueError, match="dtype torch.int64"):
        dt.attention(q.long(), q.long(), q.long())


def test_empty_sequences():
    q, k, v, lam = r(1, 0, 4, 8), r(1, 5, 2, 8), r(1, 5, 2, 8), r(1, 0, 2)
    out = dt.diff_attention_v2(q, k, v, lam)
    assert out.shape == (1, 0, 2, 8)
    out.sum().backward()
    assert torch.all(k.grad == 0) and torch.all(v.grad == 0) and q.grad.shape == q.shape


def test_score_modifiers():
    n, m, h, hkv, d = 4, 6, 2, 1, 4
    q, k, v, logit = r(1, n, 2 * h, d), r(1, m, hkv, d), r(1, m, hkv, d), r(1, n, h)
    mods = dict(softcap=3.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                sinks=torch.tensor([0.1, -0.5, 1.0, 0.0], dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *a: dt.diff_attention_v2(*a, causal=True, **mods),
                                    (q, k, v, logit))
    sinks = mods["sinks"].clone().requires_grad_()
    out = dt.diff_attention_v2(q, k, v, logit, causal=True, **dict(mods, sinks=sinks))
    g = torch.randn_like(out)
    out.backward(g)
    ref_out, lse = diffattn.diff_attention_v2(*(t.detach().numpy() for t in (q, k, v, logit)),
                                              causal=True, **{**mods, "sinks": sinks.detach().numpy(),
                                                              "alibi_slopes": mods["alibi_slopes"].numpy()})
    assert np.allclose(out.detach().numpy(), ref_out)
    ds = np.zeros(4)
    diffattn.diff_attention_v2_backward(*(t.detach().numpy() for t in (q, k, v, logit)), ref_out, lse,
                                        g.numpy(), causal=True, dsinks=ds, softcap=3.0,
                                        alibi_slopes=mods["alibi_slopes"].numpy(),
                                        sinks=sinks.detach().numpy())
    assert np.allclose(sinks.grad.numpy(), ds) and np.any(ds != 0)


def _mod_pair(version, e, h, hkv, **mods):
    """The eager module and diffattn.torch's, float64, with the same state_dict
    (sinks set to values a float32 holds exactly: the kernels take them as float32)."""
    ref = (eager.EagerDiffAttnV1 if version == 1 else eager.EagerDiffAttnV2)(e, 2, h, hkv, **mods)
    mod = (dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2)(e, 2, h, hkv,
                                                                              **mods)
    ref.double()
    mod.double()
    if mods.get("sinks"):
        with torch.no_grad():
            ref.sinks.copy_(torch.randint(-12, 12, (2 * h,)) / 8.0)
    assert set(mod.state_dict()) == set(ref.state_dict())
    mod.load_state_dict(ref.state_dict())
    return ref, mod


def test_standard_alibi_slopes():
    for n in (1, 2, 6, 8, 12, 16):
        assert torch.equal(dt.standard_alibi_slopes(n).double(), eager.alibi_slopes(n)), n
    assert np.array_equal(dt.standard_alibi_slopes(12).numpy(),
                          np.float32([2.0 ** (-8 * i / 8) for i in range(1, 9)]
                                     + [2.0 ** (-8 * i / 16) for i in (1, 3, 5, 7)]))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mods", [dict(softcap=2.0), dict(alibi=True), dict(sinks=True),
                                  dict(softcap=3.0, alibi=True, sinks=True)])
def test_module_modifiers_match_eager(version, mods):
    e, h, hkv, n = 32, 4, 2, 9
    torch.manual_seed(7 + version)
    ref, mod = _mod_pair(version, e, h, hkv, **mods)
    assert ("sinks" in mod.state_dict()) == bool(mods.get("sinks"))
    if mods.get("sinks"):
        assert mod.sinks.shape == (2 * h,) and mod.sinks.dtype == torch.float64
    x = r(2, n, e)
    y_ref, y = ref(x), mod(x)
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    plain = type(mod)(e, 2, h, hkv, dtype=torch.float64)  # the modifiers change the output
    plain.load_state_dict({k: t for k, t in ref.state_dict().items() if k != "sinks"})
    assert (plain(x) - y).abs().max() > 1e-6
    g = torch.randn_like(y)
    y_ref.backward(g)
    y.backward(g)
    ref_params = dict(ref.named_parameters())
    for name, p in mod.named_parameters():
        assert torch.allclose(p.grad, ref_params[name].grad, rtol=0, atol=1e-11), name
    assert torch.allclose(x.grad, torch.autograd.grad(ref(x), x, g)[0] * 2, rtol=0, atol=1e-11)
    if mods.get("sinks"):
        assert mod.sinks.grad.abs().max() > 0


@pytest.mark.parametrize("version", [1, 2])
def test_gradcheck_modules_with_sinks(version):
    # sinks of a few bits and a step of 2^-16: sinks +- the step are exact in
    # float32, the kernels' type for the sinks, so the differences are float64's.
    torch.manual_seed(11)
    cls = dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2
    mod = cls(16, 1, 2, 1, softcap=4.0, alibi=True, sinks=True, dtype=torch.float64)
    sinks = (torch.randint(-8, 8, (4,)) / 4.0).double().requires_grad_()
    x = r(1, 5, 16)
    call = torch.nn.utils.stateless.functional_call
    assert torch.autograd.gradcheck(lambda x, s: call(mod, {"sinks": s}, (x,)), (x, sinks),
                                    eps=2.0 ** -16)
    q, k, v, logit = r(1, 4, 4, 4), r(1, 6, 1, 4), r(1, 6, 1, 4), r(1, 4, 2)
    assert torch.autograd.gradcheck(
        lambda q, k, v, lg, s: dt.diff_attention_v2(q, k, v, lg, causal=True, softcap=2.0,
                                                    alibi_slopes=dt.standard_alibi_slopes(4),
                                                    sinks=s),
        (q, k, v, logit, sinks), eps=2.0 ** -16)


@pytest.mark.parametrize("version", [1, 2])
def test_modifiers_state_dict_through_safetensors(version, tmp_path):
    from test_layers import save_safetensors
    e, h, hkv = 32, 2, 1
    mods = dict(softcap=5.0, alibi=True, sinks=True)
    torch.manual_seed(20 + version)
    _, mod = _mod_pair(version, e, h, hkv, **mods)
    path = str(tmp_path / "mod.safetensors")
    save_safetensors(path, {k: t.numpy() for k, t in mod.state_dict().items()})
    layer = (diffattn.MultiheadDiffAttnV1 if version == 1 else diffattn.MultiheadDiffAttnV2)(
        e, 2, h, hkv, dtype=np.float64, **mods)
    layer.load_safetensors(path)
    assert np.array_equal(layer.parameters()["sinks"], mod.sinks.detach().numpy())
    x = torch.randn(2, 7, e, dtype=torch.float64)
    y = mod(x).detach()
    assert np.max(np.abs(layer.forward(x.numpy()) - y.numpy())) <= 1e-12 * float(y.abs().max())
    # and back: the C++ layer's file into a fresh torch module
    back = str(tmp_path / "back.safetensors")
    layer.save_safetensors(back)
    with open(back, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), f.read()
    sd = {k: torch.from_numpy(np.frombuffer(data[m["data_offsets"][0]:m["data_offsets"][1]],
                                            np.float64).reshape(m["shape"]).copy())
          for k, m in header.items() if k != "__metadata__"}
    assert header["sinks"]["dtype"] == "F64" and set(sd) == set(mod.state_dict())
    mod2 = type(mod)(e, 2, h, hkv, dtype=torch.float64, **mods)
    mod2.load_state_dict(sd)
    assert torch.equal(mod2(x), mod(x))


def test_cached_decoding_with_modifiers():
    torch.manual_seed(5)
    for cls in (dt.MultiheadDiffAttnV1, dt.MultiheadDiffAttnV2):
        layer = cls(32, 1, 2, 1, softcap=3.0, alibi=True, sinks=True, dtype=torch.float64)
        with torch.no_grad():
            layer.sinks.copy_(torch.tensor([0.5, -1.0, 0.25, 1.5]))
        x = torch.randn(2, 10, 32, dtype=torch.float64)
        with torch.no_grad():
            full = layer(x)
            cache = layer.make_cache(2, 16)
            parts = [layer(x[:, :6], cache)] + [layer(x[:, i:i + 1], cache) for i in range(6, 10)]
        assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12), cls.__name__
    with pytest.raises(ValueError, match="softcap"):
        dt.MultiheadDiffAttnV2(32, 0, 2, softcap=-1.0)


def test_apply_rope_matches_eager_bitwise():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = torch.randn(2, 9, 3, 8, dtype=dtype)
        for off in (0, 5):
            assert torch.equal(dt.apply_rope(x, off), eager.rope(x, off)), dtype
    xs = torch.randn(2, 3, 9, 8, dtype=torch.float64).transpose(1, 2)  # not contiguous
    assert torch.equal(dt.apply_rope(xs, 3), eager.rope(xs, 3))
    x = r(2, 5, 3, 8)
    y = dt.apply_rope(x, 2)
    assert y.requires_grad and torch.equal(y, eager.rope(x.detach(), 2))
    assert torch.autograd.gradcheck(lambda x: dt.apply_rope(x, 2), (x,))
    g = torch.randn_like(y)
    assert torch.allclose(torch.autograd.grad(y, x, g)[0],
                          torch.autograd.grad(eager.rope(x, 2), x, g)[0], rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_statistics_from_tensors(dtype):
    """dt.*_stats: the numpy statistics on the same values (float32 for 16-bit
    tensors), the arrays as tensors, the output the autograd function's."""
    torch.manual_seed(3)
    b, n, m, h, hkv, d = 2, 13, 17, 2, 1, 8
    mk = lambda *s: torch.randn(*s, dtype=torch.float64).to(dtype)  # noqa: E731
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    kw = dict(causal=True, needle_begin=3, needle_end=7, query_begin=2, num_threads=2)
    q, k1, v1 = mk(b, n, 2 * h, d), mk(b, m, 2 * hkv, d), mk(b, m, hkv, 2 * d)
    k2, v2, logit = mk(b, m, hkv, d), mk(b, m, hkv, d), mk(b, n, h)
    cases = [
        (dt.diff_attention_v1_stats, diffattn.diff_attention_v1_stats, (q, k1, v1), (0.6,),
         lambda: dt.diff_attention_v1(q, k1, v1, torch.tensor(0.6, dtype=wide), causal=True)),
        (dt.diff_attention_v2_stats, diffattn.diff_attention_v2_stats, (q, k2, v2, logit), (),
         lambda: dt.diff_attention_v2(q, k2, v2, logit, causal=True)),
        (dt.attention_stats, diffattn.attention_stats, (q, k2, v2), (),
         lambda: dt.attention(q, k2, v2, causal=True)),
    ]
    for fn, np_fn, tensors, scalars, forward in cases:
        got, out = fn(*tensors[:3], *scalars, *tensors[3:], return_out=True, **kw)
        want, want_out = np_fn(*[t.to(wide).numpy() for t in tensors[:3]], *scalars,
                               *[t.to(wide).numpy() for t in tensors[3:]], return_out=True, **kw)
        assert got["rows"] == want["rows"] > 0
        for key, val in want.items():
            if isinstance(val, np.ndarray):
                assert torch.is_tensor(got[key]) and got[key].dtype == torch.float64
                assert np.array_equal(got[key].numpy(), val), key
        assert out.dtype == wide and np.array_equal(out.numpy(), want_out)
        if dtype != torch.bfloat16:  # the kernel's output, bit for bit
            assert torch.equal(out, forward().detach())
        # out= is written in place and returned; stats alone without it
        given = torch.empty_like(out)
        s2, o2 = fn(*tensors[:3], *scalars, *tensors[3:], out=given, **kw)
        assert o2 is given and torch.equal(given, out)
        assert set(fn(*tensors[:3], *scalars, *tensors[3:], **kw)) == set(got)


def test_statistics_errors():
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match="diff_attention_v1_stats: lambda_ must be a number"):
        dt.diff_attention_v1_stats(q, k.expand(1, 4, 2, 8), v, torch.ones(2))
    with pytest.raises(ValueError, match="attention_stats: q has dtype torch.int32"):
        dt.attention_stats(q.to(torch.int32), k, v[..., :8])
    with pytest.raises(ValueError, match="out's last axis must be contiguous"):
        dt.attention_stats(q, k, v, out=torch.empty(1, 4, 4, 32)[..., ::2])
    with pytest.raises(ValueError, match="attention_stats: k must be a tensor, got ndarray"):
        dt.attention_stats(q, k.numpy(), v[..., :8])
    with pytest.raises(ValueError, match="attention_stats"):  # the C++ message: bad shapes
        dt.attention_stats(q, k, v[:, :3])
