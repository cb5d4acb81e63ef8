// diffattn: header-only differential attention. One include for everything.
#pragma once

#include "attention.hpp"
#include "attention_backward.hpp"
#include "config.hpp"
#include "diff_weights.hpp"
#include "error.hpp"
#include "io/safetensors.hpp"
#include "lambda.hpp"
#include "matrix.hpp"
#include "module.hpp"
#include "norm.hpp"
#include "optim.hpp"
#include "options.hpp"
#include "reference.hpp"
#include "rope.hpp"
#include "softmax.hpp"
#include "tensor.hpp"
