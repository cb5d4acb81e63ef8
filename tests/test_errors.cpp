// Every public entry point refuses bad input with diffattn::error whose message
// names the function, the argument and the shapes: one table, one row a case.
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/diffattn.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Matrix;
using diffattn::Tensor;
using diffattn::TensorView;
using test::random_tensor;

namespace {

struct Case {
  const char* what;
  std::function<void()> call;
  std::vector<const char*> words;
};

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

std::string temp_file(const char* name, const std::string& bytes) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            (std::string("diffattn_errors_") + name + ".safetensors"))
                               .string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  REQUIRE(f);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return path;
}

std::string safetensors_bytes(const std::string& header, std::size_t data_bytes) {
  std::string out(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}

}  // namespace

TEST_CASE("bad input: every case throws diffattn::error with the expected words", "[errors]") {
  // Valid V1 problem: B=1, N=5, M=6, H=2, Hkv=1, d=8.
  const auto q = random_tensor<float, 4>({1, 5, 4, 8}, 1);
  const auto k = random_tensor<float, 4>({1, 6, 2, 8}, 2);
  const auto v = random_tensor<float, 4>({1, 6, 1, 16}, 3);
  Tensor<float, 4> out({1, 5, 2, 16});
  Tensor<float, 3> lse({1, 4, 5});
  // V2: 2H = 4 query heads, Hkv = 2, d = 8.
  const auto k2 = random_tensor<float, 4>({1, 6, 2, 8}, 4);
  const auto v2 = random_tensor<float, 4>({1, 6, 2, 8}, 5);
  Tensor<float, 3> logit({1, 5, 2});
  Tensor<float, 4> out2({1, 5, 2, 8});
  // Plain: Hq = 4, Hkv = 2.
  Tensor<float, 4> outp({1, 5, 4, 8});
  float buf[64] = {};
  const Matrix<float> m38 = test::random_matrix<float>(3, 8, 6),
                      m58 = test::random_matrix<float>(5, 8, 7);
  const Matrix<float> m57 = test::random_matrix<float>(5, 7, 8);
  std::vector<float> vec8(8, 0.0f), vec7(7, 0.0f);
  TensorView<const float, 1> l8(vec8.data(), {8}), l7(vec7.data(), {7});
  AttentionOptions causal;
  causal.causal = true;
  AttentionOptions bad_scale, nan_scale, bad_threads;
  bad_scale.scale = -0.5;
  nan_scale.scale = std::nan("");
  bad_threads.num_threads = -1;

  diffattn::DiffAttnV1Config c1;
  c1.embed_dim = 32;
  c1.num_heads = 2;
  diffattn::DiffAttnV2Config c2;
  c2.embed_dim = 32;
  c2.num_heads = 4;
  c2.num_kv_heads = 2;

  using diffattn::diff_attention_v1;
  using diffattn::diff_attention_v2;
  const std::vector<Case> cases = {
      // TensorView / Tensor
      {"view negative extent",
       [&] {
         TensorView<float, 2>(buf, {3, -2});
       },
       {"TensorView", "negative extent", "(3, -2)"}},
      {"view negative stride",
       [&] {
         TensorView<float, 2>(buf, {2, 2}, {2, -1});
       },
       {"TensorView", "negative stride"}},
      {"view overflowing extents",
       [&] {
         TensorView<float, 2>(buf, {index_t(1) << 62, 4});
       },
       {"TensorView", "overflow"}},
      {"view overflowing strides",
       [&] {
         TensorView<float, 2>(buf, {3, 3}, {std::numeric_limits<index_t>::max() / 2, 1});
       },
       {"TensorView", "overflow"}},
      {"view null data",
       [&] { TensorView<float, 1>(nullptr, {4}); },
       {"TensorView", "null data", "(4)"}},
      {"tensor negative extent",
       [&] {
         Tensor<float, 3>({2, -1, 3});
       },
       {"Tensor", "negative extent", "(2, -1, 3)"}},
      {"tensor too large",
       [&] {
         Tensor<double, 2>({index_t(1) << 40, index_t(1) << 22});
       },
       {"Tensor", "too large"}},
      // lambda
      {"lambda_init negative depth",
       [&] { diffattn::lambda_init(-3); },
       {"lambda_init", "depth", "-3"}},
      {"lambda_full mismatched lengths",
       [&] { diffattn::lambda_full<float>(l8, l8, l8, l7, 0.2); },
       {"lambda_full", "lambda_k2", "(7)", "(8)"}},
      {"lambda_full non-finite init",
       [&] { diffattn::lambda_full<float>(l8, l8, l8, l8, kInf); },
       {"lambda_full", "lambda_init", "finite"}},
      // diff_weights
      {"diff_weights k1 width",
       [&] { diffattn::diff_weights(m38, m57, m38, m57, 0.5f); },
       {"diff_weights", "k1 has shape (5, 7)", "(3, 8)"}},
      {"diff_weights q2 rows",
       [&] { diffattn::diff_weights(m38, m58, m58, m58, 0.5f); },
       {"diff_weights", "q2 has shape (5, 8)", "(3, 8)"}},
      {"diff_weights NaN lambda",
       [&] { diffattn::diff_weights(m38, m58, m38, m58, kNaN); },
       {"diff_weights", "lambda must be finite"}},
      {"diff_weights bad scale",
       [&] { diffattn::diff_weights(m38, m58, m38, m58, 0.5f, bad_scale); },
       {"diff_weights", "options.scale", "-0.5"}},
      // diff_attention_v1
      {"v1 odd query heads",
       [&] {
         diff_attention_v1<float>(random_tensor<float, 4>({1, 5, 3, 8}, 9), k, v, 0.5f, out);
       },
       {"diff_attention_v1", "q has 3 heads", "2*H"}},
      {"v1 k heads not 2*Hkv",
       [&] {
         diff_attention_v1<float>(q, random_tensor<float, 4>({1, 6, 3, 8}, 9), v, 0.5f, out);
       },
       {"diff_attention_v1", "k has 3 heads", "2*Hkv with H % Hkv == 0"}},
      {"v1 H % Hkv != 0",
       [&] {
         diff_attention_v1<float>(random_tensor<float, 4>({1, 5, 6, 8}, 9),
                                  random_tensor<float, 4>({1, 6, 4, 8}, 9), v, 0.5f, out);
       },
       {"diff_attention_v1", "k has 4 heads", "(1, 5, 6, 8)"}},
      {"v1 value width",
       [&] {
         diff_attention_v1<float>(q, k, random_tensor<float, 4>({1, 6, 1, 8}, 9), 0.5f, out);
       },
       {"diff_attention_v1", "v has shape (1, 6, 1, 8)", "(B, M, Hkv, 2d)", "(1, 6, 1, 16)"}},
      {"v1 seqlen_k mismatch",
       [&] {
         diff_attention_v1<float>(q, k, random_tensor<float, 4>({1, 7, 1, 16}, 9), 0.5f, out);
       },
       {"diff_attention_v1", "seqlen_k", "(1, 6, 2, 8)", "(1, 7, 1, 16)"}},
      {"v1 batch mismatch",
       [&] {
         diff_attention_v1<float>(q, random_tensor<float, 4>({2, 6, 2, 8}, 9), v, 0.5f, out);
       },
       {"diff_attention_v1", "batch sizes differ"}},
      {"v1 head width mismatch",
       [&] {
         diff_attention_v1<float>(q, random_tensor<float, 4>({1, 6, 2, 6}, 9), v, 0.5f, out);
       },
       {"diff_attention_v1", "k has shape (1, 6, 2, 6)", "d = 8"}},
      {"v1 out shape",
       [&] {
         Tensor<float, 4> o({1, 5, 2, 8});
         diff_attention_v1<float>(q, k, v, 0.5f, o);
       },
       {"diff_attention_v1", "out has shape (1, 5, 2, 8)", "(1, 5, 2, 16)"}},
      {"v1 lse shape",
       [&] {
         Tensor<float, 3> l({1, 2, 5});
         diff_attention_v1<float>(q, k, v, 0.5f, out, l);
       },
       {"diff_attention_v1", "lse has shape (1, 2, 5)", "(1, 4, 5)"}},
      {"v1 NaN lambda",
       [&] { diff_attention_v1<float>(q, k, v, kNaN, out); },
       {"diff_attention_v1", "lambda must be finite"}},
      {"v1 infinite lambda",
       [&] { diff_attention_v1<float>(q, k, v, -kInf, out); },
       {"diff_attention_v1", "lambda must be finite"}},
      {"v1 per-head lambda shape",
       [&] { diff_attention_v1<float>(q, k, v, l8, out); },
       {"diff_attention_v1", "lambda has shape (8)", "(2)"}},
      {"v1 zero head width",
       [&] {
         Tensor<float, 4> o({1, 5, 2, 0});
         diff_attention_v1<float>(Tensor<float, 4>({1, 5, 4, 0}), Tensor<float, 4>({1, 6, 2, 0}),
                                  Tensor<float, 4>({1, 6, 1, 0}), 0.5f, o);
       },
       {"diff_attention_v1", "head width d must be >= 1"}},
      {"v1 head dim not contiguous",
       [&] {
         diff_attention_v1<float>(
             TensorView<const float, 4>(q.data(), {1, 5, 4, 4}, {160, 32, 8, 2}),
             TensorView<const float, 4>(k.data(), {1, 6, 2, 4}, {96, 16, 8, 2}), v, 0.5f, out);
       },
       {"diff_attention_v1", "q must be contiguous in its last (head) dimension",
        "(160, 32, 8, 2)"}},
      {"v1 out aliases q",
       [&] {
         diff_attention_v1<float>(
             q, k, v, 0.5f, TensorView<float, 4>(const_cast<float*>(q.data()), {1, 5, 2, 16}));
       },
       {"diff_attention_v1", "out (1, 5, 2, 16) overlaps input q"}},
      {"v1 lse aliases out",
       [&] {
         diff_attention_v1<float>(q, k, v, 0.5f, out, TensorView<float, 3>(out.data(), {1, 4, 5}));
       },
       {"diff_attention_v1", "lse (1, 4, 5) overlaps out"}},
      {"v1 negative scale",
       [&] { diff_attention_v1<float>(q, k, v, 0.5f, out, bad_scale); },
       {"diff_attention_v1", "options.scale"}},
      {"v1 NaN scale",
       [&] { diff_attention_v1<float>(q, k, v, 0.5f, out, nan_scale); },
       {"diff_attention_v1", "options.scale", "finite"}},
      {"v1 negative threads",
       [&] { diff_attention_v1<float>(q, k, v, 0.5f, out, bad_threads); },
       {"diff_attention_v1", "num_threads", "-1"}},
      // diff_attention_v2
      {"v2 pair straddles groups",
       [&] {
         Tensor<float, 4> o({1, 5, 3, 8});
         Tensor<float, 3> lg({1, 5, 3});
         diff_attention_v2<float>(random_tensor<float, 4>({1, 5, 6, 8}, 9), k2, v2, lg, o);
       },
       {"diff_attention_v2", "straddle", "2H / Hkv = 6 / 2 = 3"}},
      {"v2 Hkv does not divide 2H",
       [&] {
         diff_attention_v2<float>(q, random_tensor<float, 4>({1, 6, 3, 8}, 9),
                                  random_tensor<float, 4>({1, 6, 3, 8}, 9), logit, out2);
       },
       {"diff_attention_v2", "k has 3 heads", "2H = 4"}},
      {"v2 v heads differ from k",
       [&] {
         diff_attention_v2<float>(q, k2, random_tensor<float, 4>({1, 6, 1, 8}, 9), logit, out2);
       },
       {"diff_attention_v2", "v has shape (1, 6, 1, 8)", "2 heads like k"}},
      {"v2 lambda_logit shape",
       [&] {
         Tensor<float, 3> lg({1, 4, 2});
         diff_attention_v2<float>(q, k2, v2, lg, out2);
       },
       {"diff_attention_v2", "lambda_logit has shape (1, 4, 2)", "(1, 5, 2)"}},
      {"v2 out shape",
       [&] { diff_attention_v2<float>(q, k2, v2, logit, out); },
       {"diff_attention_v2", "out has shape (1, 5, 2, 16)", "(1, 5, 2, 8)"}},
      {"v2 out aliases lambda_logit",
       [&] {
         Tensor<float, 4> big({1, 5, 2, 8});
         diff_attention_v2<float>(q, k2, v2, TensorView<const float, 3>(big.data(), {1, 5, 2}),
                                  big);
       },
       {"diff_attention_v2", "overlaps lambda_logit"}},
      // attention
      {"attention Hkv does not divide Hq",
       [&] {
         diffattn::attention<float>(q, random_tensor<float, 4>({1, 6, 3, 8}, 9),
                                    random_tensor<float, 4>({1, 6, 3, 8}, 9), outp);
       },
       {"attention", "k has 3 heads", "Hq % Hkv == 0"}},
      {"attention out width",
       [&] { diffattn::attention<float>(q, k2, v2, out); },
       {"attention", "out has shape (1, 5, 2, 16)", "(1, 5, 4, 8)"}},
      {"attention v heads",
       [&] {
         diffattn::attention<float>(q, k2, random_tensor<float, 4>({1, 6, 1, 8}, 9), outp);
       },
       {"attention", "v has shape (1, 6, 1, 8)"}},
      // backward
      {"v1 backward without lse",
       [&] {
         Tensor<float, 4> dq(q.shape()), dk(k.shape()), dvv(v.shape());
         float dl = 0;
         diffattn::diff_attention_v1_backward<float>(
             q, k, v, 0.5f, out, TensorView<const float, 3>(), out, dq, dk, dvv, dl);
       },
       {"diff_attention_v1_backward", "lse is required"}},
      {"v2 backward dlambda_logit shape",
       [&] {
         Tensor<float, 4> dq(q.shape()), dk(k2.shape()), dvv(v2.shape());
         Tensor<float, 3> dlg({1, 5, 3}), l2({1, 4, 5});
         diffattn::diff_attention_v2_backward<float>(q, k2, v2, logit, out2, l2, out2, dq, dk, dvv,
                                                     dlg);
       },
       {"diff_attention_v2_backward", "dlambda_logit has shape (1, 5, 3)", "(1, 5, 2)"}},
      {"attention backward dv shape",
       [&] {
         Tensor<float, 4> dq(q.shape()), dk(k2.shape()), dvv({1, 6, 2, 9});
         Tensor<float, 3> l4({1, 4, 5});
         diffattn::attention_backward<float>(q, k2, v2, outp, l4, outp, dq, dk, dvv);
       },
       {"attention_backward", "dv has shape (1, 6, 2, 9)", "(1, 6, 2, 8)"}},
      {"reference kernel checks too",
       [&] { diffattn::reference::diff_attention_v1<float>(q, k, v, kNaN, out); },
       {"diff_attention_v1", "lambda must be finite"}},
      // rope and norm
      {"rope odd head width",
       [&] {
         Tensor<float, 4> x({1, 2, 1, 5});
         diffattn::apply_rope<float>(x);
       },
       {"apply_rope", "head width 5 must be even"}},
      {"rope negative offset",
       [&] {
         Tensor<float, 4> x({1, 2, 1, 4});
         diffattn::apply_rope<float>(x, -1);
       },
       {"position_offset must be >= 0"}},
      {"rms_norm weight length",
       [&] {
         Tensor<float, 2> x({3, 4}), y({3, 4});
         std::vector<float> w(3, 1.0f);
         diffattn::rms_norm<float, 2>(x, TensorView<const float, 1>(w.data(), {3}), y.view());
       },
       {"rms_norm", "weight has shape (3)", "(4)"}},
      // layers
      {"V1 config E % 2H",
       [&] {
         auto c = c1;
         c.embed_dim = 30;
         c.num_heads = 4;
         diffattn::MultiheadDiffAttnV1<float> m(c);
       },
       {"MultiheadDiffAttnV1", "embed_dim 30"}},
      {"V1 config H % Hkv",
       [&] {
         auto c = c1;
         c.num_kv_heads = 3;
         diffattn::MultiheadDiffAttnV1<float> m(c);
       },
       {"MultiheadDiffAttnV1", "num_kv_heads 3"}},
      {"V1 config negative depth",
       [&] {
         auto c = c1;
         c.depth = -1;
         diffattn::MultiheadDiffAttnV1<float> m(c);
       },
       {"MultiheadDiffAttnV1", "depth must be >= 0"}},
      {"V1 forward width",
       [&] {
         diffattn::MultiheadDiffAttnV1<float> m(c1);
         m.forward(Tensor<float, 3>({2, 9, 30}));
       },
       {"MultiheadDiffAttnV1::forward", "x has shape (2, 9, 30)", "(B, N, 32)"}},
      {"V2 config pair straddle",
       [&] {
         auto c = c2;
         c.num_kv_heads = 3;
         diffattn::MultiheadDiffAttnV2<float> m(c);
       },
       {"MultiheadDiffAttnV2", "num_kv_heads 3"}},
      {"V2 forward width",
       [&] {
         diffattn::MultiheadDiffAttnV2<float> m(c2);
         m.forward(Tensor<float, 3>({1, 3, 16}));
       },
       {"MultiheadDiffAttnV2::forward", "x has shape (1, 3, 16)"}},
      // safetensors
      {"load missing file",
       [&] {
         diffattn::MultiheadDiffAttnV1<float> m(c1);
         m.load_safetensors("no/such/file.safetensors");
       },
       {"load_safetensors", "no/such/file.safetensors", "cannot open"}},
      {"read truncated file",
       [&] { diffattn::read_safetensors(temp_file("short", "abc")); },
       {"read_safetensors", "truncated"}},
      {"read header beyond file",
       [&] {
         diffattn::read_safetensors(
             temp_file("hdr", std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10)));
       },
       {"read_safetensors", "header length 255 is beyond the end of the file"}},
      {"read unknown dtype",
       [&] {
         diffattn::read_safetensors(temp_file(
             "dtype",
             safetensors_bytes(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", 4)));
       },
       {"read_safetensors", "unknown dtype 'Q7'"}},
      {"read offsets out of range",
       [&] {
         diffattn::read_safetensors(temp_file(
             "range",
             safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4)));
       },
       {"read_safetensors", "out of range"}},
      {"read size does not match shape",
       [&] {
         diffattn::read_safetensors(temp_file(
             "size",
             safetensors_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)));
       },
       {"read_safetensors", "byte size does not match shape"}},
      {"read overlapping tensors",
       [&] {
         diffattn::read_safetensors(temp_file(
             "overlap",
             safetensors_bytes(
                 R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 12)));
       },
       {"read_safetensors", "overlap"}},
      {"read huge declared shape",
       [&] {
         diffattn::read_safetensors(temp_file(
             "huge",
             safetensors_bytes(
                 R"({"a":{"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,8]}})",
                 8)));
       },
       {"read_safetensors", "too large"}},
      {"read malformed JSON",
       [&] {
         diffattn::read_safetensors(
             temp_file("json", safetensors_bytes(R"({"a":{"dtype":"F32",)", 0)));
       },
       {"read_safetensors"}},
  };
  REQUIRE(cases.size() >= 40);
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.what) {
      bool thrown = false;
      std::string msg;
      try {
        c.call();
      } catch (const diffattn::error& e) {
        thrown = true;
        msg = e.what();
      }
      INFO("case: " << c.what << "\nmessage: " << msg);
      REQUIRE(thrown);
      for (const char* w : c.words) {
        INFO("expected word: " << w);
        CHECK(msg.find(w) != std::string::npos);
      }
    }
  }
}

TEST_CASE("diffattn::error is a std::invalid_argument", "[errors]") {
  STATIC_REQUIRE(std::is_base_of<std::invalid_argument, diffattn::error>::value);
  CHECK_THROWS_AS(diffattn::lambda_init(-1), std::invalid_argument);
}
