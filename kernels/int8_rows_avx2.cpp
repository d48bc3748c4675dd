// int8 products of a few rows on x86 CPUs with AVX2: out[r, o] = sum_i x[r, i] * w[o, i], exact integers as fp32.
// Built by minigpt/compile/native.py; minigpt/quant/int8_rows.py packs the weight, calls it and holds its torch reference.
//
// The weight is packed [ceil(N / 4), K / 32, 4, 32]: the 32 inputs of 4 outputs side by side, so a product reads its
// weight in one stream, prefetched ahead; each row's 4 outputs are summed in 4 registers.
// vpmaddubsw multiplies unsigned by signed bytes: |x| times w carrying x's sign, whose pair sums stay within
// 2 * 127 * 127 (no 16-bit saturation), so every int8 activation is exact, -128 excepted.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kOutputs = 4;   // outputs of a packed block
constexpr int64_t kInputs = 32;   // inputs of a packed block: one AVX2 register of bytes
constexpr int64_t kAhead = 8;     // blocks prefetched ahead of the one read
constexpr int64_t kGrain = 16;    // packed blocks of outputs a thread takes at least

inline int32_t lanes_sum(__m256i sums) {
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  half = _mm_hadd_epi32(half, half);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(half, half));
}

// 4 outputs of one row from the packed block rows `weight` ([K / 32, 4, 32])
inline void four_outputs(const int8_t* row, const int8_t* weight, int64_t pieces, int32_t* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kOutputs];
  for (int64_t j = 0; j < kOutputs; ++j) acc[j] = _mm256_setzero_si256();
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int8_t* block = weight + piece * kOutputs * kInputs;
    _mm_prefetch(reinterpret_cast<const char*>(block + kAhead * kOutputs * kInputs), _MM_HINT_T0);
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + piece * kInputs));
    const __m256i magnitude = _mm256_sign_epi8(x, x);
    for (int64_t j = 0; j < kOutputs; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * kInputs));
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w, x));
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int64_t j = 0; j < kOutputs; ++j) sums[j] = lanes_sum(acc[j]);
}

at::Tensor int8_rows_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "int8_rows_mm: x must be [rows, K] int8");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == kOutputs &&
                  packed.size(3) == kInputs, "int8_rows_mm: packed must be int8 [ceil(N / 4), K / 32, 4, 32]");
  TORCH_CHECK(packed.size(1) * kInputs == x.size(1), "int8_rows_mm: x has ", x.size(1), " inputs, the weight ",
              packed.size(1) * kInputs);
  TORCH_CHECK(n > (packed.size(0) - 1) * kOutputs && n <= packed.size(0) * kOutputs,
              "int8_rows_mm: n does not fit the packed blocks");
  const at::Tensor rows = x.contiguous();
  const at::Tensor weight = packed.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), pieces = weight.size(1);
  at::Tensor out = at::empty({m, n}, rows.options().dtype(at::kFloat));
  const int8_t* row_data = rows.const_data_ptr<int8_t>();
  const int8_t* weight_data = weight.const_data_ptr<int8_t>();
  float* out_data = out.mutable_data_ptr<float>();
  at::parallel_for(0, weight.size(0), kGrain, [&](int64_t first, int64_t last) {
    int32_t sums[kOutputs];
    for (int64_t group = first; group < last; ++group) {
      const int8_t* block_rows = weight_data + group * pieces * kOutputs * kInputs;
      const int64_t outputs = std::min(kOutputs, n - group * kOutputs);
      for (int64_t r = 0; r < m; ++r) {  // the block rows stay in L1 for the rows after the first
        four_outputs(row_data + r * k, block_rows, pieces, sums);
        for (int64_t j = 0; j < outputs; ++j) out_data[r * n + group * kOutputs + j] = static_cast<float>(sums[j]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minigpt_cpu, m) { m.def("int8_rows_mm(Tensor x, Tensor packed, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(minigpt_cpu, CPU, m) { m.impl("int8_rows_mm", &int8_rows_mm); }
