// One variant's analysis kernel (diffattn/analysis.hpp: the fused kernel's
// block task with its rows measured), its statistics written to an array of
// doubles: compiled once per instruction set.
#include <diffattn/detail/analysis/analysis_impl.hpp>

#include "variant.hpp"

#ifndef DIFFATTN_VARIANT
#error "compile with -DDIFFATTN_VARIANT=<name>"
#endif

namespace {

template <class T>
void analyse(const diffattn::detail::AttentionProblem<T, T>& p,
             const diffattn::detail::AnalysisSpec& spec, const diffattn::AttentionOptions& options,
             double* flat) {
  diffattn::detail::run_analysis_flat(p, spec, options, flat);
}

}  // namespace

#define DIFFATTN_ENTRY(T) \
  reinterpret_cast<diffattn_dispatch::ErasedFn>(diffattn_dispatch::AnalysisFn<T>(&analyse<T>)),
extern "C" __attribute__((visibility("default"))) const diffattn_dispatch::ErasedFn
    DIFFATTN_ANALYSIS_TABLE(DIFFATTN_VARIANT)[diffattn_dispatch::kAnalysisSlots] = {
        DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_ENTRY)};
