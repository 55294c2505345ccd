// y = x W^T (+ b) for few rows x (a verification step's tree nodes), W pre-packed in panels of 64
// output features: a block of up to 6 rows keeps 6 x 4 accumulators in registers, so each
// 256-byte row of a panel loads once per 24 fused multiply-adds (the row's value broadcast from
// memory); in float32 the blocks take turns over chunks of the panel, so one streams each chunk
// from memory and the others find it in L1 (run_panels).
// See workers/model/small_gemm.py for the layouts and why.
//
// Written against csrc/simd.h's vector layer and compiled once per kernel path (AVX-512 with BF16
// and AMX, AVX-512 without them, AVX2 + FMA: workers/model/small_gemm.py), each loaded only on
// CPUs that have its flags.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "kernels.h"
#include "simd.h"
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using namespace specgate_simd;

constexpr int NR = 64;      // output features per panel: 4 vectors of 16 floats
constexpr int MR_MAX = 6;   // rows per block: 6 x 4 accumulators + 4 weight vectors of 32 registers
constexpr int64_t PF_ROWS = 8;   // k rows (2 KB) ahead

// Software prefetch of the weights for one block of rows (float32 only).
// * near: a lone block (2-6 rows) prefetches its panel PF_ROWS k rows ahead into L1.
// * next: several blocks take turns over a chunk of the panel (run_panels); each k step of each
//   block prefetches one of the next chunk's cache lines into L2, from line `first` on, so the
//   next chunk streams in at an even pace while the current one is multiplied, by all the blocks
//   in turn. With the near prefetch alone, the later blocks' turns left memory idle and a pass
//   took about the time of streaming plus the time of arithmetic. 120 layer linears + LM head,
//   side by side: 8 rows 30.3 -> 28.8 ms, 12 rows 32.6 -> 32.0, 16 rows 37.3 -> 32.1, 20 rows
//   42.6 -> 33.0, 24 rows 45.6 -> 35.1 (1 row 22.6). Front-loading it (all the next chunk's
//   lines within the first blocks' turns) and two chunks ahead were no better.
struct Prefetch {
  bool near = false;
  const float* next = nullptr;   // the next chunk's first weight, or nullptr
  int64_t lines = 0;             // its 64-byte lines
  int64_t first = 0;
};

// 16-lane vectors of a panel row a block's accumulators cover at once: with AVX-512's 32
// registers the whole 64-wide row (6 rows x 4 = 24 accumulators, one pass over k); with AVX2's
// 16 (a vector is two of them) 1 row x 4, 2-3 rows x 2 or 4-6 rows x 1 (8-12 registers), the
// panel's columns in 1, 2 or 4 passes over k. Each output is still summed over k in k order.
template <int MR>
constexpr int nv_for() { return kWide ? 4 : MR == 1 ? 4 : MR <= 3 ? 2 : 1; }

// float32: panel layout [K][64]
template <int MR>
void block_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
               int cols, const float* bias, const Prefetch& pf, bool accumulate) {
  constexpr int NV = nv_for<MR>();
  int64_t line = pf.first;
  for (int j0 = 0; j0 < 4 && 16 * j0 < cols; j0 += NV) {
    vf acc[MR][NV];
    for (int j = 0; j < NV; ++j) {
      const int c = 16 * (j0 + j);
      const vf b0 = bias ? load16(bias + c, tail_mask(cols - c)) : vzero();
      for (int r = 0; r < MR; ++r) acc[r][j] = accumulate ? load16(y + r * ldy + c, tail_mask(cols - c)) : b0;
    }
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * NR + 16 * j0;
      // The panel row PF_ROWS ahead into L1: with 2+ rows the hardware prefetcher alone leaves the
      // multiply-adds waiting on memory; 1 row streams as fast without.
      if (pf.near)
        for (int l = 0; l < NV; ++l) _mm_prefetch((const char*)(wk + PF_ROWS * NR + 16 * l), _MM_HINT_T0);
      if (pf.next && line < pf.lines) _mm_prefetch((const char*)(pf.next + 16 * line++), _MM_HINT_T1);
      vf wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = vloadu(wk + 16 * j);
      for (int r = 0; r < MR; ++r) {
        const vf xr = vset1(x[r * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[r][j] = vfmadd(xr, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) {
        const int c = 16 * (j0 + j);
        store16(y + r * ldy + c, acc[r][j], tail_mask(cols - c));
      }
  }
}

// bfloat16: panel layout [K/2][64][2] (pairs of k side by side, what vdpbf16ps multiplies),
// accumulated in float32 and rounded to bf16 once at the end, as F.linear does. Without AVX-512
// BF16 each pair is widened to float32 (exact) and multiplied-added one k at a time.
template <int MR>
void block_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, uint16_t* y,
                int64_t ldy, int cols, const float* bias, const Prefetch& /*not measured here*/,
                bool /*accumulate: bf16 rounds its output, so it never runs in k chunks*/) {
  constexpr int NV = nv_for<MR>();
  const int64_t K2 = (K + 1) / 2;
  for (int j0 = 0; j0 < 4 && 16 * j0 < cols; j0 += NV) {
    vf acc[MR][NV];
    for (int j = 0; j < NV; ++j) {
      const int c = 16 * (j0 + j);
      const vf b0 = bias ? load16(bias + c, tail_mask(cols - c)) : vzero();
      for (int r = 0; r < MR; ++r) acc[r][j] = b0;
    }
    for (int64_t k2 = 0; k2 < K2; ++k2) {
      const uint16_t* wk = w + k2 * 2 * NR + 32 * j0;
#if defined(__AVX512BF16__)
      __m512bh wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        if (2 * k2 + 1 < K) {
          std::memcpy(&pair, x + r * ldx + 2 * k2, sizeof(pair));
        } else {   // an odd K's last k has no partner: pair it with zero
          pair = (int32_t)x[r * ldx + 2 * k2];
        }
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, wv[j]);
      }
#else
      for (int j = 0; j < NV; ++j) {
        vf even, odd;
        bf16_pairs(wk + 32 * j, even, odd);
        for (int r = 0; r < MR; ++r) {
          const uint16_t* xr = x + r * ldx + 2 * k2;
          acc[r][j] = vfmadd(vset1(bf16_to_float(xr[0])), even, acc[r][j]);
          if (2 * k2 + 1 < K) acc[r][j] = vfmadd(vset1(bf16_to_float(xr[1])), odd, acc[r][j]);
        }
      }
#endif
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) {
        const int c = 16 * (j0 + j);
        store16(y + r * ldy + c, acc[r][j], tail_mask(cols - c));
      }
  }
}

template <typename T>
using BlockFn = void (*)(const T*, int64_t, const T*, int64_t, T*, int64_t, int, const float*, const Prefetch&, bool);

// kernels[mr - 1] serves a pass of mr rows
template <typename T, template <int> class Kernel, size_t... I>
constexpr std::array<BlockFn<T>, sizeof...(I)> table(std::index_sequence<I...>) {
  return {&Kernel<(int)I + 1>::run...};
}
template <int MR> struct F32 { static void run(const float* a, int64_t b, const float* c, int64_t d, float* e, int64_t f, int g, const float* h, const Prefetch& i, bool j) { block_f32<MR>(a, b, c, d, e, f, g, h, i, j); } };
template <int MR> struct BF16 { static void run(const uint16_t* a, int64_t b, const uint16_t* c, int64_t d, uint16_t* e, int64_t f, int g, const float* h, const Prefetch& i, bool j) { block_bf16<MR>(a, b, c, d, e, f, g, h, i, j); } };

template <typename T, template <int> class Kernel>
void run_panels(const T* x, int64_t M, int64_t K, const T* packed, int64_t panel_elems,
                int64_t N, const float* bias, T* y) {
  static constexpr auto kernels = table<T, Kernel>(std::make_index_sequence<MR_MAX>{});
  const int64_t panels = (N + NR - 1) / NR;
  // float32, more than one block of rows: the blocks take turns over chunks of 64 k (16 KB of the
  // panel), so the later blocks find the chunk in L1 (8 rows, side by side: 30.7 -> 27.5 ms) while
  // the next chunk streams into L2 (Prefetch). Partial sums wait in y between chunks (float32: the
  // same sums, bit for bit).
  const bool f32 = std::is_same<T, float>::value;
  const int64_t kc = !f32 || M <= MR_MAX ? K : 64;
  const int64_t blocks = (M + MR_MAX - 1) / MR_MAX;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = (int)std::min<int64_t>(NR, N - p * NR);
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t kn = std::min(kc, K - k0);
        Prefetch pf;
        pf.near = f32 && blocks == 1 && M >= 2;
        // Past the panel's end the next chunk is the next panel's start (panels are contiguous):
        // the next one this thread takes, or a harmless hint; past the last panel, nothing.
        const int64_t next = p * panel_elems + (k0 + kc) * NR;
        if (f32 && blocks > 1 && next < panels * panel_elems) {
          pf.next = reinterpret_cast<const float*>(packed + next);
          pf.lines = std::min(kc * NR, panels * panel_elems - next) * (int64_t)sizeof(float) / 64;
        }
        for (int64_t b = 0, m0 = 0; b < blocks; ++b) {   // rows split evenly: 8 = 4 + 4, not 6 + 2
          const int mr = (int)(M / blocks + (b < M % blocks));
          pf.first = b * kn;
          kernels[mr - 1](x + m0 * K + k0, K, packed + p * panel_elems + k0 * NR, kn, y + m0 * N + p * NR, N, cols,
                          bias && k0 == 0 ? bias + p * NR : nullptr, pf, k0 > 0);
          m0 += mr;
        }
      }
    }
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- bf16 with AMX: tiles of 16 rows x 32 k multiplied by 16 k-pairs x 16 outputs per
// instruction, so a panel's 4 KB of weights per 32 k cost ~64 cycles of arithmetic: the weights
// stream at the memory's speed for any row count up to 16 (the dot-product kernel above becomes
// compute-bound past ~6 rows). Panel layout [P][K/32][4][16][16][2]: for each 32 k and each 16 of
// the panel's 64 outputs, one 1 KB tile (16 k-pairs x 16 outputs x 2).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure(int mr) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = (uint8_t)mr; cfg.colsb[t] = 64; }   // C0-C3, A
  for (int t = 5; t < 7; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }            // B
  _tile_loadconfig(&cfg);
}

void amx_panels(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                const float* bias, uint16_t* y) {
  const int64_t panels = (N + 63) / 64, KB = K / 32;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float c[16 * 64];
    int configured = 0;
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = (int)std::min<int64_t>(64, N - p * 64);
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int mr = (int)std::min<int64_t>(16, M - m0);
        if (mr != configured) { amx_configure(mr); configured = mr; }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint16_t* b = packed + p * KB * 2048;
        const uint16_t* a = x + m0 * K;
        for (int64_t kb = 0; kb < KB; ++kb, b += 2048) {
          _tile_loadd(4, a + kb * 32, K * 2);
          _tile_loadd(5, b, 64);        _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, b + 512, 64);  _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, b + 1024, 64); _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, b + 1536, 64); _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, c, 256); _tile_stored(1, c + 16, 256);
        _tile_stored(2, c + 32, 256); _tile_stored(3, c + 48, 256);
        for (int r = 0; r < mr; ++r)
          for (int j = 0; j < 4; ++j) {
            const vmask m = tail_mask(cols - 16 * j);
            vf v = vloadu(c + r * 64 + 16 * j);
            if (bias) v = vadd(v, load16(bias + p * 64 + 16 * j, m));
            store16(y + (m0 + r) * N + p * 64 + 16 * j, v, m);
          }
      }
    }
    if (configured) _tile_release();
  });
}
#endif

}  // namespace

// x: [M, K] contiguous, float32 or bfloat16; packed: float32 [P, K, 64], bf16 [P, ceil(K/2), 64, 2]
// or bf16 AMX tiles [P, K/32, 4, 16, 16, 2];
// bias: float32 [N] or empty. Returns [M, N] in x's dtype.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == x.scalar_type(), "packed weight dtype");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t panels = (N + NR - 1) / NR;
  TORCH_CHECK(packed.size(0) == panels, "packed weight has ", packed.size(0), " panels, N needs ", panels);
  const float* b = nullptr;
  if (bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() && bias.numel() == N, "bias");
    b = bias.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (x.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == NR, "packed float32 layout");
    run_panels<float, F32>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), K * NR, N, b,
                           y.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
    if (packed.dim() == 6) {   // the AMX layout (`pack` in workers/model/small_gemm.py, where AMX runs)
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
      TORCH_CHECK(false, "packed AMX layout, on a kernel path built without AMX");
#else
      TORCH_CHECK(K % 32 == 0 && packed.size(1) == K / 32 && packed.size(2) == 4 && packed.size(3) == 16 &&
                  packed.size(4) == 16 && packed.size(5) == 2, "packed AMX layout");
      amx_panels(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr()), N, b,
                 reinterpret_cast<uint16_t*>(y.data_ptr()));
      return y;
#endif
    }
    const int64_t K2 = (K + 1) / 2;
    TORCH_CHECK(packed.dim() == 4 && packed.size(1) == K2 && packed.size(2) == NR && packed.size(3) == 2,
                "packed bf16 layout");
    using u16 = uint16_t;
    run_panels<u16, BF16>(reinterpret_cast<const u16*>(x.data_ptr()), M, K,
                          reinterpret_cast<const u16*>(packed.data_ptr()), K2 * 2 * NR, N, b,
                          reinterpret_cast<u16*>(y.data_ptr()));
  }
  return y;
}

// ---- RMSNorm, optionally after the residual add, for few rows: one call instead of the ~6 ops
// of F.rms_norm (each ~10 us of dispatch on these CPUs, more than the arithmetic of 16 rows).
namespace {


// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, in float32 arithmetic, rounded once to T; with
// `delta`, x[r] += delta[r] first (rounded to T, as the residual add would be), in place.
template <typename T>
void rms_rows(T* x, const T* delta, const T* w, T* y, int64_t M, int64_t H, float eps) {
  // rows split between the threads past a few
  at::parallel_for(0, M, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * H;
      vf ss = vzero();
      for (int64_t i = 0; i < H; i += 16) {
        const vmask m = tail_mask((int)std::min<int64_t>(16, H - i));
        vf v = load16(xr + i, m);
        if (delta) {
          store16(xr + i, vadd(v, load16(delta + r * H + i, m)), m);
          v = load16(xr + i, m);                                   // the rounded sum, as stored
        }
        ss = vfmadd(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(reduce_add(ss) / (float)H + eps);
      const vf s = vset1(inv);
      for (int64_t i = 0; i < H; i += 16) {
        const vmask m = tail_mask((int)std::min<int64_t>(16, H - i));
        store16(y + r * H + i, vmul(vmul(load16(xr + i, m), s), load16(w + i, m)), m);
      }
    }
  });
}

}  // namespace

// RMSNorm of x [M, H] with weight w [H] (x's dtype); with `delta` (same shape as x, or empty),
// x += delta in place first. Returns the normalized rows, a new [M, H] tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1) &&
              w.scalar_type() == x.scalar_type(), "rms_norm: x [M, H] contiguous, w [H] of x's dtype");
  const bool add = delta.numel() != 0;
  TORCH_CHECK(!add || (delta.sizes() == x.sizes() && delta.is_contiguous() &&
                       delta.scalar_type() == x.scalar_type()), "rms_norm: delta must be like x");
  auto y = torch::empty_like(x);
  const int64_t M = x.size(0), H = x.size(1);
  if (x.scalar_type() == torch::kFloat32) {
    rms_rows<float>(x.data_ptr<float>(), add ? delta.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                    y.data_ptr<float>(), M, H, (float)eps);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm: float32 or bfloat16");
    using u16 = uint16_t;
    rms_rows<u16>(reinterpret_cast<u16*>(x.data_ptr()), add ? reinterpret_cast<const u16*>(delta.data_ptr()) : nullptr,
                  reinterpret_cast<const u16*>(w.data_ptr()), reinterpret_cast<u16*>(y.data_ptr()), M, H, (float)eps);
  }
  return y;
}

// Asks Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once a process;
// false where the kernel refuses (then the bf16 dot-product kernel serves).
bool amx_permit() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;   // a path built without AMX never runs its tiles
#endif
}

// ---- SwiGLU's silu(gate) * up for few rows, in one pass (torch: chunk, silu, mul, each ~10-40 us
// of dispatch on these CPUs, bf16's silu the slowest).
namespace {

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t M, int64_t I) {
  // blocks of 256 of a row split between the threads (16 rows x 1536: ~19 -> ~10 us)
  constexpr int64_t B = 256;
  const int64_t nb = (I + B - 1) / B;
  at::parallel_for(0, M * nb, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / nb, lo = (b % nb) * B, hi = std::min(I, lo + B);
      const T* g = gu + r * 2 * I;
      const T* u = g + I;
      for (int64_t i = lo; i < hi; i += 16) {
        const vmask m = tail_mask((int)std::min<int64_t>(16, hi - i));
        const vf gv = load16(g + i, m);
        const vf silu = vdiv(gv, vadd(vset1(1.0f), exp16(vsub(vzero(), gv))));
        store16(out + r * I + i, vmul(silu, load16(u + i, m)), m);
      }
    }
  });
}

}  // namespace

// gate_up: [M, 2I] (gate then up, as the fused gate/up linear returns them) -> silu(gate) * up [M, I],
// float32 arithmetic, rounded once to the input's dtype.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous [M, 2I] matrix");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, I);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "silu_mul: float32 or bfloat16");
    silu_mul_rows<uint16_t>(reinterpret_cast<const uint16_t*>(gate_up.data_ptr()),
                            reinterpret_cast<uint16_t*>(out.data_ptr()), M, I);
  }
  return out;
}

// Every kernel runs without the GIL, as torch's own operators do: a step's forward takes tens of
// milliseconds, and holding the GIL through it stopped the gateway's event loop (every tenant's
// stream writes, /health) for as long. Safe: the kernels touch no Python object, only the tensors
// the step loop's thread passed and owns, and their scratch buffers are thread_local.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  register_decoder(m);
  m.def("rope_store", &rope_store, "rotary embedding of a step's queries and keys + their KV write", nogil());
  m.def("tree_attention", &tree_attention, "attention of every request's step rows over its own KV", nogil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [M, 2I] gate/up output", nogil());
  m.def("amx_permit", &amx_permit, "request the AMX tile state for this process");
  m.def("linear", &linear, "few-row linear over a panel-packed weight", nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm of few rows, optionally after the residual add (in place)", nogil());
}
