// The kernel body, included by each ISA file inside its own namespace after it defines `V`, its vector traits:
//   V::T, V::L (lanes), V::R (rows per register tile), V::O_of(R) (outputs per tile of R rows), V::B (outputs
//   per block), zero(), loadx(p), fma(a, b, c),
//   hsum(v) (a fixed order), and load<FMT>(row, rs, k, gs): L weights of one row from column k as fp32.
// No include here (the including file has them), so every instantiation is compiled for that file's ISA.

// The vectors of one decoded int4 chunk (q = 0 .. 32 / L − 1, each a compile-time index) into output j's accumulators.
template <int R, int O, int... q>
static inline void i4_chunks(typename V::Q d, typename V::T s, const float* x, int64_t ldx, int64_t k,
                             typename V::T (&acc)[R][O], int j, std::integer_sequence<int, q...>) {
  if constexpr (V::I4_32) {
    (([&] {
       const typename V::T w = V::template i4_chunk<q>(d, s);
       for (int r = 0; r < R; ++r) acc[r][j] = V::fma(V::loadx(x + r * ldx + k + q * V::L), w, acc[r][j]);
     }()), ...);
  }
}

// One register tile: rows [0, R) of x against outputs [o, o + O). Each (r, j) accumulator sees the same FMA
// sequence whatever R and O are, then the scalar tail in k order, then the I8 scale and the bias: so a row's result
// never depends on how many rows or outputs share the tile.
template <int FMT, int R, int O>
static inline void tile(const float* x, int64_t ldx, const Weight& W, int64_t K, int64_t o, float* y, int64_t ldy) {
  typename V::T acc[R][O];
  const uint8_t* rows[O];
  const uint16_t* rs[O];
  const int64_t gpr = FMT == I4 ? K / W.group : 0;
  for (int j = 0; j < O; ++j) {
    rows[j] = W.w + (o + j) * W.ld_bytes;
    rs[j] = FMT == I4 ? W.gscale + (o + j) * gpr : nullptr;
    for (int r = 0; r < R; ++r) acc[r][j] = V::zero();
  }
  const int64_t Kv = K / V::L * V::L;
  if constexpr (FMT == I4 && V::I4_32) {
    // int4 rows are whole groups (K a multiple of 32): each output's 32 weights decoded at once, then the same
    // per-(r, j) FMA sequence in k order as one vector at a time would give
    for (int64_t k = 0; k < K; k += 32) {
      for (int j = 0; j < O; ++j) {
        const typename V::Q d = V::i4_decode(rows[j] + (k >> 1));
        const typename V::T s = V::bcast_half(rs[j][k >> W.gshift]);
        i4_chunks<R, O>(d, s, x, ldx, k, acc, j, std::make_integer_sequence<int, 32 / V::L>{});
      }
    }
  } else {
    for (int64_t k = 0; k < Kv; k += V::L) {
      typename V::T w[O];
      for (int j = 0; j < O; ++j) w[j] = V::template load<FMT>(rows[j], rs[j], k, W.gshift);
      for (int r = 0; r < R; ++r) {
        typename V::T xv = V::loadx(x + r * ldx + k);
        for (int j = 0; j < O; ++j) acc[r][j] = V::fma(xv, w[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < O; ++j) {
      float s = V::hsum(acc[r][j]);
      for (int64_t k = Kv; k < K; ++k) s += x[r * ldx + k] * wscalar<FMT>(rows[j], rs[j], k, W.gshift);
      if (FMT == I8) s *= W.row_scale[o + j];
      y[r * ldy + o + j] = s + scalar_bias(W, o + j);
    }
  }
}

// Outputs [o, o + oc) of rows [0, R) in tiles of V::O_of(R) outputs (fewer rows, more outputs: enough independent
// accumulators to hide the FMA latency), the last outputs one at a time.
template <int FMT, int R>
static inline void tile_rows(const float* x, int64_t ldx, const Weight& W, int64_t K, int64_t o, int64_t oc,
                             float* y, int64_t ldy) {
  constexpr int O = V::O_of(R);
  int64_t j = 0;
  for (; j + O <= oc; j += O) tile<FMT, R, O>(x, ldx, W, K, o + j, y, ldy);
  for (; j < oc; ++j) tile<FMT, R, 1>(x, ldx, W, K, o + j, y, ldy);
}

// Blocks of V::B outputs (their weight rows stay in L2 while every row chunk of x passes over them), rows in chunks
// of V::R, the last chunk smaller.
template <int FMT>
static void run(const float* x, int64_t ldx, int64_t m, const Weight& W, int64_t K, int64_t o0, int64_t o1,
                float* y, int64_t ldy) {
  for (int64_t o = o0; o < o1; o += V::B) {
    const int64_t oc = o1 - o < V::B ? o1 - o : V::B;
    int64_t r = 0;
    for (; r + V::R <= m; r += V::R) tile_rows<FMT, V::R>(x + r * ldx, ldx, W, K, o, oc, y + r * ldy, ldy);
    switch (m - r) {  // the last rows: a smaller tile, the same per-row arithmetic
      case 3: tile_rows<FMT, 3 < V::R ? 3 : V::R>(x + r * ldx, ldx, W, K, o, oc, y + r * ldy, ldy); break;
      case 2: tile_rows<FMT, 2 < V::R ? 2 : V::R>(x + r * ldx, ldx, W, K, o, oc, y + r * ldy, ldy); break;
      case 1: tile_rows<FMT, 1>(x + r * ldx, ldx, W, K, o, oc, y + r * ldy, ldy); break;
      default: break;
    }
  }
}

static void kernel(const float* x, int64_t ldx, int64_t m, const Weight& W, int64_t K, int64_t o0, int64_t o1,
                   float* y, int64_t ldy) {
  switch (W.fmt) {
    case F32: run<F32>(x, ldx, m, W, K, o0, o1, y, ldy); break;
    case BF16: run<BF16>(x, ldx, m, W, K, o0, o1, y, ldy); break;
    case F16: run<F16>(x, ldx, m, W, K, o0, o1, y, ldy); break;
    case I8: run<I8>(x, ldx, m, W, K, o0, o1, y, ldy); break;
    case I4: run<I4>(x, ldx, m, W, K, o0, o1, y, ldy); break;
    default: break;
  }
}
