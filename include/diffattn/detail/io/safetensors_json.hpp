// The JSON subset of a safetensors header: objects, arrays, strings (with
// escapes), integers. Anything else (floats, true/false/null) is refused.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "../../config.hpp"
#include "../core/format.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

struct SafetensorsJson {
  enum class Kind { object, array, string, integer };
  Kind kind = Kind::object;
  // Object members in file order (keys are unique: a repeated key is an error).
  // Parallel vectors rather than a map: the standard allows an incomplete element
  // type for std::vector only.
  std::vector<std::string> keys;
  std::vector<SafetensorsJson> values;
  std::vector<SafetensorsJson> array;
  std::string string;
  std::int64_t integer = 0;

  static const char* kind_name(Kind k) {
    switch (k) {
      case Kind::object:
        return "object";
      case Kind::array:
        return "array";
      case Kind::string:
        return "string";
      default:
        return "integer";
    }
  }
};

/// Recursive-descent parser over [text, text + size). Errors throw
/// diffattn::error "<where>: header JSON ...: <what> at byte <pos>".
class SafetensorsJsonParser {
 public:
  SafetensorsJsonParser(const std::string& where, const char* text, std::size_t size)
      : where_(where), p_(text), begin_(text), end_(text + size) {}

  SafetensorsJson parse() {
    skip_ws();
    SafetensorsJson v = value(0);
    skip_ws();
    if (p_ != end_) error("unexpected trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void error(const char* what) const {
    fail(where_.c_str(), "header JSON is malformed: ", what, " at byte ", p_ - begin_);
  }

  void skip_ws() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }

  void expect(char c) {
    if (p_ == end_) error("unexpected end");
    if (*p_ != c) error(cat("expected '", c, "'").c_str());
    ++p_;
  }

  // The elements of an object or array, from its opening bracket to `close`:
  // item() reads one (white space skipped around it), commas between them.
  template <class Item>
  void elements(char close, Item&& item) {
    ++p_;
    skip_ws();
    if (p_ != end_ && *p_ == close) {
      ++p_;
      return;
    }
    for (;;) {
      skip_ws();
      item();
      skip_ws();
      if (p_ != end_ && *p_ == ',') {
        ++p_;
        continue;
      }
      expect(close);
      return;
    }
  }

  SafetensorsJson value(int depth) {
    if (depth > kMaxDepth) error("nesting too deep");
    if (p_ == end_) error("unexpected end");
    SafetensorsJson v;
    const char c = *p_;
    if (c == '{') {
      v.kind = SafetensorsJson::Kind::object;
      std::set<std::string> seen;
      elements('}', [&] {
        std::string key = string_body();
        if (!seen.insert(key).second) error("repeated key");
        skip_ws();
        expect(':');
        skip_ws();
        v.values.push_back(value(depth + 1));
        v.keys.push_back(std::move(key));
      });
      return v;
    }
    if (c == '[') {
      v.kind = SafetensorsJson::Kind::array;
      elements(']', [&] { v.array.push_back(value(depth + 1)); });
      return v;
    }
    if (c == '"') {
      v.kind = SafetensorsJson::Kind::string;
      v.string = string_body();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = SafetensorsJson::Kind::integer;
      v.integer = integer();
      return v;
    }
    error("unsupported value (only objects, arrays, strings and integers)");
  }

  std::int64_t integer() {
    bool neg = false;
    if (*p_ == '-') {
      neg = true;
      ++p_;
    }
    if (p_ == end_ || *p_ < '0' || *p_ > '9') error("expected a digit");
    if (*p_ == '0' && p_ + 1 != end_ && p_[1] >= '0' && p_[1] <= '9') error("leading zero");
    std::uint64_t u = 0;
    const std::uint64_t limit = neg ? 9223372036854775808ull : 9223372036854775807ull;
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') {
      const std::uint64_t digit = static_cast<std::uint64_t>(*p_ - '0');
      if (u > (limit - digit) / 10) error("integer out of range");
      u = u * 10 + digit;
      ++p_;
    }
    if (p_ != end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E'))
      error("unsupported number (only integers)");
    if (!neg) return static_cast<std::int64_t>(u);
    return u == 0 ? 0 : -static_cast<std::int64_t>(u - 1) - 1;
  }

  unsigned hex4() {
    unsigned cp = 0;
    for (int i = 0; i < 4; ++i) {
      if (p_ == end_) error("unexpected end in \\u escape");
      const char h = *p_++;
      cp <<= 4;
      if (h >= '0' && h <= '9')
        cp |= static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f')
        cp |= static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        cp |= static_cast<unsigned>(h - 'A' + 10);
      else
        error("bad hex digit in \\u escape");
    }
    return cp;
  }

  static void put_utf8(std::string& s, unsigned cp) {
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string_body() {
    expect('"');
    std::string s;
    for (;;) {
      if (p_ == end_) error("unterminated string");
      const char c = *p_++;
      if (c == '"') return s;
      if (static_cast<unsigned char>(c) < 0x20) error("control character in string");
      if (c != '\\') {
        s += c;
        continue;
      }
      if (p_ == end_) error("unterminated escape");
      const char e = *p_++;
      switch (e) {
        case '"':
          s += '"';
          break;
        case '\\':
          s += '\\';
          break;
        case '/':
          s += '/';
          break;
        case 'b':
          s += '\b';
          break;
        case 'f':
          s += '\f';
          break;
        case 'n':
          s += '\n';
          break;
        case 'r':
          s += '\r';
          break;
        case 't':
          s += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // high surrogate: a low one must follow
            if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') error("unpaired surrogate");
            p_ += 2;
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) error("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            error("unpaired surrogate");
          }
          put_utf8(s, cp);
          break;
        }
        default:
          error("bad escape");
      }
    }
  }

  std::string where_;
  const char* p_;
  const char* begin_;
  const char* end_;
};

/// Appends s as a JSON string literal (quotes and escapes included).
inline void safetensors_json_quote(std::string& out, const std::string& s) {
  static const char* hex = "0123456789abcdef";
  out += '"';
  for (const char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == '"')
      out += "\\\"";
    else if (c == '\\')
      out += "\\\\";
    else if (u < 0x20) {
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 0xF];
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
