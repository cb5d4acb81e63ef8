#include <catch2/catch.hpp>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <diffattn/io/safetensors.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "support.hpp"

using diffattn::index_t;
namespace st = diffattn::safetensors;

namespace {

std::string temp_path(const std::string& name) {
  return std::string("diffattn_test_safetensors_") + name + ".safetensors";
}

/// A file from a raw header and data section, with the correct 8-byte length.
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  out << header << data;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string le16(std::uint16_t v) {
  return std::string{static_cast<char>(v & 0xFF), static_cast<char>(v >> 8)};
}

}  // namespace

TEST_CASE("write then read reproduces tensors and metadata bit for bit", "[safetensors]") {
  const std::string path = temp_path("roundtrip");
  const std::vector<float> a = {1.5f, -2.25f, 3.0e-39f /* subnormal */, 7.0f, -0.0f, 1e30f};
  const std::vector<double> b = {3.141592653589793, -1e-300, 2.0};
  std::map<std::string, st::TensorData> tensors;
  tensors["layer.a"] = st::make_tensor<float>({2, 3}, a.data());
  tensors["b \"quoted\"\\ name\n"] = st::make_tensor<double>({3}, b.data());
  tensors["scalar"] = st::make_tensor<double>({}, b.data());
  tensors["empty"] = st::make_tensor<float>({0, 4}, a.data());
  diffattn::write_safetensors(path, tensors, {{"format", "pt"}, {"note", "caf\xc3\xa9"}});

  const std::string raw = read_file(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(raw[i]);
  CHECK((8 + n) % 8 == 0);  // data section aligned

  const st::Reader r(path);
  CHECK(r.metadata().at("format") == "pt");
  CHECK(r.metadata().at("note") == "caf\xc3\xa9");
  REQUIRE(r.tensors().size() == 4);
  CHECK(r.info("layer.a").dtype == "F32");
  CHECK(r.info("layer.a").shape == std::vector<index_t>{2, 3});
  CHECK(r.info("scalar").shape.empty());
  CHECK(r.info("empty").shape == std::vector<index_t>{0, 4});
  const std::vector<float> a2 = r.read_as<float>("layer.a");
  REQUIRE(a2.size() == a.size());
  CHECK(std::memcmp(a2.data(), a.data(), a.size() * sizeof(float)) == 0);
  const std::vector<double> b2 = r.read_as<double>("b \"quoted\"\\ name\n");
  CHECK(std::memcmp(b2.data(), b.data(), b.size() * sizeof(double)) == 0);
  CHECK(r.read_as<double>("scalar") == std::vector<double>{b[0]});
  CHECK(r.read_as<float>("empty").empty());
  // F32 read as double is exact
  const std::vector<double> a3 = r.read_as<double>("layer.a");
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a3[i] == static_cast<double>(a[i]));

  const auto all = diffattn::read_safetensors(path);
  REQUIRE(all.size() == 4);
  CHECK(all.at("layer.a").bytes == tensors["layer.a"].bytes);
  std::remove(path.c_str());
}

TEST_CASE("F16 and BF16 are decoded exactly", "[safetensors]") {
  const std::string path = temp_path("half");
  // F16: 1, -2.5, 65504 (max), 2^-24 (smallest subnormal), 1023 * 2^-24 (largest
  // subnormal), 2^-14 (smallest normal), -0, +inf.
  const std::uint16_t f16[] = {0x3C00, 0xC100, 0x7BFF, 0x0001, 0x03FF, 0x0400, 0x8000, 0x7C00};
  const double f16_val[] = {1.0,
                            -2.5,
                            65504.0,
                            std::ldexp(1.0, -24),
                            1023 * std::ldexp(1.0, -24),
                            std::ldexp(1.0, -14),
                            -0.0,
                            INFINITY};
  // BF16: 1, -2, 3.140625 (0x4049), 1e38-ish (0x7E96), smallest normal 2^-126.
  const std::uint16_t bf16[] = {0x3F80, 0xC000, 0x4049, 0x0080};
  const double bf16_val[] = {1.0, -2.0, 3.140625, std::ldexp(1.0, -126)};
  std::string data, half_bytes, bf_bytes;
  for (std::uint16_t h : f16) half_bytes += le16(h);
  for (std::uint16_t h : bf16) bf_bytes += le16(h);
  data = half_bytes + bf_bytes;
  const std::string header =
      "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,4],\"data_offsets\":[0,16]},"
      "\"bf\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[16,24]}}";
  write_raw(path, header, data);
  const st::Reader r(path);
  const std::vector<double> h = r.read_as<double>("h");
  for (int i = 0; i < 8; ++i) {
    INFO(i);
    CHECK(h[i] == f16_val[i]);
    CHECK(std::signbit(h[i]) == std::signbit(f16_val[i]));
  }
  const std::vector<float> b = r.read_as<float>("bf");
  for (int i = 0; i < 4; ++i) CHECK(b[i] == static_cast<float>(bf16_val[i]));
  // NaN stays NaN
  write_raw(path, "{\"n\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}", le16(0x7E00));
  CHECK(std::isnan(st::Reader(path).read_as<float>("n")[0]));
  std::remove(path.c_str());
}

TEST_CASE("every F16 value decodes like a float conversion of its bits", "[safetensors]") {
  // Cross-check the bit manipulation with a computation from the definition.
  for (std::uint32_t u = 0; u < 0x10000; ++u) {
    const std::uint16_t hbits = static_cast<std::uint16_t>(u);
    const int sign = hbits >> 15, exp = (hbits >> 10) & 0x1F, mant = hbits & 0x3FF;
    const float got = diffattn::detail::safetensors_f16_to_f32(hbits);
    if (exp == 31) {
      if (mant == 0)
        CHECK(std::isinf(got));
      else
        CHECK(std::isnan(got));
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
    const double ref = sign ? -mag : mag;
    if (static_cast<double>(got) != ref || std::signbit(got) != (sign == 1)) {
      INFO("bits " << u);
      CHECK(static_cast<double>(got) == ref);
    }
  }
}

TEST_CASE("the JSON header: escapes, unicode, whitespace, extra fields", "[safetensors]") {
  const std::string path = temp_path("json");
  const std::string header =
      " { \"__metadata__\" : { \"k\\u00e9y\" : \"a\\\"b\\\\c\\/d\\n\\t\\ud83d\\ude00\" } ,\n"
      "\"x\\u0041\":{\"data_offsets\":[0,4],\"shape\":[1],\"dtype\":\"I32\",\"extra\":[[],{}]}}"
      "\r\n";
  write_raw(path, header, std::string(4, '\0'));
  const st::Reader r(path);
  CHECK(r.metadata().at("k\xc3\xa9y") == "a\"b\\c/d\n\t\xf0\x9f\x98\x80");
  CHECK(r.contains("xA"));
  CHECK(r.info("xA").dtype == "I32");
  test::require_error([&] { r.read_as<float>("xA"); }, {"'xA'", "dtype I32", "F32"});
  std::remove(path.c_str());
}

TEST_CASE("corrupt files throw diffattn::error and never read out of bounds", "[safetensors]") {
  const std::string path = temp_path("corrupt");
  const std::string good_entry = "\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
  const std::string data(8, '\x01');

  test::require_error([&] { st::Reader("/nonexistent/dir/x.safetensors"); },
                      {"read_safetensors", "/nonexistent/dir/x.safetensors", "cannot open"});

  write_file(path, "abc");
  test::require_error([&] { st::Reader r(path); },
                      {"read_safetensors", path.c_str(), "truncated", "3 bytes"});

  write_file(path, "");
  test::require_error([&] { st::Reader r(path); }, {"truncated", "0 bytes"});

  // header length beyond the end of the file
  {
    std::string bytes(8, '\0');
    bytes[0] = '\x40';
    bytes[1] = '\x42';
    bytes[7] = '\x7f';  // absurd length: must not be allocated
    write_file(path, bytes + "{}");
    test::require_error([&] { st::Reader r(path); },
                        {"header length", "beyond the end of the file"});
  }
  // the good file, then cut inside the header and inside the data
  write_raw(path, "{" + good_entry + "}", data);
  CHECK(st::Reader(path).read_as<float>("t").size() == 2);
  const std::string whole = read_file(path);
  write_file(path, whole.substr(0, 20));
  test::require_error([&] { st::Reader r(path); }, {"header length", "beyond the end"});
  write_file(path, whole.substr(0, whole.size() - 3));
  test::require_error([&] { st::Reader r(path); },
                      {"'t'", "data_offsets [0, 8]", "out of range", "5 bytes"});

  struct Bad {
    std::string header;
    std::vector<const char*> words;
  };
  const Bad cases[] = {
      {"{", {"malformed", "unexpected end"}},
      {"[]", {"not a JSON object"}},
      {"{\"t\":1}", {"'t'", "not a JSON object"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2]}}", {"'t'", "no \"data_offsets\""}},
      {"{\"t\":{\"shape\":[2],\"data_offsets\":[0,8]}}", {"'t'", "no \"dtype\""}},
      {"{\"t\":{\"dtype\":\"F17\",\"shape\":[2],\"data_offsets\":[0,8]}}",
       {"'t'", "unknown dtype 'F17'"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", {"'t'", "negative"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}",
       {"malformed", "only integers"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
       {"'t'", "8 bytes for shape (3)", "does not match", "expected 12"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       {"'t'", "[4, 12]", "out of range"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", {"'t'", "begin <= end"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", {"'t'", "two integers"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]}}",
       {"malformed", "out of range"}},
      {"{\"t\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}",
       {"'t'", "too large"}},
      {"{\"t\":{\"dtype\":\"F32\"}, \"t\":{}}", {"malformed", "repeated key"}},
      {"{\"t\":{\"dtype\":\"F\\x32\"}}", {"malformed", "bad escape"}},
      {"{\"t\":\"\\ud800\"}", {"malformed", "surrogate"}},
      {"{\"t\":true}", {"malformed", "unsupported value"}},
      {"{\"__metadata__\":{\"a\":1}}", {"__metadata__", "not a string"}},
      {"{} x", {"malformed", "trailing"}},
      {std::string(100, '[') + std::string(100, ']'), {"malformed", "too deep"}},
  };
  for (const Bad& c : cases) {
    INFO("header: " << c.header);
    write_raw(path, c.header, data);
    bool thrown = false;
    std::string msg;
    try {
      st::Reader r(path);
    } catch (const diffattn::error& e) {
      thrown = true;
      msg = e.what();
    }
    INFO("message: " << msg);
    CHECK(thrown);
    CHECK(msg.find(path) != std::string::npos);
    for (const char* w : c.words) {
      INFO("expected word: " << w);
      CHECK(msg.find(w) != std::string::npos);
    }
  }
  std::remove(path.c_str());
}

TEST_CASE("the writer refuses inconsistent tensors", "[safetensors]") {
  const std::string path = temp_path("writer");
  st::TensorData t{"F32", {3}, std::vector<unsigned char>(8)};
  test::require_error(
      [&] {
        diffattn::write_safetensors(path, {{"t", t}});
      },
      {"write_safetensors", "'t'", "8 bytes", "(3)"});
  t.dtype = "Q4";
  test::require_error(
      [&] {
        diffattn::write_safetensors(path, {{"t", t}});
      },
      {"unknown dtype 'Q4'"});
  st::TensorData ok{"U8", {2}, {1, 2}};
  test::require_error(
      [&] {
        diffattn::write_safetensors(path, {{"__metadata__", ok}});
      },
      {"reserved"});
  test::require_error(
      [&] {
        diffattn::write_safetensors("/nonexistent/dir/y.safetensors", {{"t", ok}});
      },
      {"cannot open", "/nonexistent/dir/y.safetensors"});
  std::remove(path.c_str());
}

TEST_CASE("BF16 and F16 tensors round-trip bit for bit through bfloat16 and half",
          "[safetensors][half]") {
  using diffattn::bfloat16;
  using diffattn::half;
  using diffattn::Tensor;
  // Every 16-bit pattern, NaN payloads and signed zeros included.
  Tensor<bfloat16, 2> b({256, 256});
  Tensor<half, 2> h({256, 256});
  for (index_t i = 0; i < b.size(); ++i) {
    const auto bits = static_cast<std::uint16_t>(i);
    std::memcpy(static_cast<void*>(b.data() + i), &bits, 2);
    std::memcpy(static_cast<void*>(h.data() + i), &bits, 2);
  }
  const std::string path = temp_path("half_round_trip");
  std::map<std::string, st::TensorData> tensors;
  tensors["b"] = st::make_tensor(b);
  tensors["h"] = st::make_tensor(h);
  CHECK(tensors["b"].dtype == "BF16");
  CHECK(tensors["h"].dtype == "F16");
  diffattn::write_safetensors(path, tensors);
  // The bytes on disk are the little-endian bit patterns.
  const st::Reader r(path);
  const st::TensorData raw = r.read("b");
  for (index_t i = 0; i < b.size(); i += 257) {
    const auto u = static_cast<std::uint16_t>(i);
    CHECK(raw.bytes[2 * static_cast<std::size_t>(i)] == (u & 0xFF));
    CHECK(raw.bytes[2 * static_cast<std::size_t>(i) + 1] == (u >> 8));
  }
  const Tensor<bfloat16, 2> b2 = r.read_tensor<bfloat16, 2>("b");
  const Tensor<half, 2> h2 = r.read_tensor<half, 2>("h");
  REQUIRE(b2.shape() == b.shape());
  REQUIRE(h2.shape() == h.shape());
  CHECK(std::memcmp(b2.data(), b.data(), 2 * static_cast<std::size_t>(b.size())) == 0);
  CHECK(std::memcmp(h2.data(), h.data(), 2 * static_cast<std::size_t>(h.size())) == 0);
  // Written again, the file is the same bytes.
  const std::string path2 = temp_path("half_round_trip2");
  std::map<std::string, st::TensorData> again;
  again["b"] = st::make_tensor(b2);
  again["h"] = st::make_tensor(h2);
  diffattn::write_safetensors(path2, again);
  CHECK(read_file(path) == read_file(path2));
  // Across types the value converts: F16 read as bfloat16 rounds the float value.
  const Tensor<bfloat16, 2> hb = r.read_tensor<bfloat16, 2>("h");
  const std::vector<float> hf = r.read_as<float>("h");
  for (index_t i = 0; i < hb.size(); ++i) {
    const float want = hf[static_cast<std::size_t>(i)];
    const float got = static_cast<float>(hb.data()[i]);
    if (std::isnan(want))
      CHECK(std::isnan(got));
    else
      CHECK(got == static_cast<float>(static_cast<bfloat16>(want)));
  }
  test::require_error([&] { r.read_tensor<bfloat16, 3>("b"); }, {"'b'", "rank 3"});
  std::remove(path.c_str());
  std::remove(path2.c_str());
}
