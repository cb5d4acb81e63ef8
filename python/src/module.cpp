// The extension module diffattn._diffattn: the kernels (kernels.cpp), the
// layers (layers.cpp), the statistics (analysis.cpp), the instruction-set
// dispatch queries, and diffattn::error
// as diffattn.Error, a ValueError carrying the C++ message.
#include "common.hpp"

namespace diffattn_py {
void bind_kernels(py::module_& m);
void bind_layers(py::module_& m);
void bind_analysis(py::module_& m);
}  // namespace diffattn_py

PYBIND11_MODULE(_diffattn, m) {
  namespace py = pybind11;
  m.doc() = "diffattn: fused differential attention kernels (C++), numpy in, numpy out";
  py::register_exception<diffattn::error>(m, "Error", PyExc_ValueError);
  m.attr("__version__") = py::str(std::to_string(DIFFATTN_VERSION_MAJOR) + "." +
                                  std::to_string(DIFFATTN_VERSION_MINOR) + "." +
                                  std::to_string(DIFFATTN_VERSION_PATCH));
  m.def("isa", [] { return std::string(diffattn::isa()); },
        "The instruction-set variant that runs the kernels (DIFFATTN_ISA=name forces one).");
  m.def("isa_variants", [] {
    std::vector<std::string> v;
    for (auto s : diffattn::isa_variants()) v.emplace_back(s);
    return v;
  });
  m.def("isa_supported", [](const std::string& n) { return diffattn::isa_supported(n); },
        py::arg("name"));
  m.def("lambda_init", &diffattn::lambda_init, py::arg("depth"),
        "0.8 - 0.6 exp(-0.3 depth), depth the 0-based layer index.");
  diffattn_py::bind_kernels(m);
  diffattn_py::bind_layers(m);
  diffattn_py::bind_analysis(m);
}
