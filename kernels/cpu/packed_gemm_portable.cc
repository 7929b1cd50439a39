// The portable kernels of packed_gemm.h: plain C++ loops that give the bits
// of every vector path (the order contract, bf16dot's emulation, int8dot's
// exact integer sums), used where the CPU lacks the instructions and as the
// reference the vector paths are tested against.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/packed_gemm_internal.h"

namespace pdserve::kernels::packed_gemm_internal {
namespace {

inline float FlushDenormal(float v) {
  return std::fabs(v) < 1.17549435e-38f ? std::copysign(0.0f, v) : v;
}
inline float Bf16Daz(uint16_t h) { return FlushDenormal(Bf16ToFloat(h)); }

void WidenPortable(Fmt t, const uint8_t* w, int64_t panel_bytes, int nv,
                   int64_t q0, int64_t q1, float* out) {
  for (int v = 0; v < nv; ++v) {
    const uint8_t* panel = w + v * panel_bytes;
    float* o = out + v * (q1 - q0) * kPanel;
    for (int64_t q = q0; q < q1; ++q)
      for (int c = 0; c < kPanel; ++c)
        o[(q - q0) * kPanel + c] = LoadWidened(t, panel, q, c);
  }
}

template <Fmt W>
void WidenPortableAs(const uint8_t* w, int64_t panel_bytes, int nv, int64_t q0,
                     int64_t q1, float* out) {
  WidenPortable(W, w, panel_bytes, nv, q0, q1, out);
}

}  // namespace

void TilePortable(Fmt t, int rows, int nv, const float* xp, const uint8_t* w,
                  int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                  bool zero) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        float acc = zero ? 0.0f : io[i * width + v * kPanel + c];
        for (int64_t q = k0; q < k1; ++q) {
          acc = std::fma(xp[(q - k0) * rows + i], LoadWidened(t, panel, q, c),
                         acc);
        }
        io[i * width + v * kPanel + c] = acc;
      }
    }
  }
}

WidenFn PortableWidener(Fmt t) {
  switch (t) {
    case Fmt::kBF16:
      return &WidenPortableAs<Fmt::kBF16>;
    case Fmt::kF16:
      return &WidenPortableAs<Fmt::kF16>;
    case Fmt::kI8:
      return &WidenPortableAs<Fmt::kI8>;
    case Fmt::kI8B32:
      return &WidenPortableAs<Fmt::kI8B32>;
    case Fmt::kF32:
    case Fmt::kI8Dot:  // (never reaches here)
      return nullptr;
  }
  return nullptr;
}

void TileBf16DotPortable(int rows, int nv, const uint32_t* xp, const uint8_t* w,
                         int64_t panel_bytes, int64_t k0, int64_t k1, float* io,
                         bool zero) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint32_t* panel =
          reinterpret_cast<const uint32_t*>(w + v * panel_bytes);
      for (int c = 0; c < kPanel; ++c) {
        float acc = zero ? 0.0f : io[i * width + v * kPanel + c];
        for (int64_t q = k0; q < k1; q += 2) {
          const uint32_t wd = panel[(q >> 1) * kPanel + c];
          const uint32_t xd = xp[(q - k0) / 2 * rows + i];
          acc = FlushDenormal(
              std::fma(Bf16Daz(wd >> 16), Bf16Daz(xd >> 16), acc));
          acc = FlushDenormal(
              std::fma(Bf16Daz(wd & 0xffff), Bf16Daz(xd & 0xffff), acc));
        }
        io[i * width + v * kPanel + c] = acc;
      }
    }
  }
}

void PackBf16PairsPortable(const float* x, int64_t k, int64_t i0, int64_t rows,
                           int64_t k0, int64_t k1, uint32_t* dst) {
  for (int64_t q = k0; q < k1; q += 2) {
    for (int64_t i = 0; i < rows; ++i) {
      const float* xr = x + (i0 + i) * k;
      const uint32_t lo = FloatToBf16(xr[q]);
      const uint32_t hi = q + 1 < k1 ? FloatToBf16(xr[q + 1]) : 0;
      dst[(q - k0) / 2 * rows + i] = lo | (hi << 16);
    }
  }
}

void Int8DotPortable(const int8_t* qx, const float* sx, int64_t kp,
                     int64_t blocks, int rows, int nv, const uint8_t* w,
                     int64_t panel_bytes, float* io) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int8_t* xq = qx + i * kp + b * kInt8Block;
          const uint8_t* wq = panel + b * kBlockBytes + c;
          int32_t isum = 0;
          for (int p = 0; p < kInt8Block; ++p) {
            isum +=
                int32_t{xq[p]} * int32_t{static_cast<int8_t>(wq[p * kPanel])};
          }
          uint16_t h;
          std::memcpy(&h, panel + BlockScaleOffset(b, c), 2);
          const float scale = sx[i * blocks + b] * F16ToFloat(h);
          acc = std::fma(static_cast<float>(isum), scale, acc);
        }
        io[i * width + v * kPanel + c] = acc;
      }
    }
  }
}

void QuantizeRowPortable(const float* x, int64_t k, int64_t kp, int8_t* q,
                         float* scales) {
  for (int64_t b = 0; b * kInt8Block < kp; ++b) {
    const int64_t q0 = b * kInt8Block, q1 = std::min(k, q0 + kInt8Block);
    float amax = 0;
    for (int64_t p = q0; p < q1; ++p) amax = std::max(amax, std::fabs(x[p]));
    const float s = amax / 127.0f;
    scales[b] = s;
    for (int64_t p = q0; p < q0 + kInt8Block; ++p) {
      const float v = p < q1 && s > 0 ? std::nearbyint(x[p] / s) : 0.0f;
      q[p] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

void QuantizeRowPerRowPortable(const float* x, int64_t k, int64_t kq, int8_t* q,
                               float* scale) {
  float amax = 0;
  for (int64_t p = 0; p < k; ++p) amax = std::max(amax, std::fabs(x[p]));
  const float s = amax / 127.0f;
  *scale = s;
  for (int64_t p = 0; p < kq; ++p) {
    const float v = p < k && s > 0 ? std::nearbyint(x[p] / s) : 0.0f;
    q[p] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
  }
}

void RowDotPortable(Fmt fmt, const int8_t* qx, const float* sx, int64_t kq,
                    int64_t k, int rows, int nv, const uint8_t* w,
                    int64_t panel_bytes, const float* sw, float* io) {
  const int width = nv * kPanel;
  for (int i = 0; i < rows; ++i) {
    for (int v = 0; v < nv; ++v) {
      const uint8_t* panel = w + v * panel_bytes;
      for (int c = 0; c < kPanel; ++c) {
        int64_t isum = 0;
        for (int64_t p = 0; p < k; ++p) {
          isum += int64_t{qx[i * kq + p]} *
                  int64_t{static_cast<int8_t>(panel[PanelOffset(fmt, p, c)])};
        }
        io[i * width + v * kPanel + c] =
            static_cast<float>(isum) * (sx[i] * sw[v * kPanel + c]);
      }
    }
  }
}

void GemmDotLayoutChain(const float* __restrict__ x, int64_t m, int64_t k,
                        const WeightMatrix& w, float* __restrict__ y) {
  const int64_t n = w.rows(), pb = w.panel_bytes();
  const float* const sw = w.scales();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* panel = w.data() + (j / kPanel) * pb;
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        acc = std::fma(x[i * k + p],
                       LoadWidened(Fmt::kI8Dot, panel, p, j % kPanel), acc);
      }
      y[i * n + j] = acc * sw[j];
    }
  }
}

}  // namespace pdserve::kernels::packed_gemm_internal
