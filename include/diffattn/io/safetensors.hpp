/// \file
/// Reading and writing safetensors files (the format of Hugging Face and PyTorch checkpoints).
///
/// Layout of a file:
/// \verbatim
///   8 bytes     N, the header length, unsigned little-endian
///   N bytes     JSON header: {"name": {"dtype": "F32", "shape": [2, 3],
///                                       "data_offsets": [begin, end]}, ...,
///                             "__metadata__": {"key": "value", ...}}   (optional)
///   the rest    the data section; tensor bytes lie at [begin, end) of it,
///               row-major, little-endian.
/// \endverbatim
///
/// The reader checks everything against the file's size before touching data,
/// so a truncated or corrupt file gives diffattn::error, never an out-of-bounds
/// read.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "../config.hpp"
#include "../detail/core/format.hpp"
#include "../detail/io/safetensors_bytes.hpp"
#include "../detail/io/safetensors_json.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
#include "../types.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace safetensors {

/// \addtogroup io
/// @{

/// Size in bytes of one element of a safetensors dtype ("F32", "BF16", ...);
/// 0 for a name the format does not define.
inline index_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, index_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},
      {"I32", 4},  {"F32", 4}, {"U64", 8}, {"I64", 8},     {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

/// True for the dtypes read_as() converts: F16, BF16, F32, F64.
inline bool is_float_dtype(const std::string& dtype) {
  return dtype == "F16" || dtype == "BF16" || dtype == "F32" || dtype == "F64";
}

/// The dtype written for T: "F32" for float, "F64" for double, "BF16" for
/// bfloat16, "F16" for half.
template <class T>
const char* dtype_of() {
  static_assert(
      std::is_same<T, float>::value || std::is_same<T, double>::value || is_half_storage_v<T>,
      "safetensors: only float (F32), double (F64), bfloat16 (BF16) and half (F16) "
      "are written");
  if (std::is_same<T, bfloat16>::value) return "BF16";
  if (std::is_same<T, half>::value) return "F16";
  return std::is_same<T, float>::value ? "F32" : "F64";
}

/// "(2, 3)" for a shape held in a vector.
inline std::string shape_str(const std::vector<index_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + ")";
}

/// One tensor in memory: dtype name, shape, raw little-endian row-major bytes.
struct TensorData {
  /// The safetensors dtype name: "F32", "BF16", "I64", ...
  std::string dtype;
  /// Extents, outermost first (empty for a scalar).
  std::vector<index_t> shape;
  /// The elements, row-major, little-endian: shape's product x dtype_size(dtype) bytes.
  std::vector<unsigned char> bytes;
};

/// Where a tensor lies in the file: offsets relative to the data section.
struct TensorInfo {
  /// The safetensors dtype name: "F32", "BF16", "I64", ...
  std::string dtype;
  /// Extents, outermost first (empty for a scalar).
  std::vector<index_t> shape;
  /// First byte, relative to the data section.
  std::uint64_t begin = 0;
  /// One past the last byte, relative to the data section.
  std::uint64_t end = 0;
  /// Number of elements (product of the extents; 1 for a scalar).
  index_t numel() const {
    index_t n = 1;
    for (index_t e : shape) n *= e;
    return n;
  }
};

/// Converts n elements of a float dtype at `src` to T. BF16 into bfloat16 and
/// F16 into half copy the bits (no widening, NaN payloads kept); any other
/// pair converts the value (to a 16-bit T: rounded to nearest even, through
/// float).
template <class T>
void convert(const std::string& dtype, const unsigned char* src, index_t n, T* dst) {
  using detail::safetensors_load_le;
  if constexpr (is_half_storage_v<T>) {
    if (dtype == dtype_of<T>()) {
      for (index_t i = 0; i < n; ++i) {
        const auto bits = static_cast<std::uint16_t>(safetensors_load_le(src + 2 * i, 2));
        std::memcpy(static_cast<void*>(dst + i), &bits, 2);
      }
      return;
    }
    if (dtype == "F32" || dtype == "F64" || dtype == "F16" || dtype == "BF16") {
      std::vector<float> wide(static_cast<std::size_t>(n));
      convert<float>(dtype, src, n, wide.data());
      for (index_t i = 0; i < n; ++i) dst[i] = static_cast<T>(wide[static_cast<std::size_t>(i)]);
      return;
    }
  }
  if (dtype == "F32") {
    for (index_t i = 0; i < n; ++i)
      dst[i] = static_cast<T>(detail::safetensors_bits_to_f32(
          static_cast<std::uint32_t>(safetensors_load_le(src + 4 * i, 4))));
  } else if (dtype == "F64") {
    for (index_t i = 0; i < n; ++i)
      dst[i] = static_cast<T>(detail::safetensors_bits_to_f64(safetensors_load_le(src + 8 * i, 8)));
  } else if (dtype == "F16") {
    for (index_t i = 0; i < n; ++i)
      dst[i] = static_cast<T>(detail::safetensors_f16_to_f32(
          static_cast<std::uint16_t>(safetensors_load_le(src + 2 * i, 2))));
  } else if (dtype == "BF16") {
    for (index_t i = 0; i < n; ++i)
      dst[i] = static_cast<T>(detail::safetensors_bf16_to_f32(
          static_cast<std::uint16_t>(safetensors_load_le(src + 2 * i, 2))));
  } else {
    detail::fail("safetensors::convert", "dtype ", dtype,
                 " is not a floating-point dtype (F16, BF16, F32 or F64)");
  }
}

/// Encodes n values of T as F32, F64, BF16 or F16 (dtype_of<T>)
/// little-endian bytes, bit for bit.
template <class T>
TensorData make_tensor(std::vector<index_t> shape, const T* data) {
  TensorData t;
  t.dtype = dtype_of<T>();
  index_t bytes = 0;
  if (!detail::safetensors_byte_size(shape, static_cast<index_t>(sizeof(T)), bytes))
    detail::fail("safetensors::make_tensor", "bad shape ", shape_str(shape));
  t.shape = std::move(shape);
  t.bytes.resize(static_cast<std::size_t>(bytes));
  const index_t n = bytes / static_cast<index_t>(sizeof(T));
  for (index_t i = 0; i < n; ++i) {
    if (sizeof(T) == 2) {
      std::uint16_t u;
      std::memcpy(&u, static_cast<const void*>(data + i), 2);
      detail::safetensors_store_le(t.bytes.data() + 2 * i, u, 2);
    } else if (std::is_same<T, float>::value) {
      std::uint32_t u;
      std::memcpy(&u, data + i, 4);
      detail::safetensors_store_le(t.bytes.data() + 4 * i, u, 4);
    } else {
      std::uint64_t u;
      std::memcpy(&u, data + i, 8);
      detail::safetensors_store_le(t.bytes.data() + 8 * i, u, 8);
    }
  }
  return t;
}

/// make_tensor for a Tensor (its shape and contiguous data).
template <class T, std::size_t R>
TensorData make_tensor(const Tensor<T, R>& t) {
  return make_tensor<T>(std::vector<index_t>(t.shape().begin(), t.shape().end()), t.data());
}

/// An open safetensors file: the header is read and checked on construction
/// (every tensor's dtype, shape and byte range against the file size); tensor
/// data is read on demand, so only the tensors asked for are loaded.
///
/// Throws diffattn::error, naming `fn` and the path, when the file cannot be
/// opened, is shorter than 8 bytes, declares a header longer than the file (or
/// than 100 MB), has a malformed header, an unknown dtype, a negative extent,
/// data_offsets outside the data section or with begin > end, or a byte range
/// whose size does not match shape x dtype.
class Reader {
 public:
  /// Opens `path` and reads and checks its header; `fn` is the name error
  /// messages start with.
  explicit Reader(const std::string& path, const std::string& fn = "read_safetensors")
      : path_(path), fn_(fn) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) fail("cannot open the file");
    const std::streamoff size = in.tellg();
    if (size < 0) fail("cannot determine the file size");
    file_size_ = static_cast<std::uint64_t>(size);
    if (file_size_ < 8)
      fail("the file is truncated: ", file_size_,
           " bytes, shorter than the 8-byte header length that starts a safetensors file");
    unsigned char len8[8];
    in.seekg(0);
    in.read(reinterpret_cast<char*>(len8), 8);
    if (!in) fail("cannot read the header length");
    const std::uint64_t header_len = detail::safetensors_load_le(len8, 8);
    if (header_len > file_size_ - 8)
      fail("header length ", header_len, " is beyond the end of the file (", file_size_,
           " bytes): the file is truncated or not safetensors");
    if (header_len > kMaxHeader) fail("header length ", header_len, " exceeds the 100 MB limit");
    std::string header(static_cast<std::size_t>(header_len), '\0');
    in.read(&header[0], static_cast<std::streamsize>(header_len));
    if (!in) fail("cannot read the ", header_len, "-byte header");
    data_start_ = 8 + header_len;
    data_size_ = file_size_ - data_start_;
    parse_header(header);
  }

  /// The file's path, as given.
  const std::string& path() const noexcept { return path_; }
  /// Every tensor of the file by name (the header order is not kept).
  const std::map<std::string, TensorInfo>& tensors() const noexcept { return tensors_; }
  /// The optional "__metadata__" string map.
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /// True when the file has a tensor called `name`.
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  /// Header entry of `name`; throws when the file has no such tensor.
  const TensorInfo& info(const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("no tensor '", name, "' in the file");
    return it->second;
  }

  /// Raw bytes of `name`.
  std::vector<unsigned char> read_bytes(const std::string& name) const {
    const TensorInfo& t = info(name);
    std::vector<unsigned char> bytes(static_cast<std::size_t>(t.end - t.begin));
    if (bytes.empty()) return bytes;
    std::ifstream in(path_, std::ios::binary);
    if (!in) fail("cannot open the file");
    in.seekg(static_cast<std::streamoff>(data_start_ + t.begin));
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!in || static_cast<std::size_t>(in.gcount()) != bytes.size())
      fail("cannot read the ", bytes.size(), " bytes of tensor '", name,
           "': the file changed or is truncated");
    return bytes;
  }

  /// The whole tensor `name` with its header entry.
  TensorData read(const std::string& name) const {
    const TensorInfo& t = info(name);
    return TensorData{t.dtype, t.shape, read_bytes(name)};
  }

  /// Tensor `name` converted to T (from F16, BF16, F32 or F64), row-major.
  template <class T>
  std::vector<T> read_as(const std::string& name) const {
    const TensorInfo& t = info(name);
    if (!is_float_dtype(t.dtype))
      fail("tensor '", name, "' has dtype ", t.dtype, ", expected F16, BF16, F32 or F64");
    const std::vector<unsigned char> bytes = read_bytes(name);
    std::vector<T> out(static_cast<std::size_t>(t.numel()));
    convert<T>(t.dtype, bytes.data(), t.numel(), out.data());
    return out;
  }

  /// Tensor `name` as a Tensor<T, R> (see convert(): BF16 into bfloat16 and
  /// F16 into half keep their bits). Throws when the file's rank is not R.
  template <class T, std::size_t R>
  Tensor<T, R> read_tensor(const std::string& name) const {
    const TensorInfo& t = info(name);
    if (!is_float_dtype(t.dtype))
      fail("tensor '", name, "' has dtype ", t.dtype, ", expected F16, BF16, F32 or F64");
    if (t.shape.size() != R)
      fail("tensor '", name, "' has shape ", shape_str(t.shape), ", expected rank ", R);
    std::array<index_t, R> shape{};
    std::copy(t.shape.begin(), t.shape.end(), shape.begin());
    Tensor<T, R> out(shape);
    const std::vector<unsigned char> bytes = read_bytes(name);
    convert<T>(t.dtype, bytes.data(), t.numel(), out.data());
    return out;
  }

 private:
  static constexpr std::uint64_t kMaxHeader = 100000000;  // the format's own limit

  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    detail::fail(fn_.c_str(), "'", path_, "': ", args...);
  }

  void parse_header(const std::string& header) {
    using Json = detail::SafetensorsJson;
    const std::string where = detail::cat(fn_, ": '", path_, "'");
    const Json root = detail::SafetensorsJsonParser(where, header.data(), header.size()).parse();
    if (root.kind != Json::Kind::object)
      fail("header is not a JSON object but a", root.kind == Json::Kind::array ? "n " : " ",
           Json::kind_name(root.kind));
    for (std::size_t i = 0; i < root.keys.size(); ++i) {
      const std::string& name = root.keys[i];
      const Json& v = root.values[i];
      if (name == "__metadata__") {
        if (v.kind != Json::Kind::object) fail("__metadata__ is not an object");
        for (std::size_t j = 0; j < v.keys.size(); ++j) {
          if (v.values[j].kind != Json::Kind::string)
            fail("__metadata__ entry '", v.keys[j], "' is not a string");
          metadata_[v.keys[j]] = v.values[j].string;
        }
        continue;
      }
      if (tensors_.count(name)) fail("tensor '", name, "' appears twice in the header");
      tensors_[name] = parse_entry(name, v);
    }
    // Two tensors may not share bytes: a file that aliases data is corrupt.
    std::vector<std::pair<const std::string*, const TensorInfo*>> by_begin;
    for (const auto& kv : tensors_)
      if (kv.second.end > kv.second.begin) by_begin.emplace_back(&kv.first, &kv.second);
    std::sort(by_begin.begin(), by_begin.end(),
              [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
    for (std::size_t i = 1; i < by_begin.size(); ++i) {
      const TensorInfo& prev = *by_begin[i - 1].second;
      const TensorInfo& cur = *by_begin[i].second;
      if (cur.begin < prev.end)
        fail("tensors '", *by_begin[i - 1].first, "' [", prev.begin, ", ", prev.end, ") and '",
             *by_begin[i].first, "' [", cur.begin, ", ", cur.end, ") overlap in the data section");
    }
  }

  const detail::SafetensorsJson& member(const std::string& name, const detail::SafetensorsJson& v,
                                        const char* key) const {
    for (std::size_t i = 0; i < v.keys.size(); ++i)
      if (v.keys[i] == key) return v.values[i];
    fail("tensor '", name, "' has no \"", key, "\" field");
  }

  TensorInfo parse_entry(const std::string& name, const detail::SafetensorsJson& v) const {
    using Json = detail::SafetensorsJson;
    if (v.kind != Json::Kind::object) fail("tensor '", name, "' is not a JSON object");
    TensorInfo t;
    const Json& dtype = member(name, v, "dtype");
    if (dtype.kind != Json::Kind::string) fail("tensor '", name, "': dtype is not a string");
    t.dtype = dtype.string;
    const index_t elem = dtype_size(t.dtype);
    if (elem == 0) fail("tensor '", name, "' has unknown dtype '", t.dtype, "'");

    const Json& shape = member(name, v, "shape");
    if (shape.kind != Json::Kind::array) fail("tensor '", name, "': shape is not an array");
    for (const Json& e : shape.array) {
      if (e.kind != Json::Kind::integer || e.integer < 0)
        fail("tensor '", name, "': shape holds a negative or non-integer extent");
      t.shape.push_back(static_cast<index_t>(e.integer));
    }

    const Json& off = member(name, v, "data_offsets");
    if (off.kind != Json::Kind::array || off.array.size() != 2 ||
        off.array[0].kind != Json::Kind::integer || off.array[1].kind != Json::Kind::integer)
      fail("tensor '", name, "': data_offsets is not an array of two integers");
    const std::int64_t b = off.array[0].integer, e = off.array[1].integer;
    if (b < 0 || e < b)
      fail("tensor '", name, "' has data_offsets [", b, ", ", e, "]: expected 0 <= begin <= end");
    t.begin = static_cast<std::uint64_t>(b);
    t.end = static_cast<std::uint64_t>(e);
    if (t.end > data_size_)
      fail("tensor '", name, "' has data_offsets [", b, ", ", e,
           "] out of range: the data section has ", data_size_,
           " bytes (the file is truncated or corrupt)");
    index_t bytes = 0;
    if (!detail::safetensors_byte_size(t.shape, elem, bytes))
      fail("tensor '", name, "' has shape ", shape_str(t.shape), " too large to address");
    if (static_cast<std::uint64_t>(bytes) != t.end - t.begin)
      fail("tensor '", name, "' has ", t.end - t.begin, " bytes for shape ", shape_str(t.shape),
           " of ", t.dtype, ": byte size does not match shape (expected ", bytes, ")");
    return t;
  }

  std::string path_;
  std::string fn_;
  std::uint64_t file_size_ = 0;
  std::uint64_t data_start_ = 0;
  std::uint64_t data_size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// @}

}  // namespace safetensors

/// \ingroup io
/// Reads every tensor of a safetensors file: name -> {dtype, shape, bytes}.
/// See safetensors::Reader for what is checked; use the Reader directly to load
/// only some tensors of a large file.
inline std::map<std::string, safetensors::TensorData> read_safetensors(const std::string& path) {
  const safetensors::Reader reader(path);
  std::map<std::string, safetensors::TensorData> out;
  for (const auto& kv : reader.tensors()) out[kv.first] = reader.read(kv.first);
  return out;
}

/// \ingroup io
/// Writes tensors (any dtype the format defines) and optional string metadata
/// as a safetensors file: tensors in name order, the header padded with spaces
/// to a multiple of 8 bytes. Throws diffattn::error for an unknown dtype, a byte
/// count that does not match shape x dtype, the reserved name "__metadata__",
/// or a file that cannot be written.
inline void write_safetensors(const std::string& path,
                              const std::map<std::string, safetensors::TensorData>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  constexpr const char* fn = "write_safetensors";
  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (const auto& kv : metadata) {
      if (!first) header += ",";
      first = false;
      detail::safetensors_json_quote(header, kv.first);
      header += ":";
      detail::safetensors_json_quote(header, kv.second);
    }
    header += "}";
    first = false;
  }
  std::uint64_t offset = 0;
  for (const auto& kv : tensors) {
    const safetensors::TensorData& t = kv.second;
    if (kv.first == "__metadata__")
      detail::fail(fn, "'__metadata__' is reserved, not a tensor name");
    const index_t elem = safetensors::dtype_size(t.dtype);
    if (elem == 0) detail::fail(fn, "tensor '", kv.first, "' has unknown dtype '", t.dtype, "'");
    index_t bytes = 0;
    if (!detail::safetensors_byte_size(t.shape, elem, bytes) ||
        static_cast<std::size_t>(bytes) != t.bytes.size())
      detail::fail(fn, "tensor '", kv.first, "' has ", t.bytes.size(), " bytes for shape ",
                   safetensors::shape_str(t.shape), " of ", t.dtype);
    if (!first) header += ",";
    first = false;
    detail::safetensors_json_quote(header, kv.first);
    header += ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      if (i) header += ",";
      header += std::to_string(t.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + t.bytes.size()) + "]}";
    offset += t.bytes.size();
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) detail::fail(fn, "cannot open '", path, "' for writing");
  unsigned char len8[8];
  detail::safetensors_store_le(len8, header.size(), 8);
  out.write(reinterpret_cast<const char*>(len8), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& kv : tensors)
    out.write(reinterpret_cast<const char*>(kv.second.bytes.data()),
              static_cast<std::streamsize>(kv.second.bytes.size()));
  out.flush();
  if (!out) detail::fail(fn, "writing '", path, "' failed");
}

DIFFATTN_END_NAMESPACE
