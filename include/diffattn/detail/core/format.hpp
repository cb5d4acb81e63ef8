// Message helpers for diffattn::error: shapes print as "(2, 3, 4)".
#pragma once

#include <array>
#include <cstddef>
#include <sstream>
#include <string>
#include <utility>

#include "../../config.hpp"
#include "../../error.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <std::size_t R>
std::string shape_str(const std::array<index_t, R>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < R; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + ")";
}

inline void append_all(std::ostringstream&) {}
template <class A, class... Rest>
void append_all(std::ostringstream& os, const A& a, const Rest&... rest) {
  os << a;
  append_all(os, rest...);
}

/// Concatenates its arguments with operator<< into one message.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  os.precision(17);
  append_all(os, args...);
  return os.str();
}

/// Throws diffattn::error("<fn>: <message pieces>").
template <class... Args>
[[noreturn]] void fail(const char* fn, const Args&... args) {
  throw error(cat(fn, ": ", args...));
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
