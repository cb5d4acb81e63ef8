// A small, self-contained PNG writer and pixel canvas for the examples.
//
// No image library is needed to look at the examples' results: an RGB canvas
// with rectangles, lines and a 5 x 7 bitmap font is enough for heatmaps and
// line plots, and the writer below turns it into a valid PNG (8-bit RGB, no
// interlace). The zlib stream uses one fixed-Huffman deflate block whose
// matches look one pixel to the left and one row up: flat plots and heatmaps
// compress to a few KiB that way, where stored (uncompressed) blocks would
// take hundreds.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace png {

struct Rgb {
  std::uint8_t r = 255, g = 255, b = 255;
};

inline constexpr Rgb kWhite{255, 255, 255};
inline constexpr Rgb kBlack{0, 0, 0};
inline constexpr Rgb kGrey{200, 200, 200};

/// An RGB image, row-major, (0, 0) the top-left pixel. Drawing clips to the image.
class Canvas {
 public:
  Canvas(int width, int height, Rgb background = kWhite)
      : width_(width),
        height_(height),
        pixels_(static_cast<std::size_t>(width) * static_cast<std::size_t>(height), background) {}

  int width() const { return width_; }
  int height() const { return height_; }
  Rgb at(int x, int y) const { return pixels_[index(x, y)]; }

  void set(int x, int y, Rgb c) {
    if (x >= 0 && y >= 0 && x < width_ && y < height_) pixels_[index(x, y)] = c;
  }

  void fill_rect(int x, int y, int w, int h, Rgb c) {
    for (int j = y; j < y + h; ++j)
      for (int i = x; i < x + w; ++i) set(i, j, c);
  }

  void frame(int x, int y, int w, int h, Rgb c) {
    fill_rect(x, y, w, 1, c);
    fill_rect(x, y + h - 1, w, 1, c);
    fill_rect(x, y, 1, h, c);
    fill_rect(x + w - 1, y, 1, h, c);
  }

  /// A line `thickness` pixels wide (a square brush stepped along the longer axis).
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness = 1) {
    const int steps =
        static_cast<int>(std::ceil(std::max(std::abs(x1 - x0), std::abs(y1 - y0)))) + 1;
    const int lo = -(thickness - 1) / 2, hi = thickness / 2;
    for (int s = 0; s <= steps; ++s) {
      const double t = static_cast<double>(s) / steps;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0)));
      const int y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      for (int dy = lo; dy <= hi; ++dy)
        for (int dx = lo; dx <= hi; ++dx) set(x + dx, y + dy, c);
    }
  }

  /// Text in the built-in 5 x 7 font, each font pixel `scale` x `scale` screen
  /// pixels, 6 * scale per character. Lower case prints as upper case; '^'
  /// prints a lambda; characters without a glyph print as blanks.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 1) {
    for (char ch : s) {
      const std::array<std::uint8_t, 7>& g = glyph(ch);
      for (int row = 0; row < 7; ++row)
        for (int col = 0; col < 5; ++col)
          if (g[static_cast<std::size_t>(row)] & (0x10 >> col))
            fill_rect(x + col * scale, y + row * scale, scale, scale, c);
      x += 6 * scale;
    }
  }

  static int text_width(const std::string& s, int scale = 1) {
    return s.empty() ? 0 : static_cast<int>(s.size()) * 6 * scale - scale;
  }

 private:
  std::size_t index(int x, int y) const {
    return static_cast<std::size_t>(y) * static_cast<std::size_t>(width_) +
           static_cast<std::size_t>(x);
  }

  static const std::array<std::uint8_t, 7>& glyph(char ch) {
    // Rows top to bottom, bit 4 the leftmost column.
    static const std::array<std::uint8_t, 7> digits[10] = {
        {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}, {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},
        {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}, {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},
        {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}, {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},
        {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}, {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},
        {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}, {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}};
    static const std::array<std::uint8_t, 7> letters[26] = {
        {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}, {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},
        {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}, {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},
        {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}, {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},
        {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}, {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},
        {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}, {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},
        {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}, {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},
        {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}, {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},
        {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}, {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},
        {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}, {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},
        {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}, {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},
        {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}, {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},
        {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}, {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},
        {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}, {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}};
    static const std::array<std::uint8_t, 7> blank{}, dot{0, 0, 0, 0, 0, 0x0C, 0x0C},
        comma{0, 0, 0, 0, 0x0C, 0x04, 0x08}, minus{0, 0, 0, 0x1F, 0, 0, 0},
        plus{0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0}, equals{0, 0, 0x1F, 0, 0x1F, 0, 0},
        lparen{0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},
        rparen{0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}, slash{0, 0x01, 0x02, 0x04, 0x08, 0x10, 0},
        colon{0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0}, bar{0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},
        lambda{0x08, 0x08, 0x04, 0x04, 0x0A, 0x0A, 0x11};
    if (ch >= '0' && ch <= '9') return digits[ch - '0'];
    if (ch >= 'A' && ch <= 'Z') return letters[ch - 'A'];
    if (ch >= 'a' && ch <= 'z') return letters[ch - 'a'];
    switch (ch) {
      case '.':
        return dot;
      case ',':
        return comma;
      case '-':
        return minus;
      case '+':
        return plus;
      case '=':
        return equals;
      case '(':
        return lparen;
      case ')':
        return rparen;
      case '/':
        return slash;
      case ':':
        return colon;
      case '|':
        return bar;
      case '^':
        return lambda;
      default:
        return blank;
    }
  }

  int width_, height_;
  std::vector<Rgb> pixels_;
};

namespace detail {

inline std::uint32_t crc32(const std::uint8_t* data, std::size_t n, std::uint32_t crc = 0) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

inline std::uint32_t adler32(const std::vector<std::uint8_t>& data) {
  std::uint32_t a = 1, b = 0;
  for (std::uint8_t byte : data) {
    a = (a + byte) % 65521u;
    b = (b + a) % 65521u;
  }
  return (b << 16) | a;
}

/// Writes bits least significant first, as deflate packs them.
class BitWriter {
 public:
  void bits(std::uint32_t value, int count) {
    for (int i = 0; i < count; ++i) {
      if (used_ == 0) out.push_back(0);
      out.back() = static_cast<std::uint8_t>(out.back() | (((value >> i) & 1u) << used_));
      used_ = (used_ + 1) & 7;
    }
  }
  /// Huffman codes are defined most significant bit first.
  void code(std::uint32_t value, int count) {
    for (int i = count - 1; i >= 0; --i) bits((value >> i) & 1u, 1);
  }
  std::vector<std::uint8_t> out;

 private:
  int used_ = 0;
};

/// One literal/length symbol with the fixed Huffman code of RFC 1951, 3.2.6.
inline void fixed_literal(BitWriter& w, int symbol) {
  if (symbol < 144)
    w.code(0x30u + static_cast<std::uint32_t>(symbol), 8);
  else if (symbol < 256)
    w.code(0x190u + static_cast<std::uint32_t>(symbol - 144), 9);
  else if (symbol < 280)
    w.code(static_cast<std::uint32_t>(symbol - 256), 7);
  else
    w.code(0xC0u + static_cast<std::uint32_t>(symbol - 280), 8);
}

inline void fixed_match(BitWriter& w, int length, int distance) {
  static const int len_base[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                   31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
  static const int len_extra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                    2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
  static const int dist_base[30] = {1,    2,    3,    4,    5,    7,    9,    13,    17,    25,
                                    33,   49,   65,   97,   129,  193,  257,  385,   513,   769,
                                    1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
  static const int dist_extra[30] = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                     6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};
  int l = 28;
  while (len_base[l] > length) --l;
  fixed_literal(w, 257 + l);
  w.bits(static_cast<std::uint32_t>(length - len_base[l]), len_extra[l]);
  int d = 29;
  while (dist_base[d] > distance) --d;
  w.code(static_cast<std::uint32_t>(d), 5);
  w.bits(static_cast<std::uint32_t>(distance - dist_base[d]), dist_extra[d]);
}

/// zlib stream (RFC 1950) of one fixed-Huffman deflate block. Matches are
/// searched only at the distances `candidates` (pixel to the left, row above),
/// which is where synthetic images repeat themselves.
inline std::vector<std::uint8_t> zlib_compress(const std::vector<std::uint8_t>& data,
                                               const std::vector<int>& candidates) {
  BitWriter w;
  w.out = {0x78, 0x01};  // deflate, 32 KiB window, no preset dictionary; 0x7801 % 31 == 0
  w.bits(1, 1);          // BFINAL
  w.bits(1, 2);          // BTYPE = 01, fixed Huffman codes
  const std::size_t n = data.size();
  std::size_t i = 0;
  while (i < n) {
    int best_len = 0, best_dist = 0;
    for (int dist : candidates) {
      if (dist <= 0 || dist > 32768 || static_cast<std::size_t>(dist) > i) continue;
      int len = 0;
      while (len < 258 && i + static_cast<std::size_t>(len) < n &&
             data[i + static_cast<std::size_t>(len)] ==
                 data[i + static_cast<std::size_t>(len) - static_cast<std::size_t>(dist)])
        ++len;
      if (len > best_len) best_len = len, best_dist = dist;
    }
    if (best_len >= 3) {
      fixed_match(w, best_len, best_dist);
      i += static_cast<std::size_t>(best_len);
    } else {
      fixed_literal(w, data[i]);
      ++i;
    }
  }
  fixed_literal(w, 256);  // end of block
  std::vector<std::uint8_t> out = std::move(w.out);
  const std::uint32_t adler = adler32(data);
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(adler >> s));
  return out;
}

inline void put_u32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(v >> s));
}

inline void chunk(std::vector<std::uint8_t>& out, const char* type,
                  const std::vector<std::uint8_t>& payload) {
  put_u32(out, static_cast<std::uint32_t>(payload.size()));
  const std::size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), payload.begin(), payload.end());
  put_u32(out, crc32(out.data() + start, out.size() - start));
}

}  // namespace detail

/// The bytes of a PNG file holding `image`.
inline std::vector<std::uint8_t> encode(const Canvas& image) {
  const int w = image.width(), h = image.height();
  const int row_bytes = 1 + 3 * w;  // filter byte (0: none) + RGB
  std::vector<std::uint8_t> raw;
  raw.reserve(static_cast<std::size_t>(row_bytes) * static_cast<std::size_t>(h));
  for (int y = 0; y < h; ++y) {
    raw.push_back(0);
    for (int x = 0; x < w; ++x) {
      const Rgb c = image.at(x, y);
      raw.insert(raw.end(), {c.r, c.g, c.b});
    }
  }
  std::vector<std::uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<std::uint8_t> header;
  detail::put_u32(header, static_cast<std::uint32_t>(w));
  detail::put_u32(header, static_cast<std::uint32_t>(h));
  header.insert(header.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, filter 0, no interlace
  detail::chunk(out, "IHDR", header);
  detail::chunk(out, "IDAT", detail::zlib_compress(raw, {3, row_bytes}));
  detail::chunk(out, "IEND", {});
  return out;
}

/// Writes `image` to `path`; false if the file cannot be written.
inline bool write(const std::string& path, const Canvas& image) {
  const std::vector<std::uint8_t> bytes = encode(image);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

/// Diverging colour map: blue for -1, white for 0, red for +1 (t clamped to [-1, 1]).
inline Rgb diverging(double t) {
  t = std::max(-1.0, std::min(1.0, t));
  const Rgb end = t >= 0 ? Rgb{178, 24, 43} : Rgb{33, 102, 172};
  const double a = std::abs(t);
  auto mix = [a](std::uint8_t to) {
    return static_cast<std::uint8_t>(std::lround(255.0 + a * (static_cast<double>(to) - 255.0)));
  };
  return {mix(end.r), mix(end.g), mix(end.b)};
}

}  // namespace png
