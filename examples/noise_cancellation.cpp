// Why differential attention exists: the two maps share their noise, so their
// difference cancels it.
//
// One query attends over N keys. One key carries the signal; the others are
// noise. Both maps see the same keys. Map 1's query is the signal direction
// plus a noise direction; map 2's query is a noise direction only. The two
// noise directions share a component (correlation --shared between the maps'
// noise logits), as the maps of a trained DIFF head do: the softmax noise floor
// is common-mode, and A1 - lambda A2 subtracts it. Plain softmax attention is
// map 1 alone, which is diff_weights with lambda = 0.
//
// Logits, with s = 1/sqrt(d):
//   map 1: signal key  --signal + noise,  other keys  noise,  noise ~ N(0, --noise^2)
//   map 2: every key   noise,  correlated --shared with map 1's noise
//
// Measures, for one row W of weights (W = A1 for plain attention):
//   signal = W[signal key],  noise = sum over the other keys of |W|
//   (a negative weight is as much noise as a positive one), SNR = signal / noise,
// each the mean over --seeds draws of keys and noise directions.
//
// With --images DIR (default: the current directory) it also draws
//   DIR/attention_maps.png  A1, A2 and A1 - lambda A2 for 32 queries over 32 keys
//   DIR/snr_vs_noise.png    SNR against noise amplitude, plain and differential
//
// It checks its own claims and exits non-zero if one fails.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/diff_weights.hpp>

#include "png.hpp"

namespace {

using diffattn::index_t;
using diffattn::Matrix;

struct Options {
  index_t n = 1024;        // keys
  index_t d = 64;          // query/key width of each map
  double signal = 8;       // logit margin of the signal key in map 1
  double noise = 2;        // standard deviation of the noise logits
  double own = 0.1;        // standard deviation of each map's own (private) noise logits
  double lambda = 0.8;     // the layer's lambda (lambda_init for deep layers)
  int seeds = 16;          // draws averaged per measurement
  std::uint64_t seed = 1;  // first draw
  bool images = false;
  std::string image_dir = ".";
};

/// Keys and per-query unit noise directions of one draw, independent of the
/// amplitudes, so that sweeping noise or lambda reuses the same draw.
struct Draw {
  Matrix<float> k;               // (m, d): signal features first, then noise features
  std::vector<index_t> target;   // per query, its signal key
  std::vector<index_t> feature;  // per query, its signal feature
  std::vector<std::vector<double>> shared_dir, own1, own2;  // per query, (d - features) each
};

/// m keys, n queries; query i's signal key is targets[i]. Each distinct target
/// key gets a signal feature of its own (a coordinate no other key has), the
/// remaining coordinates of every key are N(0, 1) noise features.
Draw make_draw(index_t m, index_t d, const std::vector<index_t>& targets,
               diffattn::detail::Rng& rng) {
  Draw draw;
  draw.target = targets;
  std::vector<index_t> slot(static_cast<std::size_t>(m), -1);
  index_t features = 0;
  for (index_t t : targets)
    if (slot[static_cast<std::size_t>(t)] < 0) slot[static_cast<std::size_t>(t)] = features++;
  for (index_t t : targets) draw.feature.push_back(slot[static_cast<std::size_t>(t)]);
  const index_t r = d - features;  // noise features
  draw.k = Matrix<float>::Zero(m, d);
  const float root_d = std::sqrt(static_cast<float>(d));
  for (index_t j = 0; j < m; ++j) {
    if (slot[static_cast<std::size_t>(j)] >= 0)
      draw.k(j, slot[static_cast<std::size_t>(j)]) = root_d;
    for (index_t c = features; c < d; ++c) draw.k(j, c) = static_cast<float>(rng.normal());
  }
  // Three orthonormal directions per query (Gram-Schmidt): the shared one and
  // one of each map's own, all orthogonal to the noise features of the query's
  // signal key, so that its signal key gets no noise logit: the signal is
  // exactly the margin given, the noise is on the other keys.
  for (std::size_t i = 0; i < targets.size(); ++i) {
    std::vector<std::vector<double>> basis(1, std::vector<double>(static_cast<std::size_t>(r)));
    for (index_t c = 0; c < r; ++c)
      basis[0][static_cast<std::size_t>(c)] = draw.k(targets[i], features + c);
    double norm0 = 0;
    for (double x : basis[0]) norm0 += x * x;
    for (double& x : basis[0]) x /= std::sqrt(norm0);
    while (basis.size() < 4) {
      std::vector<double> v(static_cast<std::size_t>(r));
      for (double& x : v) x = rng.normal();
      for (const auto& b : basis) {
        double dot = 0;
        for (std::size_t c = 0; c < v.size(); ++c) dot += v[c] * b[c];
        for (std::size_t c = 0; c < v.size(); ++c) v[c] -= dot * b[c];
      }
      double norm = 0;
      for (double x : v) norm += x * x;
      norm = std::sqrt(norm);
      for (double& x : v) x /= norm;
      basis.push_back(std::move(v));
    }
    draw.shared_dir.push_back(basis[1]);
    draw.own1.push_back(basis[2]);
    draw.own2.push_back(basis[3]);
  }
  return draw;
}

/// The two maps' queries for given amplitudes. With s = 1/sqrt(d), a query
/// entry a on a signal feature (key entry sqrt(d)) adds a to that key's logit,
/// and sigma sqrt(d) times a unit noise direction gives logits ~ N(0, sigma^2)
/// over keys with N(0, 1) noise features.
void make_queries(const Draw& draw, index_t d, double signal, double noise, double own,
                  Matrix<float>& q1, Matrix<float>& q2) {
  const index_t n = static_cast<index_t>(draw.target.size());
  const index_t features = d - static_cast<index_t>(draw.shared_dir[0].size());
  q1 = Matrix<float>::Zero(n, d);
  q2 = Matrix<float>::Zero(n, d);
  const double root_d = std::sqrt(static_cast<double>(d));
  for (index_t i = 0; i < n; ++i) {
    const std::size_t si = static_cast<std::size_t>(i);
    q1(i, draw.feature[si]) = static_cast<float>(signal);
    for (index_t c = features; c < d; ++c) {
      const std::size_t rc = static_cast<std::size_t>(c - features);
      const double common = noise * draw.shared_dir[si][rc];
      q1(i, c) = static_cast<float>(root_d * (common + own * draw.own1[si][rc]));
      q2(i, c) = static_cast<float>(root_d * (common + own * draw.own2[si][rc]));
    }
  }
}

struct Measure {
  double signal = 0, noise = 0;
  double snr() const { return noise > 0 ? signal / noise : INFINITY; }
};

Measure measure_row(const Matrix<float>& w, index_t row, index_t target) {
  Measure m;
  for (index_t j = 0; j < w.cols(); ++j) {
    if (j == target)
      m.signal += w(row, j);
    else
      m.noise += std::abs(w(row, j));
  }
  return m;
}

/// Everything measured at one noise amplitude, averaged over the draws.
class Experiment {
 public:
  explicit Experiment(const Options& o) : o_(o) {
    diffattn::detail::Rng rng(o.seed);
    for (int s = 0; s < o.seeds; ++s) {
      diffattn::detail::Rng draw_rng(rng.next_u64());
      // The signal key sits at a random position: the kernels must not care where.
      const index_t target = static_cast<index_t>(draw_rng.uniform() * static_cast<double>(o.n));
      draws_.push_back(make_draw(o.n, o.d, {target}, draw_rng));
    }
  }

  /// Mean signal and noise of A1 - lambda A2 at noise amplitude sigma.
  /// Also checks that every row sums to 1 - lambda.
  Measure run(double sigma, double lambda) {
    Measure mean;
    for (const Draw& draw : draws_) {
      Matrix<float> q1, q2;
      make_queries(draw, o_.d, o_.signal, sigma, o_.own, q1, q2);
      const Matrix<float> w =
          diffattn::diff_weights<float>(q1, draw.k, q2, draw.k, static_cast<float>(lambda));
      const double sum = w.row(0).cast<double>().sum();
      max_row_sum_error = std::max(max_row_sum_error, std::abs(sum - (1 - lambda)));
      const Measure m = measure_row(w, 0, draw.target[0]);
      mean.signal += m.signal / static_cast<double>(draws_.size());
      mean.noise += m.noise / static_cast<double>(draws_.size());
    }
    return mean;
  }

  /// Each draw with the lambda in [0, 1] that is best for it alone: what a
  /// per-query lambda (V2 computes one per token) could reach at most.
  Measure run_per_query_best(double sigma) {
    Measure mean;
    for (const Draw& draw : draws_) {
      Matrix<float> q1, q2;
      make_queries(draw, o_.d, o_.signal, sigma, o_.own, q1, q2);
      Measure best;
      for (int l = 0; l <= 100; ++l) {
        const Matrix<float> w = diffattn::diff_weights<float>(q1, draw.k, q2, draw.k, l / 100.0f);
        const Measure m = measure_row(w, 0, draw.target[0]);
        if (l == 0 || m.snr() > best.snr()) best = m;
      }
      mean.signal += best.signal / static_cast<double>(draws_.size());
      mean.noise += best.noise / static_cast<double>(draws_.size());
    }
    return mean;
  }

  /// The lambda in [0, 1] (steps of 0.01) with the highest SNR at sigma.
  double best_lambda(double sigma, Measure* best) {
    double arg = 0;
    *best = run(sigma, 0);
    for (int l = 1; l <= 100; ++l) {
      const Measure m = run(sigma, l / 100.0);
      if (m.snr() > best->snr()) *best = m, arg = l / 100.0;
    }
    return arg;
  }

  double max_row_sum_error = 0;

 private:
  Options o_;
  std::vector<Draw> draws_;
};

/// The noise amplitude where SNR first falls below 1 (noise mass exceeds the
/// signal weight), interpolated in log SNR between sweep points; -1 if never.
double crossover(const std::vector<double>& sigma, const std::vector<double>& snr) {
  for (std::size_t i = 0; i < snr.size(); ++i) {
    if (snr[i] >= 1) continue;
    if (i == 0) return sigma[0];
    const double a = std::log(snr[i - 1]), b = std::log(snr[i]);
    return sigma[i - 1] + (sigma[i] - sigma[i - 1]) * a / (a - b);
  }
  return -1;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// ---------------------------------------------------------------- pictures

/// A1, A2 and A1 - lambda A2 side by side for a small problem, on one
/// diverging colour scale. Colour intensity is sqrt(|w| / max|w|): linear
/// intensity would leave the noise floor (a few percent of the peak) invisible.
bool draw_maps(const std::string& path, const Matrix<float>& a1, const Matrix<float>& a2,
               const Matrix<float>& w, double lambda) {
  const int cell = 7, rows = static_cast<int>(w.rows()), cols = static_cast<int>(w.cols());
  const int pw = cols * cell, ph = rows * cell, gap = 28, left = 24, top = 44;
  const int bar_x = left + 3 * (pw + gap), bar_w = 16;
  png::Canvas c(bar_x + bar_w + 70, top + ph + 46);
  double vmax = 0;
  for (const Matrix<float>* m : {&a1, &a2, &w})
    vmax = std::max(vmax, double(m->cwiseAbs().maxCoeff()));
  auto colour = [vmax](double x) {
    const double t = std::sqrt(std::abs(x) / vmax);
    return png::diverging(x < 0 ? -t : t);
  };
  const std::string titles[3] = {"A1", "A2", "A1 - " + fmt("%.2f", lambda) + " A2"};
  const Matrix<float>* maps[3] = {&a1, &a2, &w};
  for (int p = 0; p < 3; ++p) {
    const int x0 = left + p * (pw + gap);
    c.text(x0 + (pw - png::Canvas::text_width(titles[p], 2)) / 2, 14, titles[p], png::kBlack, 2);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j)
        c.fill_rect(x0 + j * cell, top + i * cell, cell, cell, colour((*maps[p])(i, j)));
    c.frame(x0 - 1, top - 1, pw + 2, ph + 2, png::kBlack);
  }
  c.text(left, top + ph + 10, "ROWS: QUERIES, COLUMNS: KEYS; KEY I IS THE SIGNAL OF QUERY I",
         png::kBlack);
  c.text(left, top + ph + 24, "COLOUR: SQRT OF |WEIGHT|, RED POSITIVE, BLUE NEGATIVE, WHITE ZERO",
         png::kBlack);
  // Colour bar, top +vmax, middle 0, bottom -vmax, on the same sqrt scale.
  for (int y = 0; y < ph; ++y) {
    const double t = 1 - 2.0 * y / (ph - 1);
    c.fill_rect(bar_x, top + y, bar_w, 1, png::diverging(t));
  }
  c.frame(bar_x - 1, top - 1, bar_w + 2, ph + 2, png::kBlack);
  const double ticks[5] = {1, 0.25, 0, -0.25, -1};  // fractions of vmax
  for (double f : ticks) {
    const double t = (f < 0 ? -1 : 1) * std::sqrt(std::abs(f));
    const int y = top + static_cast<int>(std::lround((1 - t) / 2 * (ph - 1)));
    c.fill_rect(bar_x + bar_w, y, 4, 1, png::kBlack);
    c.text(bar_x + bar_w + 6, y - 3, fmt("%+.2f", f * vmax), png::kBlack);
  }
  return png::write(path, c);
}

struct Series {
  std::string label;
  png::Rgb colour;
  std::vector<double> y;
};

/// SNR (log scale) against noise amplitude.
bool draw_snr_plot(const std::string& path, const std::vector<double>& x,
                   const std::vector<Series>& series, const std::string& caption) {
  const int width = 640, height = 420, left = 70, right = 20, top = 40, bottom = 70;
  const int pw = width - left - right, ph = height - top - bottom;
  png::Canvas c(width, height);
  const double ylo = -3, yhi = 3;  // log10 SNR range: 0.001 .. 1000
  const double xlo = x.front(), xhi = x.back();
  auto px = [&](double v) { return left + (v - xlo) / (xhi - xlo) * pw; };
  auto py = [&](double snr) {
    const double l = std::max(ylo, std::min(yhi, std::log10(std::max(snr, 1e-30))));
    return top + (yhi - l) / (yhi - ylo) * ph;
  };
  // Grid and tick labels.
  for (int e = -3; e <= 3; ++e) {
    const int y = static_cast<int>(std::lround(py(std::pow(10.0, e))));
    c.fill_rect(left, y, pw, 1, e == 0 ? png::Rgb{120, 120, 120} : png::kGrey);
    const std::string label =
        e < 0 ? fmt("%.2g", std::pow(10.0, e)) : fmt("%.0f", std::pow(10.0, e));
    c.text(left - 8 - png::Canvas::text_width(label), y - 3, label, png::kBlack);
  }
  for (double v = std::ceil(xlo); v <= xhi + 1e-9; v += 1) {
    const int xx = static_cast<int>(std::lround(px(v)));
    c.fill_rect(xx, top, 1, ph, png::kGrey);
    const std::string label = fmt("%.0f", v);
    c.text(xx - png::Canvas::text_width(label) / 2, top + ph + 8, label, png::kBlack);
  }
  c.frame(left, top, pw + 1, ph + 1, png::kBlack);
  c.text(left + pw - png::Canvas::text_width("SIGNAL = NOISE") - 4, static_cast<int>(py(1)) - 11,
         "SIGNAL = NOISE", png::Rgb{90, 90, 90});
  for (const Series& s : series)
    for (std::size_t i = 1; i < x.size(); ++i)
      c.line(px(x[i - 1]), py(s.y[i - 1]), px(x[i]), py(s.y[i]), s.colour, 3);
  // Crossovers: a dot on the SIGNAL = NOISE line and its noise amplitude below it.
  for (std::size_t k = 0; k < series.size(); ++k) {
    const double at = crossover(x, series[k].y);
    if (at < 0) continue;
    const int cx = static_cast<int>(std::lround(px(at))), cy = static_cast<int>(std::lround(py(1)));
    c.fill_rect(cx - 3, cy - 3, 7, 7, series[k].colour);
    const std::string label = fmt("%.2f", at);
    c.text(cx - png::Canvas::text_width(label) / 2, cy + 8 + 11 * static_cast<int>(k), label,
           series[k].colour);
  }
  const std::string title = "SIGNAL-TO-NOISE RATIO OF ONE ATTENTION ROW";
  c.text((width - png::Canvas::text_width(title, 2)) / 2, 12, title, png::kBlack, 2);
  const std::string xlabel = "NOISE AMPLITUDE (STD OF NOISE LOGITS)";
  c.text(left + (pw - png::Canvas::text_width(xlabel)) / 2, top + ph + 22, xlabel, png::kBlack);
  c.text(left, height - 18, caption, png::Rgb{90, 90, 90});
  // Legend, top right inside the plot.
  int ly = top + 10;
  int lw = 0;
  for (const Series& s : series) lw = std::max(lw, png::Canvas::text_width(s.label));
  const int lx = left + pw - lw - 40;
  c.fill_rect(lx - 6, ly - 6, lw + 42, 16 * static_cast<int>(series.size()) + 8, png::kWhite);
  c.frame(lx - 6, ly - 6, lw + 42, 16 * static_cast<int>(series.size()) + 8, png::kGrey);
  for (const Series& s : series) {
    c.fill_rect(lx, ly + 2, 24, 3, s.colour);
    c.text(lx + 30, ly, s.label, png::kBlack);
    ly += 16;
  }
  return png::write(path, c);
}

void usage() {
  std::printf(
      "usage: noise_cancellation [--n KEYS] [--d WIDTH] [--signal LOGIT] [--noise STD]\n"
      "                          [--own STD] [--lambda L] [--seeds K] [--seed S]\n"
      "                          [--images [DIR]]\n");
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0;
    if (a == "--images") {
      o.images = true;
      if (has_value) o.image_dir = argv[++i];
      continue;
    }
    if (!has_value) return false;
    const char* v = argv[++i];
    if (a == "--n")
      o.n = std::atol(v);
    else if (a == "--d")
      o.d = std::atol(v);
    else if (a == "--signal")
      o.signal = std::atof(v);
    else if (a == "--noise")
      o.noise = std::atof(v);
    else if (a == "--own")
      o.own = std::atof(v);
    else if (a == "--lambda")
      o.lambda = std::atof(v);
    else if (a == "--seeds")
      o.seeds = std::atoi(v);
    else if (a == "--seed")
      o.seed = std::strtoull(v, nullptr, 10);
    else
      return false;
  }
  return o.n >= 2 && o.d >= 4 && o.seeds >= 1 && o.own >= 0 && o.noise >= 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    usage();
    return 2;
  }
  bool ok = true;
  auto check = [&ok](bool cond, const char* what) {
    if (!cond) std::printf("CHECK FAILED: %s\n", what);
    ok = ok && cond;
  };

  std::printf(
      "one query over %ld keys, width %ld: signal logit +%.1f on one key; noise logits\n"
      "N(0, sigma^2) shared by both maps plus N(0, %.2f^2) of each map's own; mean of %d "
      "draws\n\n",
      static_cast<long>(o.n), static_cast<long>(o.d), o.signal, o.own, o.seeds);
  Experiment ex(o);

  // 1. The default noise level, side by side.
  const Measure plain = ex.run(o.noise, 0);
  const Measure diff = ex.run(o.noise, o.lambda);
  Measure best;
  const double best_l = ex.best_lambda(o.noise, &best);
  const Measure per_query = ex.run_per_query_best(o.noise);
  std::printf("noise amplitude %.2f                signal weight  noise mass (sum |w|)     SNR\n",
              o.noise);
  auto line = [](const std::string& name, const Measure& m) {
    std::printf("  %-34s %8.4f       %8.4f          %8.3f\n", name.c_str(), m.signal, m.noise,
                m.snr());
  };
  line("plain softmax (A1)", plain);
  line("differential, lambda " + fmt("%.2f", o.lambda), diff);
  line("differential, lambda " + fmt("%.2f", best_l) + " (best)", best);
  line("differential, lambda per query", per_query);
  std::printf("\n");

  // 2. Lambda sweep at the default noise.
  std::printf("lambda sweep at noise %.2f (lambda 0 is plain attention)\n", o.noise);
  std::printf("  lambda   signal    noise      SNR\n");
  for (int l = 0; l <= 10; ++l) {
    const Measure m = ex.run(o.noise, l / 10.0);
    std::printf("  %5.2f  %8.4f %8.4f %8.3f\n", l / 10.0, m.signal, m.noise, m.snr());
  }
  std::printf("best lambda %.2f: SNR %.2f, %.1fx plain attention's %.2f\n\n", best_l, best.snr(),
              best.snr() / plain.snr(), plain.snr());
  std::printf(
      "For one query the shared noise cancels exactly at lambda = Z2 / Z1, the ratio of the two\n"
      "softmax denominators: about the share of plain attention's weight on noise (%.2f here).\n"
      "Below it the noise is under-subtracted, above it over-subtracted into negative weights.\n"
      "That share differs from query to query and one lambda serves them all; the row 'lambda\n"
      "per query' gives each draw its own best lambda, a bound for a lambda per token (DIFF "
      "V2).\n\n",
      plain.noise);

  // 3. Noise sweep.
  std::vector<double> sigmas, snr_plain, snr_diff, snr_best;
  std::printf("noise sweep    plain softmax             differential, lambda %.2f   best lambda\n",
              o.lambda);
  std::printf("  sigma    signal   noise      SNR    signal   noise      SNR   lambda      SNR\n");
  for (int s = 0; s <= 16; ++s) {
    const double sigma = s * 0.25;
    const Measure p = ex.run(sigma, 0), dm = ex.run(sigma, o.lambda);
    Measure bm;
    const double bl = ex.best_lambda(sigma, &bm);
    std::printf("  %5.2f  %7.4f %7.4f %8.3f   %7.4f %7.4f %8.3f   %6.2f %8.3f\n", sigma, p.signal,
                p.noise, p.snr(), dm.signal, dm.noise, dm.snr(), bl, bm.snr());
    sigmas.push_back(sigma);
    snr_plain.push_back(p.snr());
    snr_diff.push_back(dm.snr());
    snr_best.push_back(bm.snr());
  }
  auto report = [&](const char* name, const std::vector<double>& snr) {
    const double x = crossover(sigmas, snr);
    if (x < 0)
      std::printf("  %-28s signal outweighs noise across the sweep (SNR %.2f at %.2f)\n", name,
                  snr.back(), sigmas.back());
    else
      std::printf("  %-28s noise outweighs signal from noise amplitude %.2f\n", name, x);
    return x;
  };
  std::printf("\ncrossover (noise mass = signal weight, SNR = 1):\n");
  const double x_plain = report("plain softmax", snr_plain);
  const double x_diff = report(("differential, lambda " + fmt("%.2f", o.lambda)).c_str(), snr_diff);
  const double x_best = report("differential, best lambda", snr_best);

  // The claims above, checked.
  check(ex.max_row_sum_error < 1e-4, "every row of A1 - lambda A2 sums to 1 - lambda");
  check(diff.snr() > plain.snr(), "differential SNR beats plain SNR at the default noise");
  check(best.snr() >= diff.snr() && best_l > 0, "the best lambda is not plain attention");
  check(x_plain >= 0 && (x_best < 0 || x_best > x_plain),
        "plain attention crosses over, and before differential attention does");
  (void)x_diff;

  if (o.images) {
    // 32 queries over 32 keys; query i's signal key is key i, so the signal
    // is the diagonal. The signal margin is lowered by log(1023 / 31) so that
    // 31 noise keys weigh on the softmax as much as 1023 do in the sweep above.
    const index_t m = 32;
    diffattn::detail::Rng rng(o.seed + 7);
    std::vector<index_t> perm(static_cast<std::size_t>(m));
    for (index_t i = 0; i < m; ++i) perm[static_cast<std::size_t>(i)] = i;
    const Draw draw = make_draw(m, o.d, perm, rng);
    const double signal = o.signal - std::log((static_cast<double>(o.n) - 1) / (m - 1.0));
    Matrix<float> q1, q2;
    make_queries(draw, o.d, signal, o.noise, o.own, q1, q2);
    const float lam = static_cast<float>(o.lambda);
    const Matrix<float> a1 = diffattn::diff_weights<float>(q1, draw.k, q2, draw.k, 0.0f);
    const Matrix<float> a2 = diffattn::diff_weights<float>(q2, draw.k, q1, draw.k, 0.0f);
    const Matrix<float> w = diffattn::diff_weights<float>(q1, draw.k, q2, draw.k, lam);
    check((w - (a1 - lam * a2)).cwiseAbs().maxCoeff() < 1e-6f, "W = A1 - lambda A2 in the picture");
    Measure mp, md;
    for (index_t i = 0; i < m; ++i) {
      const Measure rp = measure_row(a1, i, perm[static_cast<std::size_t>(i)]);
      const Measure rd = measure_row(w, i, perm[static_cast<std::size_t>(i)]);
      mp.signal += rp.signal / m, mp.noise += rp.noise / m;
      md.signal += rd.signal / m, md.noise += rd.noise / m;
    }
    const std::string maps = o.image_dir + "/attention_maps.png";
    const std::string plot = o.image_dir + "/snr_vs_noise.png";
    const std::vector<Series> series = {
        {"PLAIN SOFTMAX", {90, 90, 90}, snr_plain},
        {"DIFFERENTIAL, ^ = " + fmt("%.2f", o.lambda), {178, 24, 43}, snr_diff},
        {"DIFFERENTIAL, BEST ^ PER NOISE LEVEL", {33, 102, 172}, snr_best}};
    const std::string caption = fmt("%.0f KEYS, SIGNAL LOGIT +", static_cast<double>(o.n)) +
                                fmt("%.1f, NOISE LOGITS SHARED (X AXIS) + ", o.signal) +
                                fmt("%.2f OWN PER MAP, ", o.own) +
                                fmt("MEAN OF %.0f DRAWS", static_cast<double>(o.seeds));
    const bool wrote =
        draw_maps(maps, a1, a2, w, o.lambda) && draw_snr_plot(plot, sigmas, series, caption);
    check(wrote, "images written");
    std::printf(
        "\nimages (32 queries x 32 keys, signal +%.2f, noise %.2f): plain SNR %.2f, "
        "differential SNR %.2f\n  %s\n  %s\n",
        signal, o.noise, mp.snr(), md.snr(), maps.c_str(), plot.c_str());
  }

  std::printf("\n%s\n", ok ? "all checks passed" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
