// int8 products of a few rows on x86 CPUs with AVX2: out[r, o] = sum_i x[r, i] * w[o, i], exact integers as fp32
// (int8_rows_mm), or as int32 where more rows go to torch's _int_mm instead (int8_rows_or_int_mm).
// Built by minigpt/compile/native.py; minigpt/quant/int8_rows.py packs the weight, calls it and holds its torch reference.
//
// The weight is packed [ceil(N / 4), K / 32, 4, 32]: the 32 inputs of 4 outputs side by side, so 4 outputs read
// their weight in one stream. A thread walks 2 or 4 parts of its outputs side by side: more streams of weight in
// flight draw more of the memory's bandwidth, up to a count that differs between CPUs (scripts/PERFORMANCE.md), so
// minigpt/quant/int8_rows.py times both once a process and sets the faster here (int8_rows_configure). The 4
// outputs of a stream sum in one register (two rounds of vphaddd), so 4 streams fit AVX2's 16 registers. Either
// count gives the same integers.
// vpmaddubsw multiplies unsigned by signed bytes: |x| times w carrying x's sign, whose pair sums stay within
// 2 * 127 * 127 (no 16-bit saturation), so every int8 activation is exact, -128 excepted.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kOutputs = 4;   // outputs of a packed block
constexpr int64_t kInputs = 32;   // inputs of a packed block: one AVX2 register of bytes
constexpr int64_t kGrain = 16;    // packed blocks of outputs a thread takes at least

int64_t streams_setting = 2;  // int8_rows_configure's

// 4 outputs of one row from each of kStreams packed block rows `weights[s]` ([K / 32, 4, 32]), read side by side
template <int kStreams>
inline void block_outputs(const int8_t* row, const int8_t* const* weights, int64_t pieces,
                          int32_t (*sums)[kOutputs]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kStreams];  // per 128-bit lane, the partial sums of the 4 outputs in order
  for (int s = 0; s < kStreams; ++s) acc[s] = _mm256_setzero_si256();
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + piece * kInputs));
    const __m256i magnitude = _mm256_sign_epi8(x, x);
    for (int s = 0; s < kStreams; ++s) {
      const int8_t* block = weights[s] + piece * kOutputs * kInputs;
      __m256i output[kOutputs];
      for (int64_t j = 0; j < kOutputs; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * kInputs));
        output[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w, x)), ones);
      }
      const __m256i pairs = _mm256_hadd_epi32(_mm256_hadd_epi32(output[0], output[1]),
                                              _mm256_hadd_epi32(output[2], output[3]));
      acc[s] = _mm256_add_epi32(acc[s], pairs);
    }
  }
  for (int s = 0; s < kStreams; ++s) {
    const __m128i lanes = _mm_add_epi32(_mm256_castsi256_si128(acc[s]), _mm256_extracti128_si256(acc[s], 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums[s]), lanes);
  }
}

// rows x [m, k] times the packed block rows `groups` (kStreams of them) into out [m, n] (float or int32)
template <int kStreams, typename Out>
inline void groups_outputs(const int8_t* x, int64_t m, int64_t k, const int8_t* weight, const int64_t* groups,
                           int64_t n, Out* out) {
  const int64_t pieces = k / kInputs;
  const int8_t* weights[kStreams];
  for (int s = 0; s < kStreams; ++s) weights[s] = weight + groups[s] * pieces * kOutputs * kInputs;
  int32_t sums[kStreams][kOutputs];
  for (int64_t r = 0; r < m; ++r) {  // the block rows stay in cache for the rows after the first
    block_outputs<kStreams>(x + r * k, weights, pieces, sums);
    for (int s = 0; s < kStreams; ++s) {
      const int64_t outputs = std::min(kOutputs, n - groups[s] * kOutputs);
      for (int64_t j = 0; j < outputs; ++j) out[r * n + groups[s] * kOutputs + j] = static_cast<Out>(sums[s][j]);
    }
  }
}

// the block rows [first, last) of a thread: kStreams parts side by side, the groups left over one at a time
template <int kStreams, typename Out>
void share_outputs(const int8_t* x, int64_t m, int64_t k, const int8_t* weight, int64_t first, int64_t last,
                   int64_t n, Out* out) {
  const int64_t part = (last - first) / kStreams;
  for (int64_t i = 0; i < part; ++i) {
    int64_t groups[kStreams];
    for (int s = 0; s < kStreams; ++s) groups[s] = first + s * part + i;
    groups_outputs<kStreams>(x, m, k, weight, groups, n, out);
  }
  for (int64_t group = first + kStreams * part; group < last; ++group)
    groups_outputs<1>(x, m, k, weight, &group, n, out);
}

template <typename Out>
void share(const int8_t* x, int64_t m, int64_t k, const int8_t* weight, int64_t first, int64_t last, int64_t n,
           Out* out) {
  if (streams_setting == 4) share_outputs<4>(x, m, k, weight, first, last, n, out);
  else share_outputs<2>(x, m, k, weight, first, last, n, out);
}

// x [M, K] int8 times the packed weight of n outputs -> [M, n] of `dtype` (float or int32), exact integers
at::Tensor products(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "int8_rows_mm: x must be [rows, K] int8");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == kOutputs &&
                  packed.size(3) == kInputs, "int8_rows_mm: packed must be int8 [ceil(N / 4), K / 32, 4, 32]");
  TORCH_CHECK(packed.size(1) * kInputs == x.size(1), "int8_rows_mm: x has ", x.size(1), " inputs, the weight ",
              packed.size(1) * kInputs);
  TORCH_CHECK(n > (packed.size(0) - 1) * kOutputs && n <= packed.size(0) * kOutputs,
              "int8_rows_mm: n does not fit the packed blocks");
  const at::Tensor rows = x.contiguous();
  const at::Tensor weight = packed.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1);
  at::Tensor out = at::empty({m, n}, rows.options().dtype(dtype));
  const int8_t* row_data = rows.const_data_ptr<int8_t>();
  const int8_t* weight_data = weight.const_data_ptr<int8_t>();
  auto fill = [&](auto* out_data) {
    at::parallel_for(0, weight.size(0), kGrain, [&](int64_t first, int64_t last) {
      share(row_data, m, k, weight_data, first, last, n, out_data);
    });
  };
  if (dtype == at::kInt) fill(out.mutable_data_ptr<int32_t>());
  else fill(out.mutable_data_ptr<float>());
  return out;
}

at::Tensor int8_rows_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return products(x, packed, n, at::kFloat);
}

// up to max_rows rows of x [M, K] through the kernel over `packed`, more through torch's _int_mm over the plain
// weight [N, K]: the same int32 products, decided per call (in a compiled program of any batch)
at::Tensor int8_rows_or_int_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                               int64_t max_rows) {
  if (x.size(0) <= max_rows) return products(x, packed, weight.size(0), at::kInt);
  return at::_int_mm(x, weight.t());
}

// the streams a thread reads side by side, 2 or 4: once a process, before the products run
void int8_rows_configure(int64_t streams) {
  TORCH_CHECK(streams == 2 || streams == 4, "int8_rows_configure: streams must be 2 or 4");
  streams_setting = streams;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minigpt_cpu, m) {
  m.def("int8_rows_mm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("int8_rows_or_int_mm(Tensor x, Tensor weight, Tensor packed, int max_rows) -> Tensor");
  m.def("int8_rows_configure(int streams) -> ()");
}
TORCH_LIBRARY_IMPL(minigpt_cpu, CPU, m) {
  m.impl("int8_rows_mm", &int8_rows_mm);
  m.impl("int8_rows_or_int_mm", &int8_rows_or_int_mm);
}
TORCH_LIBRARY_IMPL(minigpt_cpu, CatchAll, m) { m.impl("int8_rows_configure", &int8_rows_configure); }
