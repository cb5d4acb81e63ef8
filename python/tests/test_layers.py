"""The C++ layers from Python: parameters() as writable views, backward and
gradients, KV caches, safetensors written by PyTorch code loaded into them."""

import json
import struct

import numpy as np
import pytest

import diffattn

RNG = np.random.default_rng(11)


def save_safetensors(path, tensors):
    """A safetensors file in a few lines: 8-byte header length, JSON header, raw bytes."""
    codes = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    types = {"F32": np.float32, "F64": np.float64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=types[info["dtype"]]).reshape(
            info["shape"])
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_parameters_are_writable_views(dtype):
    layer = diffattn.MultiheadDiffAttnV1(32, 1, 2, 1, dtype=dtype, seed=3)
    p = layer.parameters()
    assert set(p) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight",
                      "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight"}
    assert p["q_proj.weight"].shape == (32, 32) and p["k_proj.weight"].shape == (16, 32)
    assert p["q_proj.weight"].dtype == dtype and p["q_proj.weight"].flags.writeable
    x = RNG.standard_normal((1, 6, 32)).astype(dtype)
    y0 = layer.forward(x)
    p["out_proj.weight"][:] *= 2  # writes through to the layer
    assert np.allclose(layer.forward(x), 2 * y0, rtol=1e-5)
    again = layer.parameters()["out_proj.weight"]
    assert again.__array_interface__["data"][0] == p["out_proj.weight"].__array_interface__["data"][0]
    del layer  # the views keep the layer alive
    assert np.isfinite(p["q_proj.weight"]).all()


@pytest.mark.parametrize("version", [1, 2])
def test_backward_against_finite_differences(version):
    cls = diffattn.MultiheadDiffAttnV1 if version == 1 else diffattn.MultiheadDiffAttnV2
    layer = cls(16, 1, 2, 1, dtype=np.float64, seed=5)
    x = RNG.standard_normal((2, 5, 16))
    g = RNG.standard_normal((2, 5, 16))
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(g)
    grads = layer.gradients()
    eps = 1e-6
    u = RNG.standard_normal(x.shape)
    num = (np.sum(g * layer.forward(x + eps * u)) - np.sum(g * layer.forward(x - eps * u))) / (2 * eps)
    assert abs(num - np.sum(dx * u)) <= 1e-7 * max(1, abs(num))
    for name, w in layer.parameters().items():
        du = RNG.standard_normal(w.shape)
        w += eps * du
        plus = np.sum(g * layer.forward(x))
        w -= 2 * eps * du
        minus = np.sum(g * layer.forward(x))
        w += eps * du
        num = (plus - minus) / (2 * eps)
        assert abs(num - np.sum(grads[name] * du)) <= 1e-7 * max(1, abs(num)), name
    assert np.allclose(layer.forward(x), y, rtol=0, atol=1e-12)
    layer.zero_grad()
    assert all(np.all(v == 0) for v in layer.gradients().values())


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("cache_dtype,tol", [(None, 1e-5), ("bfloat16", 2e-2), ("int8", 2e-2)])
def test_cached_forward(version, cache_dtype, tol):
    cls = diffattn.MultiheadDiffAttnV1 if version == 1 else diffattn.MultiheadDiffAttnV2
    layer = cls(32, 2, 2, 1, seed=2)
    x = RNG.standard_normal((2, 12, 32)).astype(np.float32)
    full = layer.forward(x)
    cache = layer.make_cache(2, 16, dtype=cache_dtype)
    parts = [layer.forward(x[:, :5], cache)] + [layer.forward(x[:, i:i + 1], cache)
                                               for i in range(5, 12)]
    assert cache.size() == 12 and cache.capacity() == 16
    err = np.max(np.abs(np.concatenate(parts, axis=1) - full)) / np.max(np.abs(full))
    assert err <= tol, err
    with pytest.raises(ValueError, match="capacity"):
        layer.forward(x[:, :5], cache)
    assert cache.size() == 12
    k = cache.keys()
    assert k.shape[1] == 12 and not k.flags.writeable


def test_packed_forward():
    layer = diffattn.MultiheadDiffAttnV2(32, 0, 2, 1, seed=4)
    a, b = RNG.standard_normal((1, 5, 32)), RNG.standard_normal((1, 7, 32))
    x = np.concatenate([a, b], axis=1).astype(np.float32)
    y = layer.forward(x, diffattn.PackedSequences.from_lengths([5, 7]))
    assert np.allclose(y[:, :5], layer.forward(x[:, :5]), atol=1e-6)
    assert np.allclose(y[:, 5:], layer.forward(x[:, 5:]), atol=1e-6)


def test_safetensors_roundtrip_and_errors(tmp_path):
    layer = diffattn.MultiheadDiffAttnV2(32, 0, 4, 2, seed=1)
    path = str(tmp_path / "v2.safetensors")
    layer.save_safetensors(path, "model.layers.0.self_attn.")
    tensors = load_safetensors(path)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    other = diffattn.MultiheadDiffAttnV2(32, 0, 4, 2, seed=9)
    other.load_safetensors(path, "model.layers.0.self_attn.")
    x = RNG.standard_normal((1, 4, 32)).astype(np.float32)
    assert np.array_equal(other.forward(x), layer.forward(x))
    with pytest.raises(ValueError, match="MultiheadDiffAttnV2::load_safetensors"):
        other.load_safetensors(path, "wrong.")
    with pytest.raises(ValueError, match="MultiheadDiffAttnV2::forward: x has shape"):
        other.forward(np.zeros((1, 4, 31), np.float32))
    with pytest.raises(ValueError, match="backward"):
        diffattn.MultiheadDiffAttnV1(32, 0, 2).backward(np.zeros((1, 4, 32), np.float32))
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        diffattn.MultiheadDiffAttnV2(32, 0, 2, dtype=np.int32)


@pytest.mark.parametrize("version", [1, 2])
def test_torch_state_dict_in_safetensors(tmp_path, version):
    """A state_dict of the papers' PyTorch module, written as safetensors by the
    few lines above, loads into the C++ layer, which then computes what PyTorch
    computes; gradients agree as well."""
    torch = pytest.importorskip("torch")
    import eager_modules as eager
    torch.manual_seed(version)
    e, h, hkv = 64, 4, 2
    ref = (eager.EagerDiffAttnV1 if version == 1 else eager.EagerDiffAttnV2)(e, 3, h, hkv).double()
    path = str(tmp_path / "ref.safetensors")
    save_safetensors(path, {"layers.3.attn." + k: v.numpy() for k, v in ref.state_dict().items()})
    layer = (diffattn.MultiheadDiffAttnV1 if version == 1 else diffattn.MultiheadDiffAttnV2)(
        e, 3, h, hkv, dtype=np.float64)
    layer.load_safetensors(path, "layers.3.attn.")
    x = torch.randn(2, 11, e, dtype=torch.float64, requires_grad=True)
    y_ref = ref(x)
    y = layer.forward(x.detach().numpy())
    assert np.max(np.abs(y - y_ref.detach().numpy())) <= 1e-12 * np.max(np.abs(y))
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    layer.zero_grad()
    dx = layer.backward(g.numpy())
    assert np.allclose(dx, x.grad.numpy(), rtol=0, atol=1e-11)
    grads = layer.gradients()
    for name, p in ref.named_parameters():
        assert np.allclose(grads[name], p.grad.numpy(), rtol=0, atol=1e-11), name
    # and in float32, from an F32 file
    save_safetensors(path, {k: v.float().numpy() for k, v in ref.state_dict().items()})
    layer32 = (diffattn.MultiheadDiffAttnV1 if version == 1 else diffattn.MultiheadDiffAttnV2)(
        e, 3, h, hkv)
    layer32.load_safetensors(path)
    y32 = layer32.forward(x.detach().float().numpy())
    assert np.max(np.abs(y32 - y)) <= 1e-5 * np.max(np.abs(y))
    # the diffattn.torch module takes the same state_dict
    import diffattn.torch as dt
    mod = (dt.MultiheadDiffAttnV1 if version == 1 else dt.MultiheadDiffAttnV2)(
        e, 3, h, hkv, dtype=torch.float64)
    mod.load_state_dict(ref.state_dict())
    assert np.max(np.abs(mod(x).detach().numpy() - y)) <= 1e-12 * np.max(np.abs(y))


def test_layer_score_modifiers():
    layer = diffattn.MultiheadDiffAttnV2(32, 0, 2, 1, softcap=30.0, alibi=True, sinks=True,
                                         dtype=np.float64, seed=6)
    p = layer.parameters()
    assert p["sinks"].shape == (4,)
    x = RNG.standard_normal((1, 6, 32))
    g = RNG.standard_normal((1, 6, 32))
    layer.zero_grad()
    layer.forward(x)
    layer.backward(g)
    eps, u = 1e-6, RNG.standard_normal(4)
    p["sinks"][:] += eps * u
    plus = np.sum(g * layer.forward(x))
    p["sinks"][:] -= 2 * eps * u
    minus = np.sum(g * layer.forward(x))
    p["sinks"][:] += eps * u
    num = (plus - minus) / (2 * eps)
    assert abs(num - np.sum(layer.gradients()["sinks"] * u)) <= 1e-7 * max(1, abs(num))


def test_one_layer_from_several_threads():
    # The layers release the GIL: calls on one layer (and on one cache) from
    # several Python threads take turns on it instead of racing on its state.
    import threading

    layer = diffattn.MultiheadDiffAttnV2(128, 1, 4, 2, seed=3)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((1, n, 128)).astype(np.float32) for n in (48, 130, 17, 96)]
    want = [layer.forward(x) for x in xs]
    cache = layer.make_cache(1, 64 * 4 * 8)
    failures = []

    def work(i):
        try:
            for it in range(60):
                j = (i + it) % 4
                if not np.array_equal(layer.forward(xs[j]), want[j]):
                    failures.append(f"thread {i} step {it}: forward differs")
                if it % 4 == 0:
                    try:
                        layer.backward(np.ones((1, 48, 128), np.float32))
                    except ValueError as e:  # another thread's call came last
                        assert "last forward" in str(e) or "before forward" in str(e), str(e)
                if it % 8 == 0:
                    layer.forward(xs[0][:, :1], cache)
                    cache.keys()
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"thread {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert cache.size() == 4 * 8
