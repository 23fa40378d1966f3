// The prefill kernels for avx2: 8 floats a vector, tiles of 6 query rows (prefill_impl.h).
#include <cstdint>

#include "prefill.h"

namespace zoo::prefill_avx2 {
constexpr int W = 8;
constexpr int MR = 6;
constexpr int MRL = 6;  // weight rows a linear tile holds
#include "prefill_impl.h"
}  // namespace zoo::prefill_avx2
