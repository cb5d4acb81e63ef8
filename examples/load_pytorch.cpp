// Weights in, weights out: a DIFF V1 layer saved as safetensors, the format
// PyTorch and Hugging Face checkpoints use, and loaded into a fresh layer.
//
// The tensor names are the reference module's state_dict names, so the same
// file is what PyTorch writes with
//     safetensors.torch.save_file(
//         {"model.layers.0.self_attn." + k: v for k, v in attn.state_dict().items()}, path)
// for a microsoft/unilm MultiheadDiffAttn `attn`, and what
//     attn.load_state_dict({k[len(prefix):]: v for k, v in load_file(path).items()
//                           if k.startswith(prefix)})
// reads back. A Hugging Face DiffLlama checkpoint loads with
// WeightLayout::diffllama (see diffattn/module.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <diffattn/io/safetensors.hpp>
#include <diffattn/module.hpp>
#include <string>

int main(int argc, char** argv) {
  using diffattn::index_t;
  const std::string path = argc > 1 ? argv[1] : "diffattn_load_pytorch.safetensors";
  const std::string prefix = "model.layers.0.self_attn.";

  diffattn::DiffAttnV1Config cfg;
  cfg.embed_dim = 64;
  cfg.num_heads = 4;     // 4 DIFF heads: q/k halves of 8, values of 16
  cfg.num_kv_heads = 2;  // GQA
  cfg.depth = 3;

  // A layer with known weights: seed 2025, and lambda vectors set by hand.
  diffattn::MultiheadDiffAttnV1<float> trained(cfg, 2025);
  auto params = trained.parameters();
  for (index_t i = 0; i < params.at("lambda_q1").size(); ++i) {
    params.at("lambda_q1")(i) = 0.1f * std::sin(static_cast<float>(i));
    params.at("lambda_k1")(i) = 0.1f * std::cos(static_cast<float>(i));
  }
  trained.save_safetensors(path, prefix);

  const diffattn::safetensors::Reader file(path);
  std::printf("%s holds %zu tensors:\n", path.c_str(), file.tensors().size());
  for (const auto& kv : file.tensors())
    std::printf("  %-40s %s %s\n", kv.first.c_str(), kv.second.dtype.c_str(),
                diffattn::safetensors::shape_str(kv.second.shape).c_str());

  diffattn::MultiheadDiffAttnV1<float> fresh(cfg, 1);  // other weights until loaded
  fresh.load_safetensors(path, prefix);

  diffattn::Tensor<float, 3> x({2, 9, cfg.embed_dim});  // (B, N, E)
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = std::sin(0.37f * static_cast<float>(i));
  const diffattn::Tensor<float, 3> y1 = trained.forward(x);
  const diffattn::Tensor<float, 3> y2 = fresh.forward(x);
  double max_diff = 0, max_abs = 0;
  for (index_t i = 0; i < y1.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(static_cast<double>(y1.data()[i]) - y2.data()[i]));
    max_abs = std::max(max_abs, std::abs(static_cast<double>(y1.data()[i])));
  }
  std::printf("\nlambda_init(depth %d) = %.6f, lambda_full = %.6f (both layers: %.6f)\n", cfg.depth,
              trained.lambda_init(), static_cast<double>(trained.lambda_full()),
              static_cast<double>(fresh.lambda_full()));
  std::printf("output (2, 9, %lld): max |y| = %.6f, max |difference| = %g\n",
              static_cast<long long>(cfg.embed_dim), max_abs, max_diff);
  const bool ok = max_diff == 0 && max_abs > 0;
  std::printf("%s\n", ok ? "the loaded layer agrees bit for bit" : "MISMATCH");
  std::remove(path.c_str());
  return ok ? 0 : 1;
}
