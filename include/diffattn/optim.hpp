/// \file
/// Optimizers over named parameters: SGD (with momentum) and AdamW, updating in
/// place the views a layer's parameters() returns from the gradients() it keeps.
#pragma once

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup layers
/// @{

/// Named parameters or gradients: flattened 1-D views keyed by name, as
/// MultiheadDiffAttnV1::parameters() and gradients() return them. Any of the
/// caller's own tensors joins by wrapping its storage in a TensorView<T, 1>.
template <class T>
using NamedViews = std::map<std::string, TensorView<T, 1>>;

namespace detail {

/// Checks that grads holds exactly the names of params, each with its size.
template <class T>
void optim_validate(const char* fn, const NamedViews<T>& params, const NamedViews<T>& grads) {
  for (const auto& kv : params) {
    const auto it = grads.find(kv.first);
    if (it == grads.end())
      fail(fn, "parameter '", kv.first, "' ", shape_str(kv.second.shape()), " has no gradient");
    if (it->second.shape() != kv.second.shape())
      fail(fn, "gradient '", kv.first, "' has shape ", shape_str(it->second.shape()), ", expected ",
           shape_str(kv.second.shape()), " like the parameter");
  }
  for (const auto& kv : grads)
    if (params.find(kv.first) == params.end())
      fail(fn, "gradient '", kv.first, "' ", shape_str(kv.second.shape()),
           " has no parameter of that name");
}

/// The state buffer `name` of `size` elements, created zero on first use;
/// refuses a parameter whose size changed since.
inline std::vector<double>& optim_slot(const char* fn,
                                       std::map<std::string, std::vector<double>>& m,
                                       const std::string& name, index_t size) {
  std::vector<double>& s = m[name];
  if (s.empty()) s.assign(static_cast<std::size_t>(size), 0.0);
  if (static_cast<index_t>(s.size()) != size)
    fail(fn, "parameter '", name, "' has shape (", size, "), but its optimizer state has (",
         s.size(), "); call reset() after resizing a parameter");
  return s;
}

inline void optim_check(const char* fn, const char* what, double v, double lo, bool lo_open,
                        double hi, bool hi_open) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok)
    fail(fn, what, " must be in ", lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]", ", got ",
         v);
}

}  // namespace detail

/// Hyper-parameters of SGD, as torch.optim.SGD (dampening 0, no Nesterov).
struct SGDOptions {
  double lr = 1e-2;         ///< learning rate, > 0
  double momentum = 0;      ///< in [0, 1)
  double weight_decay = 0;  ///< L2 term added to the gradient, >= 0
};

/// Stochastic gradient descent with momentum, torch.optim.SGD's update per
/// element of every named parameter p with gradient g:
///
///   g <- g + weight_decay * p
///   buf <- g on the first step of p, else momentum * buf + g   (when momentum > 0)
///   p <- p - lr * buf                                            (buf = g without momentum)
///
/// State (the momentum buffer) is kept per name, in double. T is float or double.
template <class T>
class SGD {
  static_assert(std::is_floating_point<T>::value, "SGD<T>: T is a floating-point type");

 public:
  /// Throws diffattn::error for a non-positive lr, momentum outside [0, 1) or
  /// a negative weight_decay.
  explicit SGD(const SGDOptions& options = {}) : opt_(options) {
    constexpr const char* fn = "SGD";
    const double inf = INFINITY;
    detail::optim_check(fn, "lr", opt_.lr, 0, true, inf, true);
    detail::optim_check(fn, "momentum", opt_.momentum, 0, false, 1, true);
    detail::optim_check(fn, "weight_decay", opt_.weight_decay, 0, false, inf, true);
  }

  /// One update of every parameter in params from the gradient of the same
  /// name in grads: both maps hold the same names, each gradient the shape of
  /// its parameter (any strides). Throws diffattn::error naming the parameter
  /// otherwise, before anything is changed.
  void step(const NamedViews<T>& params, const NamedViews<T>& grads) {
    constexpr const char* fn = "SGD::step";
    detail::optim_validate<T>(fn, params, grads);
    if (opt_.momentum > 0)
      for (const auto& kv : params) detail::optim_slot(fn, momentum_, kv.first, kv.second.size());
    for (const auto& kv : params) {
      const TensorView<T, 1> p = kv.second, g = grads.at(kv.first);
      std::vector<double>* buf = opt_.momentum > 0 ? &momentum_[kv.first] : nullptr;
      const bool first = started_.insert(kv.first).second;
      for (index_t i = 0; i < p.size(); ++i) {
        double gi = static_cast<double>(g(i)) + opt_.weight_decay * static_cast<double>(p(i));
        if (buf != nullptr) {
          double& b = (*buf)[static_cast<std::size_t>(i)];
          b = first ? gi : opt_.momentum * b + gi;
          gi = b;
        }
        p(i) = static_cast<T>(static_cast<double>(p(i)) - opt_.lr * gi);
      }
    }
  }

  /// Forgets all state (momentum buffers).
  void reset() {
    momentum_.clear();
    started_.clear();
  }
  /// The options the optimizer was made with (lr as last set).
  const SGDOptions& options() const noexcept { return opt_; }
  /// Changes the learning rate (schedules); throws if not finite and > 0.
  void set_lr(double lr) {
    detail::optim_check("SGD::set_lr", "lr", lr, 0, true, INFINITY, true);
    opt_.lr = lr;
  }

 private:
  SGDOptions opt_;
  std::map<std::string, std::vector<double>> momentum_;
  std::set<std::string> started_;
};

/// Hyper-parameters of AdamW, as torch.optim.AdamW (amsgrad off).
struct AdamWOptions {
  double lr = 1e-3;            ///< learning rate, > 0
  double beta1 = 0.9;          ///< first-moment decay, in [0, 1)
  double beta2 = 0.999;        ///< second-moment decay, in [0, 1)
  double eps = 1e-8;           ///< added to sqrt(v_hat), > 0
  double weight_decay = 1e-2;  ///< decoupled decay, >= 0
};

/// Adam with decoupled weight decay, torch.optim.AdamW's update per element of
/// every named parameter p with gradient g, t counting the steps of p from 1:
///
///   p <- p * (1 - lr * weight_decay)
///   m <- beta1 m + (1 - beta1) g,   v <- beta2 v + (1 - beta2) g^2
///   p <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
///
/// State (m, v, t) is kept per name, in double: parameters of several modules
/// (a layer and the caller's read-out) share one optimizer under distinct
/// names. T is float or double.
template <class T>
class AdamW {
  static_assert(std::is_floating_point<T>::value, "AdamW<T>: T is a floating-point type");

 public:
  /// Throws diffattn::error for a non-positive lr or eps, betas outside [0, 1)
  /// or a negative weight_decay.
  explicit AdamW(const AdamWOptions& options = {}) : opt_(options) {
    constexpr const char* fn = "AdamW";
    const double inf = INFINITY;
    detail::optim_check(fn, "lr", opt_.lr, 0, true, inf, true);
    detail::optim_check(fn, "beta1", opt_.beta1, 0, false, 1, true);
    detail::optim_check(fn, "beta2", opt_.beta2, 0, false, 1, true);
    detail::optim_check(fn, "eps", opt_.eps, 0, true, inf, true);
    detail::optim_check(fn, "weight_decay", opt_.weight_decay, 0, false, inf, true);
  }

  /// One update of every parameter in params from the gradient of the same
  /// name in grads (same names, each gradient the parameter's shape; any
  /// strides). Throws diffattn::error naming the parameter otherwise, before
  /// anything is changed.
  void step(const NamedViews<T>& params, const NamedViews<T>& grads) {
    constexpr const char* fn = "AdamW::step";
    detail::optim_validate<T>(fn, params, grads);
    for (const auto& kv : params) {
      detail::optim_slot(fn, m_, kv.first, kv.second.size());
      detail::optim_slot(fn, v_, kv.first, kv.second.size());
    }
    for (const auto& kv : params) {
      const TensorView<T, 1> p = kv.second, g = grads.at(kv.first);
      std::vector<double>& m = m_[kv.first];
      std::vector<double>& v = v_[kv.first];
      const double t = static_cast<double>(++steps_[kv.first]);
      const double bc1 = 1 - std::pow(opt_.beta1, t), bc2 = 1 - std::pow(opt_.beta2, t);
      const double decay = 1 - opt_.lr * opt_.weight_decay;
      for (index_t i = 0; i < p.size(); ++i) {
        const std::size_t u = static_cast<std::size_t>(i);
        const double gi = static_cast<double>(g(i));
        m[u] = opt_.beta1 * m[u] + (1 - opt_.beta1) * gi;
        v[u] = opt_.beta2 * v[u] + (1 - opt_.beta2) * gi * gi;
        const double update = (m[u] / bc1) / (std::sqrt(v[u] / bc2) + opt_.eps);
        p(i) = static_cast<T>(static_cast<double>(p(i)) * decay - opt_.lr * update);
      }
    }
  }

  /// Forgets all state (moments and step counts).
  void reset() {
    m_.clear();
    v_.clear();
    steps_.clear();
  }
  /// Steps taken so far for parameter `name` (0 if none).
  long long steps(const std::string& name) const {
    const auto it = steps_.find(name);
    return it == steps_.end() ? 0 : it->second;
  }
  /// The options the optimizer was made with (lr as last set).
  const AdamWOptions& options() const noexcept { return opt_; }
  /// Changes the learning rate (schedules); throws if not finite and > 0.
  void set_lr(double lr) {
    detail::optim_check("AdamW::set_lr", "lr", lr, 0, true, INFINITY, true);
    opt_.lr = lr;
  }

 private:
  AdamWOptions opt_;
  std::map<std::string, std::vector<double>> m_, v_;
  std::map<std::string, long long> steps_;
};

/// @}

DIFFATTN_END_NAMESPACE
