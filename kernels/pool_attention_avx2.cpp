// Decode attention over a paged KV pool on x86 CPUs with AVX2: one new token per sequence over its cached keys and
// values in blocks and its own, which it then stores in its slot. The layer's whole pool is the op's one mutated
// input, which a compiled program writes in place (an eager store after each program was one more op a layer); not
// its keys and values as two views, which torch 2.13's AOTInductor passed both at the input's offset 0. Built by
// minigpt/compile/native.py; minigpt/compile/pool_attention.py calls it; its torch reference is `PoolAttention`
// (minigpt/model/attention.py) and an `index_copy_` of the new K/V.
//
// A task is 32 tokens of a sequence (a split), its blocks read in order, each slot's heads side by side: per head the
// scores' max, their exps' sum and the values they weight, in slot order; then each (sequence, head) merges its
// own token and its splits in order, fp32 throughout. The splits follow positions, not the batch or the threads,
// so a sequence's result is the same bits alone, in any batch, on any number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <memory>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = 8;  // floats in an AVX2 register
constexpr int64_t kSplit = 32;  // tokens of a task: a sequence's splits follow its positions, whatever the batch

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float lanes_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += kLanes) acc = _mm256_fmadd_ps(load8(q + d), load8(k + d), acc);
  return lanes_sum(acc);
}

// One split of sequence b, tokens [start, end) of its blocks: per head the scores' max, the sum of their exps and
// the values weighted by those exps; scores: [H, kSplit] of scratch.
template <typename T>
void attend_split(const float* query, const T* key_data, const T* value_data, const int32_t* table, int64_t start,
                  int64_t end, int64_t heads, int64_t dim, int64_t block_size, float* scores, float* top_out,
                  float* sum_out, float* acc) {
  const int64_t slot_stride = heads * dim, block_stride = block_size * slot_stride, count = end - start;
  for (int64_t t = start; t < end; ++t) {  // a slot's heads side by side: the blocks are read in order
    const T* slot = key_data + table[t / block_size] * block_stride + (t % block_size) * slot_stride;
    for (int64_t h = 0; h < heads; ++h) scores[h * kSplit + t - start] = dot(query + h * dim, slot + h * dim, dim);
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* score = scores + h * kSplit;
    float top = score[0];
    for (int64_t i = 1; i < count; ++i) top = std::max(top, score[i]);
    Vec total(0.0f);
    for (int64_t i = 0; i < count; i += kLanes) {
      const int64_t lanes = std::min(kLanes, count - i);
      const Vec weights = (Vec::loadu(score + i, lanes) - Vec(top)).exp();
      weights.store(score + i, lanes);
      total = total + Vec::set(Vec(0.0f), weights, lanes);
    }
    top_out[h] = top;
    sum_out[h] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
  }
  std::fill(acc, acc + heads * dim, 0.0f);
  for (int64_t t = start; t < end; ++t) {
    const T* slot = value_data + table[t / block_size] * block_stride + (t % block_size) * slot_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const __m256 weight = _mm256_set1_ps(scores[h * kSplit + t - start]);
      for (int64_t d = 0; d < dim; d += kLanes) {
        float* sum = acc + h * dim + d;
        _mm256_storeu_ps(sum, _mm256_fmadd_ps(weight, load8(slot + h * dim + d), _mm256_loadu_ps(sum)));
      }
    }
  }
}

// each sequence's own k and v [B, H, D] into its slot, position cached[b] of its blocks (after `attend`, which
// reads none past cached[b]), converted as `Tensor.to` would (vectorized: a scalar half is a software conversion);
// they are already values of the pool's dtype
template <typename T>
void store(const at::Tensor& k, const at::Tensor& v, at::Tensor& keys, at::Tensor& values, const at::Tensor& tables,
           const at::Tensor& cached) {
  const int64_t batch = k.size(0), slot = k.size(1) * k.size(2), block_size = keys.size(1), width = tables.size(1);
  const int32_t* table_data = tables.const_data_ptr<int32_t>();
  const int32_t* cached_data = cached.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t position = cached_data[b];
    const int64_t offset = (table_data[b * width + position / block_size] * block_size + position % block_size) * slot;
    const float* k_row = k.const_data_ptr<float>() + b * slot;
    const float* v_row = v.const_data_ptr<float>() + b * slot;
    at::vec::convert(k_row, keys.mutable_data_ptr<T>() + offset, slot);
    at::vec::convert(v_row, values.mutable_data_ptr<T>() + offset, slot);
  }
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys,
            const at::Tensor& values, const at::Tensor& tables, const at::Tensor& cached, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), block_size = keys.size(1);
  const int64_t width = tables.size(1), splits = std::max<int64_t>(1, (width * block_size + kSplit - 1) / kSplit);
  const float* q_data = q.const_data_ptr<float>();
  const float* k_data = k.const_data_ptr<float>();
  const float* v_data = v.const_data_ptr<float>();
  const T* key_data = keys.const_data_ptr<T>();
  const T* value_data = values.const_data_ptr<T>();
  const int32_t* table_data = tables.const_data_ptr<int32_t>();
  const int32_t* cached_data = cached.const_data_ptr<int32_t>();
  float* out_data = out.mutable_data_ptr<float>();
  // per (sequence, split, head): the max, the sum of exps, the weighted values [D]
  std::unique_ptr<float[]> tops(new float[batch * splits * heads]), sums(new float[batch * splits * heads]);
  std::unique_ptr<float[]> accs(new float[batch * splits * heads * dim]);
  at::parallel_for(0, batch * splits, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(heads * kSplit);
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / splits, start = (task % splits) * kSplit;
      const int64_t end = std::min<int64_t>(cached_data[b], start + kSplit);
      if (start >= end) continue;
      attend_split<T>(q_data + b * heads * dim, key_data, value_data, table_data + b * width, start, end, heads, dim,
                      block_size, scores.data(), tops.get() + task * heads, sums.get() + task * heads,
                      accs.get() + task * heads * dim);
    }
  });
  at::parallel_for(0, batch * heads, 16, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {  // its own token, then its splits in order
      const int64_t b = task / heads, h = task % heads, used = (cached_data[b] + kSplit - 1) / kSplit;
      const float* query = q_data + task * dim;
      const float own = dot(query, k_data + task * dim, dim);
      float top = own;
      for (int64_t s = 0; s < used; ++s) top = std::max(top, tops[(b * splits + s) * heads + h]);
      const float own_weight = std::exp(own - top);
      float total = own_weight;
      float* y = out_data + task * dim;
      for (int64_t d = 0; d < dim; d += kLanes)
        _mm256_storeu_ps(y + d, _mm256_mul_ps(_mm256_set1_ps(own_weight), load8(v_data + task * dim + d)));
      for (int64_t s = 0; s < used; ++s) {
        const int64_t part = (b * splits + s) * heads + h;
        const float factor = std::exp(tops[part] - top);
        total += factor * sums[part];
        const __m256 scale = _mm256_set1_ps(factor);
        for (int64_t d = 0; d < dim; d += kLanes)
          _mm256_storeu_ps(y + d, _mm256_fmadd_ps(scale, _mm256_loadu_ps(accs.get() + part * dim + d),
                                                  _mm256_loadu_ps(y + d)));
      }
      const __m256 scale = _mm256_set1_ps(1.0f / total);
      for (int64_t d = 0; d < dim; d += kLanes) _mm256_storeu_ps(y + d, _mm256_mul_ps(_mm256_loadu_ps(y + d), scale));
    }
  });
}

// q, k, v [B, H, D] fp32 (q scaled; k, v values of the pool's dtype); pool one layer's keys and values
// [2, P, block_size, H, D]; tables [B, W] int32; cached [B] int32: the tokens in the blocks before each sequence's new
// one -> [B, H, D] fp32, and k, v stored at position cached[b] of each sequence's blocks
at::Tensor pool_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& pool,
                                 const at::Tensor& tables, const at::Tensor& cached) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(2) % kLanes == 0,
              "pool_decode_attention: q must be [B, H, D] float32 with D a multiple of 8");
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "pool_decode_attention: k and v must be float32 like q");
  TORCH_CHECK(pool.dim() == 5 && pool.size(0) == 2 && pool.size(3) == q.size(1) && pool.size(4) == q.size(2) &&
                  pool.is_contiguous(),
              "pool_decode_attention: pool must be one layer's contiguous keys and values "
              "[2, blocks, block_size, H, D]");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && tables.scalar_type() == at::kInt &&
                  cached.dim() == 1 && cached.size(0) == q.size(0) && cached.scalar_type() == at::kInt,
              "pool_decode_attention: tables must be [B, W] int32 and cached [B] int32");
  const at::Tensor q_c = q.contiguous(), k_c = k.contiguous(), v_c = v.contiguous();
  const at::Tensor tables_c = tables.contiguous(), cached_c = cached.contiguous();
  at::Tensor keys = pool.select(0, 0), values = pool.select(0, 1);
  const int64_t num_blocks = pool.size(1), block_size = pool.size(2), width = tables.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {  // every block read or written lies in the pool
    const int64_t length = cached_c.const_data_ptr<int32_t>()[b];
    TORCH_CHECK(length >= 0 && length < width * block_size, "pool_decode_attention: sequence ", b, " caches ",
                length, " tokens, its table holds ", width * block_size, " with its new one");
    for (int64_t i = 0; i <= length / block_size; ++i) {
      const int32_t block = tables_c.const_data_ptr<int32_t>()[b * width + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "pool_decode_attention: block ", block, " is not in the pool of ",
                  num_blocks);
    }
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (pool.scalar_type()) {
    case at::kFloat:
      attend<float>(q_c, k_c, v_c, keys, values, tables_c, cached_c, out);
      store<float>(k_c, v_c, keys, values, tables_c, cached_c);
      break;
    case at::kHalf:
      attend<c10::Half>(q_c, k_c, v_c, keys, values, tables_c, cached_c, out);
      store<c10::Half>(k_c, v_c, keys, values, tables_c, cached_c);
      break;
    case at::kBFloat16:
      attend<c10::BFloat16>(q_c, k_c, v_c, keys, values, tables_c, cached_c, out);
      store<c10::BFloat16>(k_c, v_c, keys, values, tables_c, cached_c);
      break;
    default: TORCH_CHECK(false, "pool_decode_attention: the pool must be float32, float16 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minigpt_cpu, m) {
  m.def("pool_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) pool, Tensor tables, Tensor cached) -> Tensor");
}
TORCH_LIBRARY_IMPL(minigpt_cpu, CPU, m) { m.impl("pool_decode_attention", &pool_decode_attention); }
