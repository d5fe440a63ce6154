// exp(x) for x <= 0 in plain float arithmetic the compiler vectorises (glibc's vector expf needs
// -ffast-math), shared by the softmax (paged_attention.cpp) and SiLU (fused_ops.cpp). Cephes
// expf: x = n ln2 + r with ln2 split in two for precision, exp(r) by a degree-7 polynomial, 2^n
// through the exponent bits; about 1 ulp. x is clamped at -87 (exp(-87) ~ 1.6e-38, the last
// normal floats), so the result is never subnormal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

inline float exp_clamped(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
