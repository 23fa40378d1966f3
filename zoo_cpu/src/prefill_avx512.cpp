// The prefill kernels for avx512: 16 floats a vector, tiles of 8 query rows (prefill_impl.h).
#include <cstdint>

#include "prefill.h"

namespace zoo::prefill_avx512 {
constexpr int W = 16;
constexpr int MR = 8;
constexpr int MRL = 12;  // weight rows a linear tile holds
#include "prefill_impl.h"
}  // namespace zoo::prefill_avx512
