"""kvcx's Triton kernels (CUDA tensors; Triton's interpreter on CPU tensors where there is no GPU): the codec's
encode and decode (:mod:`~kvcx.codecs.triton_kernels.codec`) and the fused attention over packed codes
(:mod:`~kvcx.codecs.triton_kernels.attention`). Imported only by :mod:`kvcx.codecs.gpu`, their one door, and only
when a tensor goes to the Triton backend (triton is the ``kvcx[gpu]`` extra)."""
