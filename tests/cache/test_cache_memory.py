"""What a KvcxCache holds once a prompt is packed: nothing of the prompt in full precision, counted whole by
memory_report(), and the C heap's free pages handed back after a long prompt (release_heap)."""
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from kvcx.cache import KvcxCache  # noqa: E402
from kvcx.cache.buffers import HeapRelease  # noqa: E402
from kvcx.errors import KvcxError  # noqa: E402


def _config(kv_heads, layers=2, head_dim=64):
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads,
                       hidden_size=2 * kv_heads * head_dim, head_dim=head_dim)


def _storage_bytes(t):
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("prompt", [128, 130, 200])
def test_a_packed_prompt_leaves_no_full_precision_copy_behind(kv_heads, prompt):
    """The residual a prompt leaves holds only its own tokens: not the prompt's storage (a slice of it is
    contiguous when nothing is left or with one KV head), and memory_report() counts the storage."""
    cache = KvcxCache(_config(kv_heads), release_heap=False)
    ks = [torch.randn(1, kv_heads, prompt, 64) for _ in range(2)]
    for i, k in enumerate(ks):
        out_k, out_v = cache.update(k, k.clone(), i)
        assert out_k.shape == (1, kv_heads, prompt, 64) and torch.equal(out_k, k)   # attention saw the prompt
    left = prompt % 64
    rep = cache.memory_report()
    for layer in cache.layers:
        assert layer.keys.shape[-2] == left and layer.quantized_length == prompt - left
        for t in (layer.keys, layer.values):
            assert _storage_bytes(t) == t.numel() * 4, (_storage_bytes(t), t.shape)
    assert rep["residual_bytes"] == 2 * 2 * kv_heads * left * 64 * 4
    # the prompt's tokens still in full precision are its last ones, as they were
    assert torch.equal(cache.layers[1].keys, ks[1][:, :, prompt - left:])


def test_crop_keeps_no_storage_of_what_it_dropped():
    cache = KvcxCache(_config(1), release_heap=False)
    for i in range(2):
        k = torch.randn(1, 1, 3, 64)
        cache.update(k, k.clone(), i)
    cache.crop(-3)
    for layer in cache.layers:
        assert layer.keys.shape[-2] == 0 and _storage_bytes(layer.keys) == 0 and _storage_bytes(layer.values) == 0
    assert cache.memory_report()["residual_bytes"] == 0


@pytest.mark.parametrize("prompt, released", [(1024, 2), (1023, 0)])
def test_heap_released_after_a_long_prompt_is_packed(prompt, released):
    if not HeapRelease().active:
        pytest.skip("this C library has no malloc_trim (not glibc): nothing to release")
    on = KvcxCache(_config(2), release_heap=True, fused=False)
    off = KvcxCache(_config(2), release_heap=False)
    for cache in (on, off):
        for i in range(2):
            k = torch.randn(1, 2, prompt, 64)
            cache.update(k, k.clone(), i)
    assert on.memory_report()["heap_releases"] == released   # once a layer, for chunks of 1,024 tokens or more
    assert off.memory_report()["heap_releases"] == 0
    for i in range(2):   # decode steps never release
        k = torch.randn(1, 2, 1, 64)
        on.update(k, k.clone(), i)
    assert on.memory_report()["heap_releases"] == released


def test_release_heap_must_be_a_bool():
    with pytest.raises(KvcxError, match="release_heap must be True or False, got 'yes'"):
        KvcxCache(_config(2), release_heap="yes")


def test_heap_release_hands_free_heap_pages_back():
    """In a fresh process: once glibc's mmap threshold has risen, freed 1 MiB arrays stay resident behind a
    small live allocation after each; HeapRelease gives their pages back."""
    if not HeapRelease().active:
        pytest.skip("this C library has no malloc_trim (not glibc): nothing to release")
    code = textwrap.dedent("""
        import numpy as np
        from kvcx.cache.buffers import HeapRelease

        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024

        big = np.ones(24 << 20, np.uint8)   # freed: glibc's mmap threshold rises to its size
        del big
        held, keep = [], []
        for _ in range(300):
            a = np.ones(1 << 20, np.uint8)   # from the heap now, touched
            held.append(a)
            keep.append(np.ones(16, np.uint8))   # small and long-lived: pins the heap above each
        del held
        before = rss()
        rel = HeapRelease(min_tokens=1)
        rel.after_pack(0)
        assert rel.count == 0                  # a chunk under min_tokens: nothing done
        rel.after_pack(1)
        print(before - rss(), rel.count)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    released, count = int(out[0]), int(out[1])
    assert count == 1
    assert released > 200 << 20, released   # most of the 300 MiB freed
