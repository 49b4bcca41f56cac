// int4 weights → signed bytes, for the AVX2 and AVX-512 kernels alike: each ISA file includes this inside its own
// namespace after its target pragma (no include here), so it is compiled for that file's ISA.
//
// 16 bytes (32 weights, low nibble first) → 32 signed bytes n − 8 in weight order: byte i widened to 16-bit lane i,
// its low nibble kept in the lane's low byte and its high nibble moved to the lane's high byte.
static inline __m256i i4_decode32(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i t = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(0x000F)),
                                    _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x0F00)));
  return _mm256_sub_epi8(t, _mm256_set1_epi8(8));
}
