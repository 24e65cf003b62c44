/* kvcx's CPU kernels in C, by what they compute: base.h (constants shared with Python, the layout, dtype
   conversions, CRC-32C), quant.h (quantize, pack, unpack), hadamard.h (the rotation). The attention kernel is
   attn.h, the per-channel widths widths.h, the engine formats engine.h and turboquant.h, the lattice codec e8p.h, vLLM's fused planes fused.h. Each is
   compiled once per instruction-set variant (kvcx.codecs.cpu): the SIMD paths are chosen by the compiler's
   target macros (__AVX2__, __AVX512F__, ...). */
#ifndef KVCX_KERNELS_H
#define KVCX_KERNELS_H

#include "base.h"
#include "quant.h"
#include "hadamard.h"

#endif /* KVCX_KERNELS_H */
