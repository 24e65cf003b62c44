"""The pure-Python safetensors layer: golden bytes vs Hugging Face, strict header checks, fuzzing."""
import json
import struct

import numpy as np
import pytest
import safetensors.numpy as hf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcx.codecs.dtypes import BFLOAT16
from kvcx.errors import FormatError, KvcxError
from kvcx.formats import safetensors as kst


def sample_tensors():
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "h": np.arange(6, dtype=np.float16),
        "b": np.array([1.5, -2.25], dtype=BFLOAT16),
        "i": np.arange(5, dtype=np.int64),
        "u": np.arange(7, dtype=np.uint8),
        "m": np.array([True, False, True]),
        "d": np.array([1.0, 2.0], dtype=np.float64),
        "s": np.array([-1, 2], dtype=np.int16),
        "e": np.zeros((0, 3), dtype=np.float32),
    }


def test_bytes_identical_to_huggingface():
    t = {k: v for k, v in sample_tensors().items() if k != "b"}  # HF's numpy API has no bfloat16
    assert kst.save(t, {"a": "1"}) == hf.save(t, {"a": "1"})
    assert kst.save(t) == hf.save(t)


def test_golden_bytes_and_alignment():
    data = kst.save({"x": np.array([1.0, -2.0], np.float16)})
    header = b'{"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}'
    header += b" " * (-len(header) % 8)
    assert data == struct.pack("<Q", len(header)) + header + bytes.fromhex("003c00c0")
    assert (8 + len(header)) % 8 == 0


def test_roundtrip_file_and_huggingface_reads_ours(tmp_path):
    t = sample_tensors()
    p = tmp_path / "a.safetensors"
    kst.save_file(t, p, {"k": "v"})
    back = kst.load_file(p)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
        assert not back[k].flags.writeable  # memory-mapped, read-only
    ours = {k: v for k, v in t.items() if k != "b"}
    p2 = tmp_path / "b.safetensors"
    kst.save_file(ours, p2)
    theirs = hf.load_file(str(p2))
    assert set(theirs) == set(ours)
    assert kst.read_metadata(p) == {"k": "v"}


def test_order_invariance():
    t = sample_tensors()
    assert kst.save(dict(reversed(list(t.items())))) == kst.save(t)


def _file(header: dict, data: bytes = b"", pad=True) -> bytes:
    hb = json.dumps(header).encode()
    if pad:
        hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


@pytest.mark.parametrize("blob,message", [
    (b"", "not a safetensors file \\(only 0 bytes"),
    (b"\x01\x02", "not a safetensors file"),
    (struct.pack("<Q", 2 ** 62), "header length 4611686018427387904 exceeds the 100000000-byte cap"),
    (struct.pack("<Q", 100), "truncated: the header claims 100 bytes"),
    (struct.pack("<Q", 4) + b"[1] ", "header must be a JSON object starting with '{'"),
    (struct.pack("<Q", 4) + b"{x: ", "header is not valid JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "header is not valid UTF-8"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a ": 1}, bytes(8)),
     "key 'a ' is invalid, expected an object"),
    (_file({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "unknown dtype 'Q4'"),
    (_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)), "invalid shape"),
    (_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
     "shape \\[3\\] of F32 needs 12 bytes but data_offsets span 8"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8)), "invalid data_offsets"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "overlaps the previous"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "leaves a gap"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)),
     "data section has 4 bytes but the tensors cover 8"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(9)), "trailing bytes"),
    (_file({"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 8]}}, bytes(8)),
     "needs 4835703278458516698824704 bytes"),
    (_file({"__metadata__": {"a": 1}}), "__metadata__ must map strings to strings"),
    (struct.pack("<Q", 16) + b'{"a":1, "a":2}  ', "duplicate key 'a'"),
])
def test_strict_header_errors(blob, message):
    with pytest.raises(FormatError, match=message):
        kst.load(blob)


def test_file_errors(tmp_path):
    with pytest.raises(FormatError, match="no such file; check the path"):
        kst.load_file(tmp_path / "missing.safetensors")
    with pytest.raises(FormatError, match="is a directory"):
        kst.load_file(tmp_path)
    with pytest.raises(FormatError, match="the output directory .* does not exist"):
        kst.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "no" / "x.safetensors")
    with pytest.raises(FormatError, match="cannot store"):
        kst.save({"a": np.zeros(2, np.complex64)})


def test_failed_write_leaves_existing_file_untouched(tmp_path):
    p = tmp_path / "keep.safetensors"
    kst.save_file({"a": np.ones(3, np.float32)}, p)
    before = p.read_bytes()
    with pytest.raises(FormatError):
        kst.save_file({"a": np.ones(3, np.float32), "__metadata__": np.ones(1)}, p)
    assert p.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir()] == ["keep.safetensors"]


VALID = kst.save(sample_tensors(), {"note": "fuzz"})


def _must_be_clean(blob: bytes):
    try:
        kst.load(blob)
    except KvcxError:
        pass


def test_every_truncation_is_a_clean_error():
    for n in range(len(VALID)):
        with pytest.raises(FormatError):
            kst.load(VALID[:n])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(0, len(VALID) - 1), bit=st.integers(0, 7))
def test_bit_flips_never_crash(pos, bit):
    b = bytearray(VALID)
    b[pos] ^= 1 << bit
    _must_be_clean(bytes(b))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(blob):
    _must_be_clean(blob)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 2 ** 64 - 1), body=st.binary(max_size=64))
def test_random_header_lengths_never_crash(n, body):
    _must_be_clean(struct.pack("<Q", n) + body)


def test_zero_d_tensors_and_metadata_order():
    import safetensors.numpy as hf

    t = {"s": np.array(3.5, np.float32), "i": np.array(7, np.int64)}
    ours = kst.save(t)
    assert ours == hf.save(t)
    back = kst.load(ours)
    assert back["s"].shape == () and back["i"].shape == ()
    meta = {"zeta": "1", "C": "2", "a": "3", "kvcx.x": "4"}
    data = kst.save(t, meta)
    hdr = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert list(hdr["__metadata__"]) == sorted(meta)  # byte order
    theirs = hf.save(t, meta)  # HF 0.8 writes metadata in its hash map's order: same content
    assert json.loads(theirs[8:8 + int.from_bytes(theirs[:8], "little")]) == hdr
