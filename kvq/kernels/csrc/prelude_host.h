// Host (C++) words for quant_body.h: the tests compile the shared body with the system compiler and
// check it against the torch reference where no GPU is. float32 in and out only; scales as the plan says.
#include <cmath>
#include <cstring>
typedef unsigned int uint;
typedef unsigned char uchar;
typedef unsigned long long kvq_index;
struct uint4 { uint x, y, z, w; };
#define KVQ_DEVICE_FN static inline
#define KVQ_GMEM
#define KVQ_THREAD
#define KVQ_UNROLL
#define kvq_fma(a, b, c) std::fma(a, b, c)
#define kvq_sqrt(x) std::sqrt(x)
#define kvq_fabs(x) std::fabs(x)
#define kvq_max(a, b) std::fmax(a, b)
#define kvq_min(a, b) std::fmin(a, b)
typedef _Float16 kvq_half;  // GCC 12+ and Clang on x86-64 and arm64
#define kvq_to_half(x) ((kvq_half)(x))
#define kvq_from_half(h) ((float)(h))

static inline float kvq_bits_float(uint word) {
    float out;
    std::memcpy(&out, &word, sizeof out);
    return out;
}
static inline uint kvq_float_bits(float value) {
    uint out;
    std::memcpy(&out, &value, sizeof out);
    return out;
}
#define KVQ_IN_T float
#define KVQ_IN_PER_WORD 1
#define kvq_in_element(word, e) kvq_bits_float(word)
#define KVQ_OUT_T float
#define KVQ_OUT_PER_WORD 1
#define kvq_out_word(v) kvq_float_bits((v)[0])
