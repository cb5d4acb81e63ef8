// What the binding's translation units share: numpy arrays as diffattn views
// (zero-copy), the storage types as numpy dtypes, new output arrays, the
// attention options as keyword arguments. The bindings stay thin: they convert
// arguments and call the C++ entry points, which check everything and throw
// diffattn::error (ValueError in Python).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include <diffattn/detail/core/memory.hpp>
#include <diffattn/diffattn.hpp>

namespace diffattn_py {

namespace py = pybind11;
using diffattn::bfloat16;
using diffattn::float8_e4m3;
using diffattn::half;
using diffattn::index_t;
using diffattn::TensorView;

/// Storage types as Python sees them. numpy has no bfloat16 and no e4m3:
/// their bits travel as uint16 and uint8 arrays (diffattn.torch converts
/// torch.bfloat16 tensors without a copy).
enum class DType { f32, f64, bf16, f16, i8, e4m3, other };

template <class T>
struct dtype_of_t;
template <>
struct dtype_of_t<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of_t<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of_t<bfloat16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of_t<half> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of_t<std::int8_t> {
  static constexpr DType value = DType::i8;
};
template <>
struct dtype_of_t<float8_e4m3> {
  static constexpr DType value = DType::e4m3;
};
template <class T>
constexpr DType dtype_v = dtype_of_t<T>::value;

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16 (uint16 bits)";
    case DType::f16: return "float16";
    case DType::i8: return "int8";
    case DType::e4m3: return "float8_e4m3 (uint8 bits)";
    default: return "unsupported";
  }
}

/// The numpy dtype that holds storage T.
template <class T>
py::dtype np_dtype() {
  if constexpr (std::is_same<T, float>::value) return py::dtype::of<float>();
  if constexpr (std::is_same<T, double>::value) return py::dtype::of<double>();
  if constexpr (std::is_same<T, bfloat16>::value) return py::dtype::of<std::uint16_t>();
  if constexpr (std::is_same<T, half>::value) return py::dtype("float16");
  if constexpr (std::is_same<T, std::int8_t>::value) return py::dtype::of<std::int8_t>();
  if constexpr (std::is_same<T, float8_e4m3>::value) return py::dtype::of<std::uint8_t>();
}

inline DType dtype_of(const py::array& a) {
  const py::dtype d = a.dtype();
  const char kind = d.kind();
  const auto size = d.itemsize();
  if (kind == 'f' && size == 4) return DType::f32;
  if (kind == 'f' && size == 8) return DType::f64;
  if (kind == 'f' && size == 2) return DType::f16;
  if (kind == 'u' && size == 2) return DType::bf16;
  if (kind == 'i' && size == 1) return DType::i8;
  if (kind == 'u' && size == 1) return DType::e4m3;
  return DType::other;
}

template <class... Args>
[[noreturn]] void fail(const char* fn, const Args&... args) {
  diffattn::detail::fail(fn, args...);
}

/// An argument as an ndarray (numpy converts lists and objects with
/// __array__; an ndarray passes as is, never copied).
inline py::array as_array(const py::handle& h) {
  if (py::isinstance<py::array>(h)) return py::reinterpret_borrow<py::array>(h);
  return py::array::ensure(h);
}

/// A view of `a` as storage T, rank R, strides in elements (any strides; the
/// kernels require the last axis contiguous and say so).
template <class T, std::size_t R>
TensorView<T, R> view_of(const char* fn, const char* name, const py::array& a) {
  using V = std::remove_const_t<T>;
  if (dtype_of(a) != dtype_v<V>)
    fail(fn, name, " has dtype ", std::string(py::str(a.dtype())), ", expected ",
         dtype_name(dtype_v<V>));
  if (static_cast<std::size_t>(a.ndim()) != R)
    fail(fn, name, " has ", a.ndim(), " dimensions, expected ", R);
  std::array<index_t, R> shape{}, strides{};
  for (std::size_t i = 0; i < R; ++i) shape[i] = a.shape(i);
  if (a.size() == 0) {
    // No element to address: numpy gives an empty array any strides (zeros in
    // recent versions), so the view takes the C-contiguous ones.
    index_t s = 1;
    for (std::size_t i = R; i-- > 0; s *= std::max<index_t>(shape[i], 1)) strides[i] = s;
  } else {
    for (std::size_t i = 0; i < R; ++i) {
      const index_t s = a.strides(i);
      if (s % static_cast<index_t>(sizeof(V)) != 0)
        fail(fn, name, " has a stride of ", s, " bytes on axis ", i,
             ", not a multiple of its element size ", sizeof(V));
      strides[i] = s / static_cast<index_t>(sizeof(V));
    }
  }
  if constexpr (std::is_const<T>::value) {
    return TensorView<T, R>(static_cast<T*>(a.data()), shape, strides);
  } else {
    if (!a.writeable()) fail(fn, name, " is read-only");
    return TensorView<T, R>(static_cast<T*>(const_cast<void*>(a.data())), shape, strides);
  }
}

/// A new C-contiguous array of storage T, uninitialised. One of 2 MiB or more
/// sits on transparent huge pages, as diffattn's Tensor does (one page fault
/// per 2 MiB: the kernels' outputs and gradients are written into fresh
/// memory on every call).
template <class T, std::size_t R>
py::array new_array(const std::array<index_t, R>& shape) {
  std::vector<py::ssize_t> s(shape.begin(), shape.end());
  std::size_t bytes = sizeof(T);
  for (index_t e : shape) bytes *= static_cast<std::size_t>(e);
  if (bytes < diffattn::detail::huge_page_bytes) return py::array(np_dtype<T>(), s);
  struct Free {
    void operator()(void* q) const noexcept {
      ::operator delete(q, std::align_val_t(diffattn::detail::huge_page_bytes));
    }
  };
  std::unique_ptr<void, Free> buffer(
      diffattn::detail::allocate_uninitialized(bytes, alignof(std::max_align_t)));
  py::capsule owner(buffer.get(), [](void* q) { Free{}(q); });
  void* p = buffer.release();  // the capsule owns it now
  return py::array(np_dtype<T>(), s, p, owner);
}

/// An output: `given` (an ndarray, written in place; the kernel checks its
/// shape) or a new array of `shape`.
template <class T, std::size_t R>
py::array output(const char* fn, const char* name, const py::object& given,
                 const std::array<index_t, R>& shape) {
  if (given.is_none()) return new_array<T, R>(shape);
  if (!py::isinstance<py::array>(given))
    fail(fn, name, "= must be a numpy array, got ", std::string(py::str(py::type::of(given))));
  return py::reinterpret_borrow<py::array>(given);
}

/// An integer array (index_t, contiguous; converted if need be: offsets and
/// lengths are small). Only integer dtypes are taken (an empty array of any
/// dtype too, as np.asarray([]) is float64): a float or bool array would be
/// truncated without a word.
inline py::array_t<index_t, py::array::c_style | py::array::forcecast> int_array(
    const char* fn, const char* name, const py::handle& h) {
  const py::array raw = as_array(h);
  if (!raw) fail(fn, name, " must be an array of integers");
  const char kind = raw.dtype().kind();
  if (kind != 'i' && kind != 'u' && raw.size() != 0)
    fail(fn, name, " has dtype ", std::string(py::str(raw.dtype())), ", expected integers");
  return py::array_t<index_t, py::array::c_style | py::array::forcecast>::ensure(raw);
}

template <std::size_t R>
TensorView<const index_t, R> int_view(const char* fn, const char* name,
                                      const py::array_t<index_t, py::array::c_style |
                                                                     py::array::forcecast>& a) {
  if (!a) fail(fn, name, " must be an array of integers");
  if (static_cast<std::size_t>(a.ndim()) != R)
    fail(fn, name, " has ", a.ndim(), " dimensions, expected ", R);
  std::array<index_t, R> shape{};
  for (std::size_t i = 0; i < R; ++i) shape[i] = a.shape(i);
  return TensorView<const index_t, R>(a.data(), shape);
}

inline std::vector<index_t> int_vector(const char* fn, const char* name, const py::handle& h) {
  const auto a = int_array(fn, name, h);
  if (!a || a.ndim() != 1) fail(fn, name, " must be a 1-D sequence of integers");
  return std::vector<index_t>(a.data(), a.data() + a.shape(0));
}

/// The options every kernel takes as keyword arguments.
inline diffattn::AttentionOptions make_options(bool causal, index_t window_left,
                                               index_t window_right, double scale,
                                               int num_threads) {
  diffattn::AttentionOptions o;
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.scale = scale;
  o.num_threads = num_threads;
  return o;
}

/// Options with the score modifiers, and the float32 arrays they view.
struct OptionsHolder {
  diffattn::AttentionOptions options;
  py::array_t<float, py::array::c_style | py::array::forcecast> alibi_slopes, sinks;
};

inline OptionsHolder make_options(bool causal, index_t window_left, index_t window_right,
                                  double scale, int num_threads, double softcap,
                                  const py::object& alibi_slopes, const py::object& sinks) {
  OptionsHolder h;
  h.options = make_options(causal, window_left, window_right, scale, num_threads);
  h.options.softcap = static_cast<float>(softcap);
  auto vec = [](const char* name, const py::object& o,
                py::array_t<float, py::array::c_style | py::array::forcecast>& keep)
      -> TensorView<const float, 1> {
    if (o.is_none()) return {};
    keep = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(o);
    if (!keep || keep.ndim() != 1)
      fail("options", name, " must be a 1-D array (Hq) of numbers");
    return TensorView<const float, 1>(keep.data(), {static_cast<index_t>(keep.shape(0))});
  };
  h.options.alibi_slopes = vec("alibi_slopes", alibi_slopes, h.alibi_slopes);
  h.options.sinks = vec("sinks", sinks, h.sinks);
  return h;
}

template <class T>
struct Tag {
  using type = T;
};

/// Calls f(Tag<T>{}) for the floating storage type of `t` (float, double, and
/// with Halves bfloat16 and half), or fails naming `name`.
template <bool Halves = true, class F>
py::object visit_float(const char* fn, const char* name, DType t, F&& f) {
  if (t == DType::f32) return f(Tag<float>{});
  if (t == DType::f64) return f(Tag<double>{});
  if constexpr (Halves) {
    if (t == DType::bf16) return f(Tag<bfloat16>{});
    if (t == DType::f16) return f(Tag<half>{});
  }
  fail(fn, name, " has dtype ", dtype_name(t), ", expected float32, float64",
       Halves ? ", float16 or bfloat16 (its bits as uint16)" : " (gradients need float storage)");
}

}  // namespace diffattn_py

#define DIFFATTN_PY_OPTION_ARGS                                                           \
  py::arg("causal") = false, py::arg("window_left") = -1, py::arg("window_right") = -1, \
      py::arg("scale") = 0.0, py::arg("num_threads") = 0, py::arg("softcap") = 0.0,      \
      py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none()
