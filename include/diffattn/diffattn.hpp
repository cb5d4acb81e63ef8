// diffattn: header-only differential attention. One include for everything.
#pragma once

#include "attention.hpp"
#include "config.hpp"
#include "diff_weights.hpp"
#include "error.hpp"
#include "lambda.hpp"
#include "matrix.hpp"
#include "options.hpp"
#include "reference.hpp"
#include "softmax.hpp"
#include "tensor.hpp"
