"""The Triton backend of the integer codec: the same bytes as the CPU kernels, both ways, and its errors.

Without a GPU (CI) Triton's interpreter runs the kernels on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); with one they run on it. Nothing here is skipped for lack of a GPU.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvcx.codecs import IntCodec, KVConfig, get_codec
from kvcx.codecs.gpu import to_device, to_host
from kvcx.codecs.tensors import numpy_to_torch, torch_to_numpy
from kvcx.codecs.triton_kernels.attention import _codes16
from kvcx.codecs.triton_kernels.products import _absmax
from kvcx.errors import CodecError

from helpers import bits_of, keys_like, random_array

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = [
    dict(scheme="symmetric"),                                           # the reference design
    dict(scheme="asymmetric"),
    dict(scheme="symmetric", rotate=True, sinks=1),                     # the default's values
    dict(scheme="asymmetric", axis="channel", sinks=1),                 # the default's keys
    dict(scheme="symmetric", axis="channel", group_size=32),
    dict(scheme="asymmetric", axis="channel", rotate=True, sinks=3),
    dict(scheme="symmetric", group_size=128, rotate=True),              # groups of two tokens
    dict(scheme="asymmetric", group_size=16, rotate=True, sinks=2),     # four groups per token
]
# odd lengths, partial groups (token and channel), a head dim that is not a power of two, sinks > tokens
SHAPES = [(2, 3, 37, 64), (1, 2, 100, 32), (3, 130, 64), (1, 1, 1, 64)]
DTYPES = [np.float32, np.float16, "bfloat16"]


def _same_record(cpu, gpu):
    host = to_host(gpu)
    assert host.shape == cpu.shape and host.dtype == cpu.dtype and host.config == cpu.config
    assert np.array_equal(cpu.codes, host.codes)
    assert np.array_equal(bits_of(cpu.scales), bits_of(host.scales))
    assert (cpu.zeros is None) == (host.zeros is None)
    if cpu.zeros is not None:
        assert np.array_equal(bits_of(cpu.zeros), bits_of(host.zeros))
    if cpu.sinks is not None:
        assert np.array_equal(bits_of(cpu.sinks), bits_of(host.sinks))


def _check(settings, x):
    """x (NumPy) through the CPU kernels and (as a tensor) through Triton: records and decoded values equal
    bit for bit, and each side decodes the other's record to the same bits."""
    cpu_codec, tri_codec = IntCodec(**settings), IntCodec(**settings, backend="triton")
    cpu = cpu_codec.encode(x)
    gpu = tri_codec.encode(_as_tensor(x))
    _same_record(cpu, gpu)
    y = cpu_codec.decode(cpu)
    assert np.array_equal(bits_of(y), bits_of(torch_to_numpy(tri_codec.decode(gpu))))
    assert np.array_equal(bits_of(y), bits_of(torch_to_numpy(tri_codec.decode(to_device(cpu, DEVICE)))))
    assert np.array_equal(bits_of(y), bits_of(cpu_codec.decode(to_host(gpu))))


def _as_tensor(x):
    return numpy_to_torch(x, DEVICE)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_same_bytes_as_the_cpu_kernels(settings, shape):
    if IntCodec(**settings).supports(shape):
        _check(settings, keys_like(shape, seed=len(shape) + shape[-2]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[2], SETTINGS[3]], ids=["reference", "values", "keys"])
def test_same_bytes_for_every_dtype(dtype, settings):
    from kvcx.codecs.dtypes import BFLOAT16

    x = random_array((2, 2, 45, 64), np.float32, seed=3, outlier_channels=2)
    x[0, 0, 5, :] = 0.0                   # a token of zeros (scale 0 groups in token mode)
    x[1, 1, :, 7] = -0.0                  # a channel of negative zeros (min/max of order keys)
    x = x.astype(BFLOAT16 if dtype == "bfloat16" else dtype)
    _check(settings, x)


def test_per_channel_programs_of_fewer_channels_write_the_same_bytes(monkeypatch):
    """kvcx.codecs.gpu.CODEC_CHANNELS: the per-channel kernels over a few channels a program (a head dim that is
    not a power of two, sinks, a partial block) give the CPU kernels' bytes and values; a rotated codec keeps
    whole rows; a setting that is not a power of two is refused by name."""
    from kvcx.codecs import gpu

    monkeypatch.setattr(gpu, "CODEC_CHANNELS", 16)
    for settings, shape in ((SETTINGS[3], (2, 2, 45, 64)), (SETTINGS[4], (1, 3, 70, 48)),
                            (SETTINGS[5], (1, 2, 40, 32))):
        _check(settings, keys_like(shape, seed=shape[-1]))
    monkeypatch.setattr(gpu, "CODEC_CHANNELS", 24)
    with pytest.raises(CodecError, match=r"CODEC_CHANNELS.*power of two"):
        IntCodec(**SETTINGS[3], backend="triton").encode(_as_tensor(keys_like((1, 1, 8, 64), seed=1)))


@pytest.mark.parametrize("loop,channels", [(1, None), (2, None), (1, 16)], ids=["loop1", "loop2", "loop1-16ch"])
def test_encode_in_a_loop_writes_the_same_bytes(loop, channels, monkeypatch):
    """kvcx.codecs.gpu.CODEC_LOOP (a setting profile_gpu --codecs times): the encode's programs loop over their
    slab's blocks (per channel) or whole programs' groups (per token), every STEP-th from their own, the next one's
    values loaded while they work one; a slab's partial last groups by its first program after its loop. The CPU
    kernels' bytes and values (sinks, a partial last block or program, rotated codecs, fewer channels a program,
    groups of a token and of two), with fewer programs than blocks or groups' programs (so the loop runs)."""
    from kvcx.codecs import gpu

    monkeypatch.setattr(gpu, "CODEC_LOOP", loop)
    monkeypatch.setattr(gpu, "CODEC_CHANNELS", channels)
    for settings, shape in ((SETTINGS[3], (2, 3, 700, 64)), (SETTINGS[4], (1, 2, 333, 48)),
                            (SETTINGS[5], (1, 2, 900, 32)), (SETTINGS[2], (2, 3, 700, 64)),
                            (SETTINGS[1], (1, 2, 1000, 48)), (SETTINGS[6], (1, 2, 640, 64))):
        codec = IntCodec(**settings, backend="triton")
        lay = codec.layout(shape, "x")
        _, _, grid, const = gpu.encode_launch(codec, lay)
        full = gpu._programs(codec, lay)[2][1]
        assert 0 < const["STEP"] == grid[1] < full, (settings, grid, full)
        _check(settings, keys_like(shape, seed=shape[-2]))
    for bad in (0, -2, 1.5, "2"):   # refused by the setting's name, before any launch
        monkeypatch.setattr(gpu, "CODEC_LOOP", bad)
        with pytest.raises(CodecError, match=r"CODEC_LOOP.*whole number from 1"):
            IntCodec(**SETTINGS[3], backend="triton").encode(_as_tensor(keys_like((1, 1, 8, 64), seed=1)))


@pytest.mark.parametrize("S", [20, 21, 90], ids=lambda s: f"S={s}")
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_many_sinks_and_sinks_alone(axis, S):
    """The kernels copy the exact sinks themselves (a slab's first program, 1,024 values at a time: 20 tokens of
    64 are two chunks) and check them; a tensor of sinks alone (S = 20) launches no kernel. Bytes and decoded
    values equal the CPU kernels' every way; a NaN in the last sink value is refused at encode, an Inf put in a
    record's last sink value at decode."""
    settings = dict(scheme="asymmetric", axis=axis, sinks=20)
    x = random_array((2, 2, S, 64), np.float32, seed=S)
    _check(settings, x)
    codec = IntCodec(**settings, backend="triton")
    bad = _as_tensor(x).clone()
    bad[1, 1, 19, 63] = float("nan")
    with pytest.raises(CodecError, match=r"'k'.*1 NaN/Inf"):
        codec.encode(bad, name="k")
    p = codec.encode(_as_tensor(x))
    damaged = type(p)(**{**p.__dict__, "sinks": p.sinks.clone()})
    damaged.sinks.view(-1)[-1] = float("inf")
    with pytest.raises(CodecError, match=r"'k'.*exact sink tokens hold NaN/Inf.*encode it again"):
        codec.decode(damaged, name="k")


def _boundary_groups(asym: bool, groups: int, seed: int) -> np.ndarray:
    """[groups, 64] FP32 groups whose quotients x / scale fall on and a few ulps beside the codes' rounding
    boundaries k + 1/2, where a division that is not correctly rounded gives another code. Each group's scale is
    a random FP16 value s (normal or subnormal) exactly: its extreme is 7 s (symmetric) or its range [0, 15 s]
    (asymmetric), so scale = fp16(7 s / 7) = s and the zero point is 0."""
    rng = np.random.default_rng(seed)
    s = rng.choice(np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16), groups).astype(np.float32)[:, None]
    bounds = np.arange(0.5, 15.0) if asym else np.arange(-6.5, 7.0)   # inside the group's range
    x = (rng.choice(bounds, (groups, 64)).astype(np.float32) * s).astype(np.float32)   # exact: b has 5 bits
    x = (x.view(np.int32) + rng.integers(-2, 3, x.shape).astype(np.int32)).view(np.float32)
    x[:, 0] = 7 * s[:, 0] if not asym else 15 * s[:, 0]
    if asym:
        x[:, 1] = 0.0
    return x


@pytest.mark.parametrize("asym", [False, True], ids=["symmetric", "asymmetric"])
def test_same_codes_on_the_rounding_boundaries(asym):
    """Values on and beside x / scale = k + 1/2 for every scale kind: the Triton encoder divides by a reciprocal
    with two corrections, which must round every quotient as the CPU's division does (a plain product by the
    reciprocal gives other codes here)."""
    x = _boundary_groups(asym, 96, seed=11 + asym)
    scheme = "asymmetric" if asym else "symmetric"
    _check(dict(scheme=scheme), x.reshape(1, 96, 64))                              # a group a token
    _check(dict(scheme=scheme, axis="channel"), np.ascontiguousarray(x.T).reshape(1, 64, 96))  # a group a channel


def test_real_cache_data_through_the_default_scheme(loaded):
    """Keys and values of the embedded model (37 tokens: partial channel groups) under kvcx's default scheme."""
    model, tok, _ = loaded
    ids = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids[:, :37]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    cfg = KVConfig.from_scheme("kvcx")
    for layer in (0, len(cache.layers) // 2):
        for which, codec in (("keys", cfg.key), ("values", cfg.value)):
            x = getattr(cache.layers[layer], which).float().numpy()
            _check(_settings(codec), x)


def _settings(codec):
    return {k: v for k, v in codec.get_config().items() if k != "id"}


def test_decode_into_a_longer_tensor_at_an_offset():
    x = keys_like((1, 2, 40, 64), seed=5)
    codec = IntCodec(scheme="asymmetric", axis="channel", sinks=1, backend="triton")
    p = codec.encode(_as_tensor(x))
    out = torch.full((1, 2, 100, 64), 7.0, device=DEVICE)
    codec.decode(p, out=out, token_offset=30)
    want = IntCodec(scheme="asymmetric", axis="channel", sinks=1).decode(IntCodec(scheme="asymmetric", axis="channel", sinks=1).encode(x))
    assert np.array_equal(out[:, :, 30:70].cpu().numpy(), want)
    assert bool((out[:, :, :30] == 7).all()) and bool((out[:, :, 70:] == 7).all())


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # the interpreter's FP16 scale
def test_errors_name_the_tensor_and_the_fix():
    codec = IntCodec(backend="triton")
    bad = torch.ones(2, 8, 64, device=DEVICE)
    bad[1, 3, 5] = float("nan")
    with pytest.raises(CodecError, match=r"'k'.*1 NaN/Inf"):
        codec.encode(bad, name="k")
    with pytest.raises(CodecError, match="too large for FP16 scales"):
        codec.encode(torch.full((2, 8, 64), 1e6, device=DEVICE), name="k")
    with pytest.raises(CodecError, match="4-bit codecs"):
        IntCodec(bits=3, backend="triton").encode(torch.ones(2, 8, 64, device=DEVICE), name="k")
    with pytest.raises(CodecError, match="dtype torch.int32"):
        codec.encode(torch.ones(2, 8, 64, dtype=torch.int32, device=DEVICE), name="k")
    with pytest.raises(CodecError, match="backend 'gpu' is not supported"):
        IntCodec(backend="gpu")
    p = codec.encode(torch.ones(2, 8, 64, device=DEVICE))
    damaged = to_device(to_host(p), DEVICE)
    damaged = type(p)(**{**damaged.__dict__, "scales": damaged.scales.clone()})
    damaged.scales[0, 0] = float("inf")
    with pytest.raises(CodecError, match="damaged"):
        codec.decode(damaged, name="k")
    with pytest.raises(CodecError, match="out must be"):
        codec.decode(p, out=torch.empty(2, 8, 63, device=DEVICE))


@pytest.mark.parametrize("field,value,message", [
    ("scales", float("nan"), "scales or zero points"), ("scales", -1.0, "scales or zero points"),
    ("zeros", float("inf"), "scales or zero points"), ("sinks", float("nan"), "exact sink tokens hold NaN/Inf")])
def test_a_damaged_record_is_refused_by_what_is_damaged(field, value, message):
    """Scales, zero points and sink tokens are checked on the device in one copy to the host; the error still
    names what is damaged. A NaN in a sink token is refused at encode as in any other value."""
    codec = IntCodec(scheme="asymmetric", axis="channel", sinks=1, backend="triton")
    x = torch.randn(2, 2, 40, 64, device=DEVICE)
    p = codec.encode(x)
    damaged = type(p)(**{**p.__dict__, field: getattr(p, field).clone()})
    getattr(damaged, field).view(-1)[3] = value
    with pytest.raises(CodecError, match=rf"'k'.*{message}.*encode it again"):
        codec.decode(damaged, name="k")
    assert bool(torch.isfinite(codec.decode(p, name="k")).all())   # the record as written passes the same checks
    x[1, 0, 0, 5] = float("nan")
    with pytest.raises(CodecError, match=r"'k'.*1 NaN/Inf"):
        codec.encode(x, name="k")


def test_backend_is_not_part_of_the_config():
    codec = IntCodec(scheme="asymmetric", backend="triton")
    assert codec.get_config() == IntCodec(scheme="asymmetric").get_config()
    assert codec.with_threads(1).backend == "triton"
    # a NumPy array always runs on the CPU kernels, whatever the codec names
    assert isinstance(codec.encode(np.ones((4, 64), np.float32)).codes, np.ndarray)


# per-channel values with zero points, keys in per-channel blocks of 16 tokens (tiles of 16 tokens)
CHANNELS = (dict(scheme="asymmetric", axis="channel", group_size=16, sinks=2),
            dict(scheme="asymmetric", axis="channel", group_size=32, sinks=2))


# (scheme, head dim, query rows a KV head, residual tokens, mask, tokens a split, products, packed tokens)
ATTENTION_CASES = [
    ("kvcx", 64, 3, 5, "float", 64, "", 150),          # the default: channel keys + sinks, rotated values; 3 splits
    ("kvcx", 128, 1, 0, "bool", 1024, "", 150),        # two value groups per token, no residual, one split
    ("kvcx", 16, 2, 2, "float", 64, "tf32x2", 130),    # head dim 16: FP32 sums (tl.dot needs 16 a stream)
    ("reference", 64, 2, 1, None, 64, "", 150),        # per-token keys and values, no sinks
    ("kvcx", 64, 3, 5, "float", 64, "ieee", 150),      # the products as tl.dot (query rows padded to 16)
    ("kvcx", 32, 4, 2, "bool", 32, "tf32x3", 333),     # 11 splits: the merge reads them in two chunks
    ("kvcx", 64, 4, 3, "float", 64, "tf32x2", 150),    # codes' products in two TF32 passes
    ("reference", 128, 2, 2, "bool", 96, "tf32x2", 260),   # two value and key groups per token, through tl.dot
    ("kivi", 64, 8, 1, "float", 64, "tf32x2", 180),    # per-token values with zero points, 8 query rows a head
    ("kivi", 32, 2, 1, None, 32, "tf32", 150),         # one TF32 pass (exact in the interpreter)
    ((CHANNELS[0], dict(scheme="symmetric", group_size=256, sinks=2)), 64, 2, 1, None, 64, "", 140),  # 4-token groups
    (CHANNELS, 64, 2, 3, "float", 48, "", 200),        # per-channel values, 16-token key blocks
    (CHANNELS, 32, 2, 0, None, 32, "ieee", 97),        # the same through tl.dot, a partial last tile
    ("kvcx", 64, 4, 3, "float", 64, "int8x3", 150),    # codes' products on the integer tensor cores
    ("kivi", 128, 2, 1, "bool", 96, "int8x3", 170),    # the same with values' zero points, a partial last tile
    ("reference", 64, 2, 2, None, 64, "int8x3", 150),  # per-token keys (dequantized: FP32 products), int8 values
    (CHANNELS, 64, 2, 0, "float", 32, "int8x3", 97),   # 16-token tiles: "tf32x2" (int8 products sum 32 or more)
    ((dict(scheme="asymmetric", axis="channel", rotate=True, sinks=1), dict(scheme="symmetric", rotate=True, sinks=1)),
     64, 4, 2, "float", 64, "int8x3", 150),           # rotated keys: the query rotated (and scaled) before the kernel
    # the fast mode (the default): FP16 products, measured against SDPA in BF16 over the same decoded tokens
    ("kvcx", 128, 4, 3, "float", 64, "fp16", 300),     # Llama-3's shape: two value groups a token, 5 splits
    ("kvcx", 64, 3, 5, "bool", 64, "fp16", 150),       # 3 query rows a head, a partial last tile
    ("kivi", 128, 2, 1, "float", 96, "fp16", 170),     # values' zero points (per token)
    (CHANNELS, 64, 2, 0, "float", 32, "fp16", 97),     # per-channel values, 16-token key blocks
    ("reference", 64, 2, 2, None, 64, "fp16", 150),    # per-token keys: "tf32x2"
    ((dict(scheme="asymmetric", axis="channel", rotate=True, sinks=1), dict(scheme="symmetric", rotate=True, sinks=1)),
     64, 4, 2, None, 64, "fp16", 150),
]
# the next tile's codes loaded ahead (a --tune setting, not the default): the same kernel but for its loads, run
# on a layout of each kind (channel keys and rotated values, per-token keys, per-channel values with a partial
# tile and several splits, int8 products) rather than on all of them; in the fast mode transposed, each tile's
# scales with the tile before it (its layouts as for EARLY)
PREFETCHED = {0, 3, 11, 13, 18, 19, 20, 23}
# the fast mode's first tile loaded before the query (a --tune setting): its transposed layouts (Llama-3's shape,
# a partial last tile, values' zero points, rotated keys)
EARLY = {18, 19, 20, 23}


def _case_id(i: int, loads: str) -> str:
    scheme, D, _, _, _, _, dot, S = ATTENTION_CASES[i]
    name = scheme if isinstance(scheme, str) else f"layout{i}"
    return f"{loads}-{name}-D{D}-{dot or 'fp32'}-{S}"


@pytest.mark.parametrize("loads,scheme,D,R,nr,mask_kind,per,dot,S",
                         [pytest.param("load", *c, id=_case_id(i, "load")) for i, c in enumerate(ATTENTION_CASES)] +
                         [pytest.param(loads, *ATTENTION_CASES[i], id=_case_id(i, loads))
                          for loads, cases in (("prefetch", PREFETCHED), ("early", EARLY)) for i in sorted(cases)])
def test_fused_attention_equals_sdpa_over_the_decoded_cache(loads, scheme, D, R, nr, mask_kind, per, dot, S):
    """The Triton decode step over packed codes equals SDPA over the decoded cache within FP32 rounding (batch 2,
    row 1 left-padded), with the next tile's codes loaded in each step, prefetched, or (the fast mode) a split's
    first tile loaded before the query; in the fast mode ("fp16": FP16 products, FP32 sums) within what SDPA in
    BF16 over the same decoded tokens loses itself."""
    from kvcx.codecs import gpu_attn
    from kvcx.codecs.gpu_attn import attend

    launch = gpu_attn.LaunchSettings(dot=dot, prefetch=loads == "prefetch", early_tile=loads == "early")

    g = torch.Generator().manual_seed(D + R)
    if isinstance(scheme, tuple):
        kc, vc = (IntCodec(**c, backend="triton") for c in scheme)
    else:
        cfg = KVConfig.from_scheme(scheme)
        kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    B, Hkv = 2, 2
    K = (torch.randn(B, Hkv, S, D, generator=g) * torch.rand(D, generator=g) * 2 + torch.randn(D, generator=g))
    V = torch.randn(B, Hkv, S, D, generator=g)
    rk, rv = torch.randn(B, Hkv, nr, D, generator=g), torch.randn(B, Hkv, nr, D, generator=g)
    q = torch.randn(B, Hkv * R, D, generator=g)
    K, V, rk, rv, q = (t.to(DEVICE) for t in (K, V, rk, rv, q))
    pk, pv = kc.encode(K), vc.encode(V)
    keep = torch.ones(B, S + nr, dtype=torch.bool, device=DEVICE)
    keep[1, :20] = False
    mask = None if mask_kind is None else keep if mask_kind == "bool" else \
        torch.zeros(B, S + nr, device=DEVICE).masked_fill(~keep, float("-inf"))
    out = attend(q, pk, pv, kc, vc, rk if nr else None, rv if nr else None, mask, per_split=per, launch=launch)
    Kf = torch.cat([kc.decode(pk), rk], 2).repeat_interleave(R, 1)
    Vf = torch.cat([vc.decode(pv), rv], 2).repeat_interleave(R, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], Kf, Vf, attn_mask=None if mask is None else (keep if mask_kind == "bool" else mask)[:, None, None, :])
    assert out.shape == q.shape and out.dtype == torch.float32
    if dot == "fp16" and not (isinstance(scheme, str) and scheme == "reference"):
        assert _error(out, ref[:, :, 0]) <= _bf16_error(q, Kf, Vf, mask_kind, keep, mask, ref[:, :, 0])
        return
    # one TF32 pass rounds the query side to 10 bits on a GPU (the interpreter computes it in FP32)
    tol = 2e-3 if dot == "tf32" and DEVICE == "cuda" else 3e-5
    assert float((out - ref[:, :, 0]).abs().max()) < tol * max(1.0, float(ref.abs().max()))


def _error(out, ref) -> float:
    """Relative error (Frobenius) of ``out`` vs ``ref``, in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _bf16_error(q, Kf, Vf, mask_kind, keep, mask, ref) -> float:
    """The accuracy bar of the fast mode: SDPA's own relative error in BF16 (the query, the decoded keys and values
    and its output in BF16, as a BF16 model runs it) vs ``ref``, the same attention in FP32."""
    m = None if mask is None else (keep if mask_kind == "bool" else mask.bfloat16())[:, None, None, :]
    low = torch.nn.functional.scaled_dot_product_attention(q.bfloat16()[:, :, None], Kf.bfloat16(), Vf.bfloat16(),
                                                           attn_mask=m)
    return _error(low[:, :, 0].float(), ref)


@pytest.mark.parametrize("dot", ["int8x3", "tf32x2", "fp16"])
def test_spans_of_one_layout_share_a_launch_and_equal_sdpa(dot, monkeypatch):
    """A store's spans (segments) one after the other: the first two have one layout and run in one launch (splits
    past the first span's read the second: its tokens, buffers, mask columns), the third has another (16-token
    key blocks) and runs in its own; with the sinks, the residual and a padding mask the step equals SDPA over the
    decoded tokens within FP32 rounding. Every launch the step makes is counted."""
    from kvcx.codecs import gpu, gpu_attn
    from kvcx.codecs.triton_kernels import attention as _triton_attn

    launches = []
    real = _triton_attn.attend_packed_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(_triton_attn, "attend_packed_kernel", Counted())
    g = torch.Generator().manual_seed(11)
    B, Hkv, R, D, nr = 2, 2, 4, 64, 3
    cfg = KVConfig.from_scheme("kvcx")
    kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    kn, vn = (get_codec({**c.get_config(), "sinks": 0}).with_backend("triton") for c in (kc, vc))
    k16 = get_codec({**kn.get_config(), "group_size": 16}).with_backend("triton")
    sizes, codecs = (101, 130, 48), ((kc, vc), (kn, vn), (k16, vn))
    K, V = (torch.randn(B, Hkv, sum(sizes), D, generator=g).to(DEVICE) for _ in "kv")
    rk, rv = (torch.randn(B, Hkv, nr, D, generator=g).to(DEVICE) for _ in "kv")
    q = torch.randn(B, Hkv * R, D, generator=g).to(DEVICE)
    N, t0, start = B * Hkv, kc.sinks, 0
    spans, Kd, Vd = [], [], []
    for size, (a, b) in zip(sizes, codecs):
        pk = a.encode(K[:, :, start:start + size].contiguous())
        pv = b.encode(V[:, :, start:start + size].contiguous())
        Kd.append(a.decode(pk))
        Vd.append(b.decode(pv))
        lead = t0 if start == 0 else 0
        an, bn = (get_codec({**c.get_config(), "sinks": 0}).with_backend("triton") for c in (a, b))
        spans.append(gpu_attn.Span(gpu_attn.span_of(pk, a), gpu_attn.span_of(pv, b), an, bn, start + lead))
        if start == 0:
            sinks = (pk.sinks.reshape(N, t0, D), pv.sinks.reshape(N, t0, D))
        start += size
    keep = torch.ones(B, start + nr, dtype=torch.bool, device=DEVICE)
    keep[1, :20] = False
    keep[0, 150:160] = False               # inside the second span
    add = gpu.float_mask(keep, B, start + nr)
    residual = (rk.reshape(N, nr, D), rv.reshape(N, nr, D))
    out = gpu_attn.attend_spans(gpu.query_rows(q, N), D ** -0.5, spans, Hkv, sinks, residual, add, start,
                                per_split=64, launch=gpu_attn.LaunchSettings(dot=dot)).reshape(B, Hkv * R, D)
    assert [grid[1] for grid in launches] == [2 + 3, 1]     # splits of 64 tokens: (100 + 130) in one, 48 in one
    Kf = torch.cat(Kd + [rk], 2).repeat_interleave(R, 1)
    Vf = torch.cat(Vd + [rv], 2).repeat_interleave(R, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], Kf, Vf, attn_mask=keep[:, None, None, :])
    if dot == "fp16":
        assert _error(out, ref[:, :, 0]) <= _bf16_error(q, Kf, Vf, "bool", keep, keep, ref[:, :, 0])
    else:
        assert float((out - ref[:, :, 0]).abs().max()) < 3e-5 * max(1.0, float(ref.abs().max()))


def _default_step(seed: int, B: int, S: int, nr: int):
    """A decode step's inputs in the default scheme on the Triton backend: (query [B, 8, 64], packed keys and
    values of S tokens and 2 KV heads, their codecs, nr residual keys and values)."""
    g = torch.Generator().manual_seed(seed)
    cfg = KVConfig.from_scheme("kvcx")
    kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    K, V = (torch.randn(B, 2, S, 64, generator=g).to(DEVICE) for _ in range(2))
    rk, rv = (torch.randn(B, 2, nr, 64, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(B, 8, 64, generator=g).to(DEVICE)
    return q, kc.encode(K), vc.encode(V), kc, vc, rk, rv


def test_a_register_cap_changes_no_bit_of_the_attention():
    """LaunchSettings.max_registers (a --tune setting: ptxas's register cap, Triton's maxnreg) changes where values
    live, not what is computed: the same bits with and without it (on a GPU a second compiled kernel; the
    interpreter takes the launch option and runs the same code)."""
    from kvcx.codecs.gpu_attn import LaunchSettings, attend

    exact = LaunchSettings(dot="int8x3")
    q, pk, pv, kc, vc, rk, rv = _default_step(7, B=1, S=150, nr=3)
    free = attend(q, pk, pv, kc, vc, rk, rv, per_split=64, launch=exact)
    capped = attend(q, pk, pv, kc, vc, rk, rv, per_split=64, launch=exact.replace(max_registers=128))
    assert torch.equal(free, capped) and bool(torch.isfinite(free).all())
    for bad in (0, 300, 12.5, "128"):   # a cap ptxas would not take fails in kvcx, by the setting's name
        with pytest.raises(CodecError, match=r"max_registers=.*24 to 255"):
            exact.replace(max_registers=bad)


def test_the_merge_launched_early_changes_no_bit_of_the_attention():
    """LaunchSettings.merge_pdl (the default on sm_90: the merge as a programmatic dependent launch, its query and exact
    tokens read while the attention kernel runs, the splits after it) changes when the merge starts, not what it
    computes: the same bits with and without it, over a store of several splits, the sinks and a residual (on a GPU
    two other compiled kernels and a launch attribute; Triton's interpreter runs no PTX, nor does a GPU before
    sm_90: there it is off, and says so).
    """
    from kvcx.codecs import gpu_attn
    from kvcx.codecs.gpu_attn import attend

    q, pk, pv, kc, vc, rk, rv = _default_step(11, B=2, S=300, nr=5)
    plain = attend(q, pk, pv, kc, vc, rk, rv, per_split=64, launch=gpu_attn.LaunchSettings(merge_pdl=False))
    assert gpu_attn.DEFAULT_LAUNCH.merge_pdl     # the default
    assert gpu_attn.dependent_merge(q) == (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9)
    assert not gpu_attn.dependent_merge(q, gpu_attn.LaunchSettings(merge_pdl=False))
    early = attend(q, pk, pv, kc, vc, rk, rv, per_split=64)
    assert torch.equal(plain, early) and bool(torch.isfinite(plain).all())


@pytest.mark.parametrize("S,per", [(300, 128), (300, 64), (100, 64), (40, 64)])
def test_the_scales_loaded_a_tile_ahead_change_no_bit_of_the_attention(S, per):
    """LaunchSettings.prefetch in the fast mode transposed (a --tune setting): each tile's scales and offsets are loaded
    with the tile before it, so that their loads are in flight while that tile is worked (Triton pipelines the
    codes' loads, not these); the same arithmetic on the same values: the same bits, over splits of several whole
    tiles and a partial last one, of one whole tile, and of a partial tile alone (the loop runs no tile)."""
    from kvcx.codecs import gpu_attn
    from kvcx.codecs.gpu_attn import attend

    fast = gpu_attn.LaunchSettings(dot="fp16")
    q, pk, pv, kc, vc, rk, rv = _default_step(S + per, B=2, S=S, nr=3)
    cfg = KVConfig.from_scheme("kvcx")
    D, R = q.shape[-1], q.shape[1] // 2
    assert gpu_attn.attention_constexprs(cfg.key, cfg.value, R, D, False, fast.replace(prefetch=True))["AHEAD"]
    plain = attend(q, pk, pv, kc, vc, rk, rv, per_split=per, launch=fast)
    ahead = attend(q, pk, pv, kc, vc, rk, rv, per_split=per, launch=fast.replace(prefetch=True))
    assert torch.equal(plain, ahead) and bool(torch.isfinite(plain).all())


def test_the_merge_reads_the_splits_in_chunks_of_any_size_to_the_same_softmax():
    """LaunchSettings.merge_splits / merge_warps (launch settings bench_gpu's --tune times): the merge reads a query row's
    splits a chunk at a time with a running maximum, after the exact tokens' softmax; chunks of 2 (three of them over 5
    splits: the running maximum across chunks), of 256 (all at once) and 8 warps give the default's output within
    FP32's rounding (only the order of the sums differs), with the scheme's sink and a residual, and with the sink
    alone."""
    from kvcx.codecs import gpu_attn
    from kvcx.codecs.gpu_attn import attend

    for nr in (5, 0):
        q, pk, pv, kc, vc, rk, rv = _default_step(12 + nr, B=2, S=300, nr=nr)
        rk, rv = (rk, rv) if nr else (None, None)
        base = attend(q, pk, pv, kc, vc, rk, rv, per_split=64)
        for warps, chunk in ((4, 2), (8, 256), (1, 16)):
            launch = gpu_attn.LaunchSettings(merge_warps=warps, merge_splits=chunk)
            other = attend(q, pk, pv, kc, vc, rk, rv, per_split=64, launch=launch)
            assert torch.allclose(other, base, rtol=1e-5, atol=1e-6 * float(base.abs().max())), (warps, chunk, nr)
    for bad in (48, 1, 2.0):   # not a power of two from 2: refused by the setting's name
        with pytest.raises(CodecError, match=r"merge_splits=.*power of two"):
            gpu_attn.LaunchSettings(merge_splits=bad)


@pytest.mark.parametrize("D,block,kg,dot", [(128, 64, 64, "int8x3"), (64, 32, 64, "int8x3"), (32, 32, 64, "tf32x2"),
                                           (256, 64, 64, "tf32x2"), (128, 64, 16, "tf32x2"), (128, 16, 64, "tf32x2"),
                                           (16, 32, 64, "")])
def test_int8_products_fall_back_where_they_would_not_be_exact(D, block, kg, dot):
    """The int8 products sum 32 or more (head dim 64 to 128: 32 to 64 channels a stream; tiles of 32 to 128
    tokens, cut to the key blocks); elsewhere the kernel gets two TF32 passes, not a product that the GPU compiler
    refuses (K under 32) or int32 sums that could wrap; under head dim 32 (8 channels a stream), FP32 sums."""
    from kvcx.codecs import gpu_attn

    kc = IntCodec(scheme="asymmetric", axis="channel", group_size=kg)
    vc = IntCodec(scheme="symmetric", axis="token", group_size=64, rotate=True)
    launch = gpu_attn.LaunchSettings(dot="int8x3", block_tokens=block)
    assert gpu_attn.attention_constexprs(kc, vc, 4, D, False, launch)["DOT"] == dot


@triton.jit
def _convert_codes(b_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
    """1,024 packed bytes [16, 64] through the attention kernel's FP16 code conversion."""
    i = tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :]
    lo, hi = _codes16(tl.load(b_ptr + i), ASM)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


@pytest.mark.parametrize("key_axis,D,dot", [("channel", 128, "fp16"), ("channel", 32, "fp16"), ("token", 128, "tf32x2"),
                                            ("channel", 16, "")])
def test_fp16_products_where_the_keys_scales_fold_into_the_query(key_axis, D, dot):
    """The fast mode folds per-channel key scales into the query (one FP16 rounding a product); per-token keys
    (a scale a group of channels) take two TF32 passes, and head dims under 32 FP32 sums, rather than a product
    the mode would round more. Its PTX conversion is asked for only in the fast mode."""
    from kvcx.codecs import gpu_attn

    kc = IntCodec(scheme="asymmetric", axis=key_axis)
    vc = IntCodec(scheme="symmetric", group_size=64, rotate=True)
    const = gpu_attn.attention_constexprs(kc, vc, 4, D, False, gpu_attn.LaunchSettings(dot="fp16"), asm=True)
    assert const["DOT"] == dot and const["ASM"] == (dot == "fp16")
    assert not gpu_attn.attention_constexprs(kc, vc, 4, D, False, gpu_attn.LaunchSettings(dot="int8x3"),
                                             asm=True)["ASM"]


def test_fp16_codes_are_exact_and_the_ptx_gives_the_samebits_of():
    """Every byte's two nibbles become their centred codes (-8..7) exactly in FP16 by the magic-number conversion:
    the element-wise Triton form (what the interpreter runs) against NumPy, and on a GPU the PTX form (a byte
    permute, lop3 and FP16x2 arithmetic on four bytes at a time) against the element-wise one, bit for bit."""
    b = torch.arange(1024, dtype=torch.int64).remainder(256).to(torch.uint8)
    b = b[torch.randperm(1024, generator=torch.Generator().manual_seed(0))].to(DEVICE)

    def run(asm):
        lo, hi = (torch.empty(1024, dtype=torch.float16, device=DEVICE) for _ in "lh")
        _convert_codes[(1,)](b, lo, hi, ASM=asm)
        return lo, hi

    lo, hi = run(False)
    codes = b.cpu().numpy().astype(np.int64)
    assert np.array_equal(lo.cpu().numpy(), ((codes & 15) - 8).astype(np.float16))
    assert np.array_equal(hi.cpu().numpy(), ((codes >> 4) - 8).astype(np.float16))
    assert not bool(torch.signbit(lo[b.cpu() % 16 == 8].cpu()).any())      # code 8: +0, as the integer 0
    if DEVICE == "cuda":   # the interpreter runs no inline assembly
        lo2, hi2 = run(True)
        assert torch.equal(lo.view(torch.int16), lo2.view(torch.int16))
        assert torch.equal(hi.view(torch.int16), hi2.view(torch.int16))


@pytest.mark.parametrize("k_mag,v_mag,q_std", [(1e-3, 1e-4, 300.0), (100.0, 1.0, 2e4), (1.0, 1e-5, 3.0)],
                         ids=["small", "saturated", "tiny-values"])
def test_the_fast_mode_keeps_its_bar_at_any_magnitude(k_mag, v_mag, q_std):
    """FP16 holds 2**-24 to 65,504: the fast mode rounds the query times the key scales and the weights p times the
    value scales to FP16 after powers of two of their own, so that keys, values and queries of any magnitude a
    BF16 model holds neither overflow (a query times a key scale past 65,504: "saturated") nor lose their bits as
    subnormals (weights p s under 2**-14: "tiny-values"): finite, and within SDPA-BF16's own error."""
    from kvcx.codecs import gpu_attn
    from kvcx.codecs.gpu_attn import attend

    g = torch.Generator().manual_seed(17)
    cfg = KVConfig.from_scheme("kvcx")
    kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    B, Hkv, R, S, D = 1, 2, 4, 260, 128
    K = (torch.randn(B, Hkv, S, D, generator=g) + torch.randn(D, generator=g)) * k_mag
    V = torch.randn(B, Hkv, S, D, generator=g) * v_mag
    q = torch.randn(B, Hkv * R, D, generator=g) * q_std
    K, V, q = (t.to(DEVICE) for t in (K, V, q))
    pk, pv = kc.encode(K), vc.encode(V)
    out = attend(q, pk, pv, kc, vc, per_split=64, launch=gpu_attn.LaunchSettings(dot="fp16"))
    Kf, Vf = (c.decode(p).repeat_interleave(R, 1) for c, p in ((kc, pk), (vc, pv)))
    ref = torch.softmax((q.double()[:, :, None] @ Kf.double().transpose(-1, -2)) * D ** -0.5, -1) @ Vf.double()
    assert bool(torch.isfinite(out).all())
    assert _error(out, ref[:, :, 0]) <= _bf16_error(q, Kf, Vf, None, None, None, ref[:, :, 0])


def test_an_unknown_product_mode_is_refused_by_name():
    """LaunchSettings.dot (bench_gpu.py's --tune tries several): a mode the kernel does not have fails in kvcx when
    the settings are made, with the modes it has, not inside Triton's compiler."""
    from kvcx.codecs import gpu_attn

    with pytest.raises(CodecError, match=r"LaunchSettings\(dot='int4'\).*'tf32x2'"):
        gpu_attn.LaunchSettings(dot="int4")


def test_fused_attention_refuses_what_it_cannot_read():
    from kvcx.codecs.gpu_attn import attend

    kc = IntCodec(scheme="asymmetric", axis="channel", backend="triton")
    pk = kc.encode(torch.randn(1, 2, 64, 64, device=DEVICE))
    with pytest.raises(CodecError, match="does not fit"):
        attend(torch.randn(1, 3, 64, device=DEVICE), pk, pk, kc, kc)
    cpu = IntCodec(scheme="asymmetric", axis="channel").encode(np.zeros((1, 2, 64, 64), np.float32))
    with pytest.raises(CodecError, match="on the device"):
        attend(torch.randn(1, 2, 64, device=DEVICE), cpu, pk, kc, kc)
    with pytest.raises(CodecError, match="mask must be"):
        attend(torch.randn(1, 2, 64, device=DEVICE), pk, pk, kc, kc, mask=torch.zeros(1, 5, device=DEVICE))


@triton.jit
def _row_and_column_maxima(x_ptr, rows_ptr, cols_ptr):
    """The attention kernel's _absmax of a block [16, 32], along each row and each column."""
    x = tl.load(x_ptr + tl.arange(0, 16)[:, None] * 32 + tl.arange(0, 32)[None, :])
    tl.store(rows_ptr + tl.arange(0, 16), _absmax(x))
    tl.store(cols_ptr + tl.arange(0, 32), _absmax(x, 0))


def test_the_kernels_largest_magnitudes_keep_nan():
    """_absmax, what the int8x3 products and the fast mode's query rows scale by: torch's largest |x| of each row
    and column, NaN where one holds a NaN of either sign (tl.max of floats skips NaN, on a GPU and in Triton's
    interpreter alike), +inf where one holds an infinity of either sign and no NaN; -0.0 and subnormals as any
    other value."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)) * 1e3
    x[1, 4], x[2, 9], x[3, 0] = float("nan"), -float("nan"), -float("inf")
    x[4, 31], x[5] = float("inf"), -0.0
    x[6, :3] = torch.tensor([1e-40, -3e-39, 0.0])
    x[6, 3:] = 0.0
    rows, cols = torch.empty(16, device=DEVICE), torch.empty(32, device=DEVICE)
    _row_and_column_maxima[(1,)](x.to(DEVICE), rows, cols)
    for got, axis in ((rows, 1), (cols, 0)):   # torch's amax keeps NaN
        torch.testing.assert_close(got.cpu(), x.abs().amax(axis), rtol=0, atol=0, equal_nan=True)
    assert rows[6].item() == -x[6, 1].item() > 0 and rows[5].item() == 0.0 and rows[3].item() == float("inf")


@pytest.mark.parametrize("dot", ["", "tf32x2", "int8x3", "fp16"])
def test_fused_attention_passes_a_nan_in_the_query_on(dot):
    """A NaN in a query row gives NaN in that row's output in every product mode; the other rows are unaffected.
    (tl.max of floats skips NaN, on a GPU and in Triton's interpreter alike: the integer products' row maximum
    must not, or they would round the NaN's bits to a finite, wrong result; it is taken on the bits, _absmax.)"""
    from kvcx.codecs import gpu_attn
    from kvcx.codecs.gpu_attn import attend

    cfg = KVConfig.from_scheme()
    kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    g = torch.Generator().manual_seed(5)
    K, V = (torch.randn(1, 2, 96, 64, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(1, 4, 64, generator=g).to(DEVICE)
    q[0, 1, 7] = float("nan")
    out = attend(q, kc.encode(K), vc.encode(V), kc, vc, per_split=32, launch=gpu_attn.LaunchSettings(dot=dot))
    assert bool(torch.isnan(out[0, 1]).all())
    assert not bool(torch.isnan(out[0, [0, 2, 3]]).any())


def test_fused_attention_with_no_packed_token_yet():
    """A record of only its exact sink token and a residual (a cache's first steps): the merge kernel alone."""
    from kvcx.codecs.gpu_attn import attend

    cfg = KVConfig.from_scheme()
    kc, vc = cfg.key.with_backend("triton"), cfg.value.with_backend("triton")
    g = torch.Generator().manual_seed(3)
    K, V, rk, rv = (torch.randn(1, 2, n, 64, generator=g).to(DEVICE) for n in (1, 1, 3, 3))
    q = torch.randn(1, 4, 64, generator=g).to(DEVICE)
    Kf, Vf = (torch.cat(p, 2).repeat_interleave(2, 1) for p in ((K, rk), (V, rv)))
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], Kf, Vf)[:, :, 0]
    pk, pv = kc.encode(K), vc.encode(V)
    for _ in range(20):   # memory the allocator hands back full of NaN: the empty split must not read it
        junk = [torch.full(shape, float("nan"), device=DEVICE) for shape in ((2, 1, 2), (2, 1, 2, 64))]
        del junk
        out = attend(q, pk, pv, kc, vc, rk, rv)
        assert float((out - ref).abs().max()) < 3e-5
