// Fused CPU kernels for MindSpeed (forward and backward): rms_norm, swiglu, rope, and the causal
// softmax of the block-causal GEMM attention (cpu.py).
// One pass over each row, fp32 (double for fp64) arithmetic, rows split across threads.
// Semantics match mindspeed/backends/torch/kernels/reference.py (docs/kernels.md).
// Registered as torch.ops.mindspeed_cpu.* (no pybind: cheaper to build).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowGrain = 8;

// Loads/stores in the arithmetic type. bf16 <-> fp32 by bit operations (round to nearest even,
// NaN kept) so loops vectorize; c10's conversion has a branch the vectorizer rejects.
template <typename T>
inline at::opmath_type<T> ld(T v) { return static_cast<at::opmath_type<T>>(v); }
inline float ld(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T st(at::opmath_type<T> v) { return static_cast<T>(v); }
template <>
inline c10::BFloat16 st<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u = (f != f) ? 0x7FC00000u : u + 0x7FFFu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

// ---------------------------------------------------------------- rms_norm
// y = cast(x * rstd, T) * gamma  (rounded before the gamma multiply, like Megatron/HF)
template <typename T>
void rms_norm_fwd_kernel(const T* x, const T* gamma, T* y, float* rstd, int64_t rows, int64_t h, double eps) {
  using acc = at::opmath_type<T>;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      T* yr = y + r * h;
      acc ss = 0;
      for (int64_t j = 0; j < h; ++j) {
        acc v = ld(xr[j]);
        ss += v * v;
      }
      acc rs = acc(1) / std::sqrt(ss / acc(h) + acc(eps));
      rstd[r] = static_cast<float>(rs);
      for (int64_t j = 0; j < h; ++j) {
        acc n = ld(st<T>(ld(xr[j]) * rs));
        yr[j] = st<T>(n * ld(gamma[j]));
      }
    }
  });
}

// dx = rstd * (dy*g - xhat * mean(dy*g*xhat)); dgamma = sum_rows dy * cast(xhat, T)
template <typename T>
void rms_norm_bwd_kernel(const T* dy, const T* x, const T* gamma, const float* rstd, T* dx, float* dgamma,
                         int64_t rows, int64_t h) {
  using acc = at::opmath_type<T>;
  const int threads = at::get_num_threads();
  std::vector<acc> partial(static_cast<size_t>(threads) * h, acc(0));
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    acc* dg = partial.data() + static_cast<size_t>(at::get_thread_num()) * h;
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      const T* dyr = dy + r * h;
      T* dxr = dx + r * h;
      const acc rs = ld(rstd[r]);
      acc dot = 0;
      for (int64_t j = 0; j < h; ++j) {
        acc xhat = ld(xr[j]) * rs;
        acc g = ld(dyr[j]);
        dot += g * ld(gamma[j]) * xhat;
        dg[j] += g * ld(st<T>(xhat));
      }
      const acc mean_dot = dot / acc(h);
      for (int64_t j = 0; j < h; ++j) {
        acc xhat = ld(xr[j]) * rs;
        acc g = ld(dyr[j]) * ld(gamma[j]);
        dxr[j] = st<T>(rs * (g - xhat * mean_dot));
      }
    }
  });
  for (int64_t j = 0; j < h; ++j) {
    acc s = 0;
    for (int t = 0; t < threads; ++t) s += partial[static_cast<size_t>(t) * h + j];
    dgamma[j] = static_cast<float>(s);
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& gamma_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == gamma_in.scalar_type(), "rms_norm: x and gamma dtypes differ");
  TORCH_CHECK(gamma_in.numel() == x_in.size(-1), "rms_norm: gamma size != last dim of x");
  auto x = x_in.contiguous();
  auto gamma = gamma_in.contiguous();
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto y = at::empty_like(x);
  auto rstd_shape = x.sizes().vec();
  rstd_shape.back() = 1;
  auto rstd = at::empty(rstd_shape, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd", [&] {
    rms_norm_fwd_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), gamma.const_data_ptr<scalar_t>(),
                                  y.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<float>(), rows, h, eps);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                const at::Tensor& gamma_in, const at::Tensor& rstd_in) {
  auto dy = dy_in.contiguous().to(x_in.scalar_type());
  auto x = x_in.contiguous();
  auto gamma = gamma_in.contiguous();
  auto rstd = rstd_in.contiguous();
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto dx = at::empty_like(x);
  auto dgamma = at::empty({h}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd", [&] {
    rms_norm_bwd_kernel<scalar_t>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                  gamma.const_data_ptr<scalar_t>(), rstd.const_data_ptr<float>(),
                                  dx.mutable_data_ptr<scalar_t>(), dgamma.mutable_data_ptr<float>(), rows, h);
  });
  return {dx, dgamma.to(gamma_in.scalar_type()).view(gamma_in.sizes())};
}

// ---------------------------------------------------------------- swiglu (last dim)
// expf by range reduction + Cephes polynomial (about 1 ulp), written so the compiler vectorizes
// it (libm's expf is a scalar call and dominates swiglu otherwise).
inline float vec_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
inline double vec_exp(double x) { return std::exp(x); }

template <typename acc>
inline acc sigmoid(acc a) { return acc(1) / (acc(1) + vec_exp(-a)); }

// Row kernels take __restrict pointers so the compiler vectorizes them.
template <typename T>
void swiglu_row_fwd(const T* __restrict a, const T* __restrict b, T* __restrict y, int64_t h) {
  using acc = at::opmath_type<T>;
  for (int64_t j = 0; j < h; ++j) {
    acc av = ld(a[j]);
    y[j] = st<T>(av * sigmoid(av) * ld(b[j]));
  }
}

template <typename T>
void swiglu_row_bwd(const T* __restrict a, const T* __restrict b, const T* __restrict g, T* __restrict da,
                    T* __restrict db, int64_t h) {
  using acc = at::opmath_type<T>;
  for (int64_t j = 0; j < h; ++j) {
    acc av = ld(a[j]), bv = ld(b[j]), gv = ld(g[j]);
    acc s = sigmoid(av);
    da[j] = st<T>(gv * bv * s * (acc(1) + av * (acc(1) - s)));
    db[j] = st<T>(gv * av * s);
  }
}

at::Tensor swiglu_fwd(const at::Tensor& x_in) {
  auto x = x_in.contiguous();
  const int64_t two_h = x.size(-1), h = two_h / 2, rows = x.numel() / two_h;
  TORCH_CHECK(two_h % 2 == 0, "swiglu: last dim must be even");
  auto shape = x.sizes().vec();
  shape.back() = h;
  auto y = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu_fwd", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        swiglu_row_fwd<scalar_t>(xp + r * two_h, xp + r * two_h + h, yp + r * h, h);
    });
  });
  return y;
}

// d/da silu(a)*b = g*b*s*(1 + a*(1-s)); d/db = g*silu(a)
at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in) {
  auto x = x_in.contiguous();
  auto dy = dy_in.contiguous().to(x.scalar_type());
  const int64_t two_h = x.size(-1), h = two_h / 2, rows = x.numel() / two_h;
  auto dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "swiglu_bwd", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = dy.const_data_ptr<scalar_t>();
    scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        swiglu_row_bwd<scalar_t>(xp + r * two_h, xp + r * two_h + h, gp + r * h, dxp + r * two_h,
                                 dxp + r * two_h + h, h);
    });
  });
  return dx;
}

// ---------------------------------------------------------------- rope
// Forward: out = x*cos + rotate(x)*sin on the first `rot` channels; the rest are copied.
// Backward is the transpose: dx = g*cos + rotate^T(g*sin), selected by `backward`.
// cos/sin arrive expanded (zero strides allowed) to x.shape[:-1] + [rot]; a row's offset into
// them comes from its multi-index over the leading dims.
constexpr int64_t kShortRow = 32;   // rows shorter than one 32-lane vector of 16-bit values

// One row, rotate-half: y1 = x1*c1 - x2*sa, y2 = x2*c2 + x1*sb (forward sa=s1, sb=s2; the
// backward is the transpose: sign flipped, sa=s2, sb=s1).
template <typename T>
void rope_row_half(const T* __restrict x, T* __restrict y, const at::opmath_type<T>* __restrict c,
                   const at::opmath_type<T>* __restrict sa, const at::opmath_type<T>* __restrict sb,
                   at::opmath_type<T> sgn, int64_t half) {
  using acc = at::opmath_type<T>;
#define MINDSPEED_ROPE_HALF_BODY                                  \
  {                                                               \
    acc x1 = ld(x[j]), x2 = ld(x[j + half]);                      \
    y[j] = st<T>(x1 * c[j] - sgn * x2 * sa[j]);                   \
    y[j + half] = st<T>(x2 * c[j + half] + sgn * x1 * sb[j]);     \
  }
  // left to itself the compiler vectorizes 16-bit types 32 lanes wide, so a short bf16 row
  // (head dim 32: half = 16) ran entirely in the scalar remainder loop, 5x slower than fp32
  if (half < kShortRow / 2) {
#pragma omp simd simdlen(8)
    for (int64_t j = 0; j < half; ++j) MINDSPEED_ROPE_HALF_BODY
  } else if (half < kShortRow) {
#pragma omp simd simdlen(16)
    for (int64_t j = 0; j < half; ++j) MINDSPEED_ROPE_HALF_BODY
  } else {
    for (int64_t j = 0; j < half; ++j) MINDSPEED_ROPE_HALF_BODY
  }
#undef MINDSPEED_ROPE_HALF_BODY
}

// One row, interleaved pairs (e, o): y = x*c + swap(x)*ss, ss the signed, possibly swapped sin.
template <typename T>
void rope_row_pairs(const T* __restrict x, T* __restrict y, const at::opmath_type<T>* __restrict c,
                    const at::opmath_type<T>* __restrict ss, int64_t rot) {
  using acc = at::opmath_type<T>;
#define MINDSPEED_ROPE_PAIR_BODY                                  \
  {                                                               \
    acc xe = ld(x[j]), xo = ld(x[j + 1]);                         \
    y[j] = st<T>(xe * c[j] + xo * ss[j]);                         \
    y[j + 1] = st<T>(xo * c[j + 1] + xe * ss[j + 1]);             \
  }
  if (rot < kShortRow) {   // as rope_row_half
#pragma omp simd simdlen(8)
    for (int64_t j = 0; j < rot; j += 2) MINDSPEED_ROPE_PAIR_BODY
  } else if (rot < 2 * kShortRow) {
#pragma omp simd simdlen(16)
    for (int64_t j = 0; j < rot; j += 2) MINDSPEED_ROPE_PAIR_BODY
  } else {
    for (int64_t j = 0; j < rot; j += 2) MINDSPEED_ROPE_PAIR_BODY
  }
#undef MINDSPEED_ROPE_PAIR_BODY
}

template <typename T>
void rope_kernel(const T* x, const at::opmath_type<T>* cs, const at::opmath_type<T>* sn, T* out,
                 const std::vector<int64_t>& lead_sizes, const std::vector<int64_t>& lead_strides, int64_t last_stride,
                 int64_t rows, int64_t d, int64_t rot, int64_t mode, bool backward) {
  using acc = at::opmath_type<T>;
  const int64_t nd = static_cast<int64_t>(lead_sizes.size());
  const int64_t half = rot / 2;
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<acc> c(rot), s(rot), ss(rot);
    int64_t cached = -1;
    // the row's multi-index over the leading dims and its cos/sin offset: divided out once per
    // chunk, then stepped like an odometer (a division per row cost as much as a short row's math)
    std::vector<int64_t> idx(nd);
    int64_t off = 0;
    for (int64_t k = nd - 1, rem = begin; k >= 0; --k) {
      idx[k] = rem % lead_sizes[k];
      off += idx[k] * lead_strides[k];
      rem /= lead_sizes[k];
    }
    for (int64_t r = begin; r < end; ++r) {
      if (r > begin) {
        for (int64_t k = nd - 1; k >= 0; --k) {
          off += lead_strides[k];
          if (++idx[k] < lead_sizes[k]) break;
          off -= idx[k] * lead_strides[k];
          idx[k] = 0;
        }
      }
      if (off != cached) {   // rows of one position share cos/sin (heads, batch): gather once
        for (int64_t j = 0; j < rot; ++j) {
          c[j] = cs[off + j * last_stride];
          s[j] = sn[off + j * last_stride];
        }
        // pairs: forward ss = (-s_e, s_o); backward (transpose) ss = (s_o, -s_e)
        for (int64_t j = 0; j < rot; j += 2) {
          ss[j] = backward ? s[j + 1] : -s[j];
          ss[j + 1] = backward ? -s[j] : s[j + 1];
        }
        cached = off;
      }
      const T* xr = x + r * d;
      T* yr = out + r * d;
      if (mode == 0) {
        rope_row_half<T>(xr, yr, c.data(), backward ? s.data() + half : s.data(),
                         backward ? s.data() : s.data() + half, backward ? acc(-1) : acc(1), half);
      } else {
        rope_row_pairs<T>(xr, yr, c.data(), ss.data(), rot);
      }
      for (int64_t j = rot; j < d; ++j) yr[j] = xr[j];
    }
  });
}

at::Tensor rope_apply(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t mode,
                      bool backward) {
  TORCH_CHECK(mode == 0 || mode == 1, "rope: mode must be 0 or 1");
  auto x = x_in.contiguous();
  const int64_t d = x.size(-1), rot = cos_in.size(-1), rows = x.numel() / d;
  TORCH_CHECK(rot % 2 == 0 && rot <= d, "rope: bad rotary dim");
  auto target = x.sizes().vec();
  target.back() = rot;
  // cos and sin must share strides for one offset computation; make them so.
  // cos/sin stay in the arithmetic type (fp32 for bf16/fp16 x), as the reference does
  const auto acc_type = at::toOpMathType(x.scalar_type());
  auto cs = cos_in.to(acc_type).expand(target);
  auto sn = sin_in.to(acc_type).expand(target);
  if (cs.strides() != sn.strides()) {
    cs = cs.contiguous();
    sn = sn.contiguous();
  }
  std::vector<int64_t> lead_sizes(target.begin(), target.end() - 1);
  std::vector<int64_t> lead_strides(cs.strides().begin(), cs.strides().end() - 1);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_apply", [&] {
    using acc = at::opmath_type<scalar_t>;
    rope_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), cs.const_data_ptr<acc>(), sn.const_data_ptr<acc>(),
                          out.mutable_data_ptr<scalar_t>(), lead_sizes, lead_strides, cs.stride(-1), rows, d, rot,
                          mode, backward);
  });
  return out;
}

// ---------------------------------------------------------------- causal softmax (attention)
// scores [batch, rows, cols]: row i is query first_row + i and sees keys 0..first_row + i (the
// rest is the causal future). In place: the softmax over the visible keys, 0 beyond; returns the
// fp32 logsumexp [batch, rows]. One read and one write per element instead of torch's mask,
// max, softmax and second max.
template <typename T>
void causal_softmax_row(T* __restrict x, float* __restrict buf, int64_t visible, int64_t cols, float* lse) {
  float m = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) m = std::max(m, static_cast<float>(ld(x[j])));
  float sum = 0.f;
  for (int64_t j = 0; j < visible; ++j) {
    buf[j] = vec_exp(static_cast<float>(ld(x[j])) - m);
    sum += buf[j];
  }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < visible; ++j) x[j] = st<T>(buf[j] * inv);
  for (int64_t j = visible; j < cols; ++j) x[j] = st<T>(0.f);
  *lse = m + std::log(sum);
}

at::Tensor causal_softmax_(at::Tensor scores, int64_t first_row) {
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous(), "causal_softmax_: contiguous [batch, rows, cols]");
  const int64_t batch = scores.size(0), rows = scores.size(1), cols = scores.size(2);
  TORCH_CHECK(first_row >= 0 && first_row + rows <= cols, "causal_softmax_: rows past the last key");
  auto lse = at::empty({batch, rows}, scores.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, scores.scalar_type(), "causal_softmax_", [&] {
    scalar_t* xp = scores.mutable_data_ptr<scalar_t>();
    float* lp = lse.mutable_data_ptr<float>();
    at::parallel_for(0, batch * rows, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(cols);
      for (int64_t r = begin; r < end; ++r)
        causal_softmax_row<scalar_t>(xp + r * cols, buf.data(), first_row + r % rows + 1, cols, lp + r);
    });
  });
  return lse;
}

// In place dP <- P * (dP - D) over the visible keys (0 beyond): the gradient of the scores,
// D = rowsum(dO * O) - dlse per row (fp32 [batch, rows]).
template <typename T>
void softmax_grad_row(T* __restrict dp, const T* __restrict p, float d, int64_t visible, int64_t cols) {
  for (int64_t j = 0; j < visible; ++j) {
    float pv = ld(p[j]);
    dp[j] = st<T>(pv * (static_cast<float>(ld(dp[j])) - d));
  }
  for (int64_t j = visible; j < cols; ++j) dp[j] = st<T>(0.f);
}

void causal_softmax_grad_(at::Tensor dp, const at::Tensor& p, const at::Tensor& row_term, int64_t first_row) {
  TORCH_CHECK(dp.dim() == 3 && dp.is_contiguous() && p.is_contiguous() && dp.sizes() == p.sizes() &&
              dp.scalar_type() == p.scalar_type(), "causal_softmax_grad_: dP and P contiguous, same shape and dtype");
  const int64_t batch = dp.size(0), rows = dp.size(1), cols = dp.size(2);
  TORCH_CHECK(first_row >= 0 && first_row + rows <= cols, "causal_softmax_grad_: rows past the last key");
  auto d = row_term.to(at::kFloat).contiguous();
  TORCH_CHECK(d.numel() == batch * rows, "causal_softmax_grad_: row term must be [batch, rows]");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dp.scalar_type(), "causal_softmax_grad_", [&] {
    scalar_t* dpp = dp.mutable_data_ptr<scalar_t>();
    const scalar_t* pp = p.const_data_ptr<scalar_t>();
    const float* dd = d.const_data_ptr<float>();
    at::parallel_for(0, batch * rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        softmax_grad_row<scalar_t>(dpp + r * cols, pp + r * cols, dd[r], first_row + r % rows + 1, cols);
    });
  });
}

}  // namespace


TORCH_LIBRARY(mindspeed_cpu, m) {
  m.def("rms_norm_fwd", &rms_norm_fwd);
  m.def("rms_norm_bwd", &rms_norm_bwd);
  m.def("swiglu_fwd", &swiglu_fwd);
  m.def("swiglu_bwd", &swiglu_bwd);
  m.def("rope_apply", &rope_apply);
  m.def("causal_softmax_(Tensor(a!) scores, int first_row) -> Tensor", &causal_softmax_);
  m.def("causal_softmax_grad_(Tensor(a!) dp, Tensor p, Tensor row_term, int first_row) -> ()", &causal_softmax_grad_);
}
