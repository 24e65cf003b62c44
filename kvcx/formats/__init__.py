"""Byte layouts: safetensors, kvcx's packed variant of it, the LMCache chunk wire format, atomic outputs.

Formats lay out bytes and check them; they encode and decode through the codecs' public ``encode`` /
``decode`` (into section views of their buffers), never through the kernels.

- :mod:`kvcx.formats.safetensors`: a strict pure-Python safetensors reader/writer;
- :mod:`kvcx.formats.packed`: the packed file (docs/FORMAT.md), :func:`compress_tensors` and its inverse;
- :mod:`kvcx.formats.chunk`: one KV chunk as a self-describing byte string (the LMCache serde's);
- :mod:`kvcx.formats.atomic`: outputs written to temporary files and committed together.
"""
