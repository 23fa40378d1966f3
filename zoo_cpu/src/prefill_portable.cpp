// The prefill kernels for portable: 4 floats a vector, tiles of 4 query rows (prefill_impl.h).
#include <cstdint>

#include "prefill.h"

namespace zoo::prefill_portable {
constexpr int W = 4;
constexpr int MR = 4;
constexpr int MRL = 4;  // weight rows a linear tile holds
#include "prefill_impl.h"
}  // namespace zoo::prefill_portable
