// Causal attention on the CPU in fp32, forward and backward, over 64 x 64 tiles.
//
// Why our own: PyTorch's CPU flash kernel multiplies head_dim-deep (32-128) tiles through BLAS,
// which runs such thin products at a fifth to a third of its large-GEMM rate, and it masks the
// causal half inside 512-key blocks instead of skipping it. Here each product is a register-tiled
// loop whose depth is the head dimension (a template constant), and only tiles on or below the
// diagonal are computed. Built at first use with the machine's own vector width (see
// fsdpkit/train/native_attention.py); plain C++ with GCC/Clang vector types, no PyTorch headers,
// so it builds in a couple of seconds. Threads: std::thread over (batch, kv head) pairs, so one
// thread owns all writes to a kv head's dK/dV and no reduction is needed.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

constexpr int TILE = 64;
constexpr int NV = TILE / W;  // vectors in one tile row
constexpr float NEG_INF = -INFINITY;

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }  // x - 0 is x exactly, so this folds to a broadcast

// Horizontal sum and max as trees: a lane-by-lane chain is W dependent adds, and the compiler may
// not reorder float adds into a tree itself.
template <int N, typename Op>
inline float tree(const float* a, Op op) {
  if constexpr (N == 1) return a[0];
  else return op(tree<N / 2>(a, op), tree<N / 2>(a + N / 2, op));
}
inline float hsum(vf v) {
  float a[W];
  std::memcpy(a, &v, sizeof v);
  return tree<W>(a, [](float x, float y) { return x + y; });
}
inline float hmax(vf v) {
  float a[W];
  std::memcpy(a, &v, sizeof v);
  return tree<W>(a, [](float x, float y) { return std::max(x, y); });
}

// exp(x) for x <= 0 (what softmax needs): 2^n * p(r), n = round(x / ln 2), Cephes' polynomial,
// within 2 ulp of expf; below -87 (and -inf, the masked scores) it is exactly 0.
inline vf vexp(vf x) {
  const vf tiny = splat(-87.0f);
  vi dead = x < tiny;
  x = dead ? tiny : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf y = p * (vf)e;
  return dead ? vf{} : y;
}

// C[rows x TILE] = alpha * A[rows x D] . BT[D x TILE] (row strides: A lda, BT ldbt, C ldc).
template <int D>
void gemm_nt(const float* A, int64_t lda, const float* BT, int64_t ldbt, float* C, int64_t ldc, int rows,
             float alpha) {
  constexpr int R = std::max(1, 16 / NV);
  int r = 0;
  for (; r + R <= rows; r += R) {
    vf acc[R][NV] = {};
    for (int k = 0; k < D; ++k) {
      vf b[NV];
      for (int v = 0; v < NV; ++v) b[v] = load(BT + k * ldbt + v * W);
      for (int i = 0; i < R; ++i) {
        vf a = splat(A[(r + i) * lda + k]);
        for (int v = 0; v < NV; ++v) acc[i][v] += a * b[v];
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) store(C + (r + i) * ldc + v * W, acc[i][v] * alpha);
  }
  for (; r < rows; ++r) {
    vf acc[NV] = {};
    for (int k = 0; k < D; ++k) {
      vf a = splat(A[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[v] += a * load(BT + k * ldbt + v * W);
    }
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * W, acc[v] * alpha);
  }
}

// C[rows x D] += A[rows x kc] . B[kc x D] (row strides: A lda, B ldb); with TA, A is stored
// transposed (A[r][k] at k * lda + r), which is how P^T dO and dS^T Q read the score tiles.
template <int D, bool TA = false>
void gemm_nn_acc(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int rows, int kc) {
  constexpr int DV = D / W;
  constexpr int R = std::max(1, 16 / DV);
  auto a_at = [A, lda](int r, int k) { return TA ? A[k * lda + r] : A[r * lda + k]; };
  int r = 0;
  for (; r + R <= rows; r += R) {
    vf acc[R][DV];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < DV; ++v) acc[i][v] = load(C + (r + i) * D + v * W);
    for (int k = 0; k < kc; ++k) {
      vf b[DV];
      for (int v = 0; v < DV; ++v) b[v] = load(B + k * ldb + v * W);
      for (int i = 0; i < R; ++i) {
        vf a = splat(a_at(r + i, k));
        for (int v = 0; v < DV; ++v) acc[i][v] += a * b[v];
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < DV; ++v) store(C + (r + i) * D + v * W, acc[i][v]);
  }
  for (; r < rows; ++r) {
    vf acc[DV];
    for (int v = 0; v < DV; ++v) acc[v] = load(C + r * D + v * W);
    for (int k = 0; k < kc; ++k) {
      vf a = splat(a_at(r, k));
      for (int v = 0; v < DV; ++v) acc[v] += a * load(B + k * ldb + v * W);
    }
    for (int v = 0; v < DV; ++v) store(C + r * D + v * W, acc[v]);
  }
}

// Scores on the diagonal tile above the diagonal (and past the sequence's end) to -inf.
void mask_diagonal(float* S, int64_t lds, int rows) {
  for (int r = 0; r < rows; ++r)
    for (int c = r + 1; c < TILE; ++c) S[r * lds + c] = NEG_INF;
}

// A (B, heads, T, D) tensor with any strides but the last: heads and tokens may interleave, as
// the model's (B, T, H, D) projections viewed as (B, H, T, D) do, so no copy is needed.
struct Strided {
  const float* p;
  int64_t b, h, t;
  const float* at(int64_t bi, int64_t hi) const { return p + bi * b + hi * h; }
};

struct Dims {
  int64_t B, H, Hkv, T, Tp;
  float scale;
  int64_t items() const { return B * Hkv; }
  int rep() const { return static_cast<int>(H / Hkv); }
};

// One kv head's keys and values, zero-padded to whole tiles: row-major, and transposed tile by
// tile where a product runs along the keys. The forward needs only K^T and V.
template <int D>
struct KV {
  std::vector<float> k, v, kt, vt;
  KV(const float* K, int64_t ks, const float* V, int64_t vs, int64_t T, int64_t Tp, bool backward)
      : k(backward ? Tp * D : 0, 0.f), v(Tp * D, 0.f), kt(D * Tp), vt(backward ? D * Tp : 0) {
    for (int64_t t = 0; t < T; ++t) std::memcpy(v.data() + t * D, V + t * vs, D * sizeof(float));
    transpose(K, ks, kt.data(), T, Tp);
    if (backward) {
      for (int64_t t = 0; t < T; ++t) std::memcpy(k.data() + t * D, K + t * ks, D * sizeof(float));
      transpose(V, vs, vt.data(), T, Tp);
    }
  }
  // (T x D) to one (D x TILE) block per tile, zero past T. Whole-sequence rows (D x Tp) would put a
  // tile's D rows a multiple of 2 KiB apart, into a few L1 sets that cannot hold them all.
  static void transpose(const float* src, int64_t st, float* dst, int64_t T, int64_t Tp) {
    for (int64_t t0 = 0; t0 < Tp; t0 += TILE)
      for (int d = 0; d < D; ++d)
        for (int64_t t = t0; t < t0 + TILE; ++t) dst[t0 * D + d * TILE + (t - t0)] = t < T ? src[t * st + d] : 0.f;
  }
};

template <typename F>
void parallel_items(int64_t n, int nthreads, F body) {
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) body(i);
  };
  nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, n)));
  std::vector<std::thread> pool;
  for (int t = 1; t < nthreads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

// Each query tile's scores against all the keys it sees are held at once (64 x up to T floats), so
// softmax takes each row's max and sum once instead of rescaling a running sum tile by tile.
template <int D>
void forward(Strided q, Strided k, Strided v, float* out, float* lse, Dims d, int nthreads) {
  const int64_t T = d.T, Tp = d.Tp;
  const int ntiles = static_cast<int>(Tp / TILE);
  parallel_items(d.items(), nthreads, [&](int64_t item) {
    thread_local std::vector<float> S, O;
    S.resize(TILE * Tp);
    O.resize(TILE * D);
    const int64_t b = item / d.Hkv, g = item % d.Hkv;
    KV<D> kv(k.at(b, g), k.t, v.at(b, g), v.t, T, Tp, false);
    for (int hh = 0; hh < d.rep(); ++hh) {
      const int64_t h = g * d.rep() + hh, head = b * d.H + h;
      const float* Q = q.at(b, h);
      for (int i = 0; i < ntiles; ++i) {
        const int64_t r0 = int64_t(i) * TILE, len = r0 + TILE;  // keys 0 .. len - 1
        const int rows = static_cast<int>(std::min<int64_t>(TILE, T - r0));
        for (int j = 0; j <= i; ++j)
          gemm_nt<D>(Q + r0 * q.t, q.t, kv.kt.data() + j * TILE * D, TILE, S.data() + j * TILE, len, rows, d.scale);
        mask_diagonal(S.data() + r0, len, rows);
        float inv[TILE];
        for (int r = 0; r < rows; ++r) {
          float* s = S.data() + r * len;
          vf mx = load(s);
          for (int64_t c = W; c < len; c += W) { vf x = load(s + c); mx = x > mx ? x : mx; }
          const float m = hmax(mx);
          vf sum{};
          for (int64_t c = 0; c < len; c += W) {
            vf p = vexp(load(s + c) - m);
            store(s + c, p);
            sum += p;
          }
          const float l = hsum(sum);
          inv[r] = 1.f / l;
          lse[head * T + r0 + r] = m + std::log(l);
        }
        std::fill(O.begin(), O.end(), 0.f);
        for (int j = 0; j <= i; ++j)
          gemm_nn_acc<D>(S.data() + j * TILE, len, kv.v.data() + j * TILE * D, D, O.data(), rows, TILE);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < D; ++c) out[(head * T + r0 + r) * D + c] = O[r * D + c] * inv[r];
      }
    }
  });
}

template <int D>
void backward(Strided grad, Strided q, Strided k, Strided v, Strided out, const float* lse, float* dq, float* dk,
              float* dv, Dims d, int nthreads) {
  const int64_t T = d.T, Tp = d.Tp;
  const int ntiles = static_cast<int>(Tp / TILE);
  parallel_items(d.items(), nthreads, [&](int64_t item) {
    thread_local std::vector<float> P, dS, dQ;
    P.resize(TILE * TILE);
    dS.resize(TILE * TILE);
    dQ.resize(TILE * D);
    const int64_t b = item / d.Hkv, g = item % d.Hkv;
    KV<D> kv(k.at(b, g), k.t, v.at(b, g), v.t, T, Tp, true);
    std::vector<float> dK(Tp * D, 0.f), dV(Tp * D, 0.f);
    const int64_t qs = q.t, gs = grad.t, os = out.t;
    for (int hh = 0; hh < d.rep(); ++hh) {
      const int64_t h = g * d.rep() + hh, head = b * d.H + h;
      const float *Q = q.at(b, h), *G = grad.at(b, h), *Ob = out.at(b, h);
      const float* L = lse + head * T;
      for (int i = 0; i < ntiles; ++i) {
        const int64_t r0 = int64_t(i) * TILE;
        const int rows = static_cast<int>(std::min<int64_t>(TILE, T - r0));
        float Dr[TILE];  // rowsum(dO * O): the softmax backward's correction
        for (int r = 0; r < rows; ++r) {
          float s = 0;
          for (int c = 0; c < D; ++c) s += G[(r0 + r) * gs + c] * Ob[(r0 + r) * os + c];
          Dr[r] = s;
        }
        std::fill(dQ.begin(), dQ.end(), 0.f);
        std::fill(P.begin(), P.end(), 0.f);
        std::fill(dS.begin(), dS.end(), 0.f);
        for (int j = 0; j <= i; ++j) {
          gemm_nt<D>(Q + r0 * qs, qs, kv.kt.data() + j * TILE * D, TILE, P.data(), TILE, rows, d.scale);
          if (j == i) mask_diagonal(P.data(), TILE, rows);
          for (int r = 0; r < rows; ++r) {
            const float lr = L[r0 + r];
            for (int c = 0; c < NV; ++c) store(P.data() + r * TILE + c * W, vexp(load(P.data() + r * TILE + c * W) - lr));
          }
          gemm_nn_acc<D, true>(P.data(), TILE, G + r0 * gs, gs, dV.data() + j * TILE * D, TILE, rows);  // dV += P^T dO
          gemm_nt<D>(G + r0 * gs, gs, kv.vt.data() + j * TILE * D, TILE, dS.data(), TILE, rows, 1.f);   // dP = dO V^T
          for (int r = 0; r < rows; ++r) {
            const float dr = Dr[r];
            for (int c = 0; c < NV; ++c) {
              float* s = dS.data() + r * TILE + c * W;
              store(s, load(P.data() + r * TILE + c * W) * (load(s) - dr) * d.scale);
            }
          }
          gemm_nn_acc<D>(dS.data(), TILE, kv.k.data() + j * TILE * D, D, dQ.data(), rows, TILE);  // dQ += dS K
          gemm_nn_acc<D, true>(dS.data(), TILE, Q + r0 * qs, qs, dK.data() + j * TILE * D, TILE, rows);  // dK += dS^T Q
        }
        std::memcpy(dq + (head * T + r0) * D, dQ.data(), rows * D * sizeof(float));
      }
    }
    std::memcpy(dk + item * T * D, dK.data(), T * D * sizeof(float));
    std::memcpy(dv + item * T * D, dV.data(), T * D * sizeof(float));
  });
}

bool dims_ok(int64_t B, int64_t H, int64_t Hkv, int64_t T) {
  return B > 0 && Hkv > 0 && H % Hkv == 0 && T > 0;
}

Dims make_dims(int64_t B, int64_t H, int64_t Hkv, int64_t T, float scale) {
  return Dims{B, H, Hkv, T, (T + TILE - 1) / TILE * TILE, scale};
}

}  // namespace

// fp32 tensors: q, grad, out (B, H, T, D) and k, v (B, Hkv, T, D) with the strides given (batch,
// head, token; three per tensor, in elements; D contiguous); outputs contiguous: out, dq (B, H, T, D),
// dk, dv (B, Hkv, T, D), lse (B, H, T). Returns 0, or -1 for sizes this build has no kernel for.
extern "C" int fsdpkit_attention_forward(const float* q, const float* k, const float* v, const int64_t* strides,
                                         float* out, float* lse, int64_t B, int64_t H, int64_t Hkv, int64_t T,
                                         int64_t D, float scale, int nthreads) {
  if (!dims_ok(B, H, Hkv, T)) return -1;
  Dims d = make_dims(B, H, Hkv, T, scale);
  Strided sq{q, strides[0], strides[1], strides[2]}, sk{k, strides[3], strides[4], strides[5]},
      sv{v, strides[6], strides[7], strides[8]};
  switch (D) {
    case 32: forward<32>(sq, sk, sv, out, lse, d, nthreads); return 0;
    case 64: forward<64>(sq, sk, sv, out, lse, d, nthreads); return 0;
    case 128: forward<128>(sq, sk, sv, out, lse, d, nthreads); return 0;
    default: return -1;
  }
}

extern "C" int fsdpkit_attention_backward(const float* grad, const float* q, const float* k, const float* v,
                                          const float* out, const int64_t* strides, const float* lse, float* dq,
                                          float* dk, float* dv, int64_t B, int64_t H, int64_t Hkv, int64_t T,
                                          int64_t D, float scale, int nthreads) {
  if (!dims_ok(B, H, Hkv, T)) return -1;
  Dims d = make_dims(B, H, Hkv, T, scale);
  Strided sg{grad, strides[0], strides[1], strides[2]}, sq{q, strides[3], strides[4], strides[5]},
      sk{k, strides[6], strides[7], strides[8]}, sv{v, strides[9], strides[10], strides[11]},
      so{out, strides[12], strides[13], strides[14]};
  switch (D) {
    case 32: backward<32>(sg, sq, sk, sv, so, lse, dq, dk, dv, d, nthreads); return 0;
    case 64: backward<64>(sg, sq, sk, sv, so, lse, dq, dk, dv, d, nthreads); return 0;
    case 128: backward<128>(sg, sq, sk, sv, so, lse, dq, dk, dv, d, nthreads); return 0;
    default: return -1;
  }
}
