"""Token eviction presses: what each keeps, SnapKV's scores against a torch rendering of kvpress's formula, the
scheme strings that compose a press with a codec, and the errors for bad ones."""
import numpy as np
import pytest

from kvcx.api import validation_settings
from kvcx.codecs.kvconfig import KVConfig
from kvcx.presses import PRESSES, Press, PressedSetting, index_bytes, parse_press, split_scheme
from kvcx.errors import KvcxError


def keys(heads=2, tokens=50, dim=8, seed=0):
    return np.random.default_rng(seed).standard_normal((heads, tokens, dim)).astype(np.float32)


def test_streaming_keeps_sinks_and_the_most_recent():
    idx = Press("streaming", 0.3).select(keys())
    assert idx.shape == (2, 15)
    assert (idx == np.r_[0:4, 39:50]).all()
    assert (Press("streaming", 1.0).select(keys()) == np.arange(50)).all()


def test_knorm_keeps_the_smallest_keys_per_head():
    k = keys()
    idx = Press("knorm", 0.2).select(k)
    norms = np.linalg.norm(k, axis=-1)
    for h in range(2):
        assert list(idx[h]) == sorted(np.argsort(norms[h])[:10])
    assert (np.diff(idx, axis=1) > 0).all()      # ascending: the kept tokens stay in order


def test_snapkv_matches_kvpress_formula_in_torch():
    torch = pytest.importorskip("torch")
    k = keys(heads=2, tokens=200, dim=16, seed=1)
    q = np.random.default_rng(2).standard_normal((6, 64, 16)).astype(np.float32)   # 3 query heads a KV head
    press = Press("snapkv", 0.5)
    idx = press.select(k, q)
    # kvpress's SnapKVPress.compute_window_attention + score: softmax over the window's queries (causal in it),
    # mean over the window and the group's heads, avg_pool1d(5, padding 2), window always kept
    K = torch.from_numpy(k).repeat_interleave(3, dim=0)
    attn = torch.from_numpy(q) @ K.transpose(1, 2) / 4.0
    mask = torch.ones(64, 200, dtype=torch.bool).tril(200 - 64)
    attn = attn.masked_fill(~mask, float("-inf")).softmax(-1)[..., :-64]
    scores = attn.mean(1).view(2, 3, -1).mean(1)
    scores = torch.nn.functional.avg_pool1d(scores, 5, padding=2, stride=1)
    scores = torch.cat([scores, torch.full((2, 64), scores.max().item() + 1)], dim=1)
    want = scores.topk(100, dim=-1).indices.sort(-1).values.numpy()
    assert (idx == want).all()
    assert set(range(136, 200)) <= set(idx[0])      # the observation window is kept
    # fewer kept than the window: its most recent tokens
    assert (Press("snapkv", 0.1).select(k, q) == np.arange(180, 200)).all()


def test_kept_count_and_index_bytes():
    assert Press("knorm", 0.5).kept_count(7) == 4 and Press("knorm", 0.01).kept_count(10) == 1
    assert index_bytes(3, 100) == 600


def test_scheme_strings_compose_a_press_with_a_codec_in_any_order():
    assert split_scheme("kvcx+snapkv:0.5") == (Press("snapkv", 0.5), "kvcx")
    assert split_scheme("streaming:0.5+kvcx3") == (Press("streaming", 0.5), "kvcx3")
    assert split_scheme("snapkv:0.25") == (Press("snapkv", 0.25), None)
    assert split_scheme("q4_0-rot") == (None, "q4_0-rot")
    configs, gated = validation_settings("kvcx,kvcx+snapkv:0.5,knorm:0.25")
    assert isinstance(configs["kvcx"], KVConfig) and gated == list(configs)
    s = configs["kvcx+snapkv:0.5"]
    assert isinstance(s, PressedSetting) and s.press == Press("snapkv", 0.5) and s.codec.scheme == "kvcx"
    assert configs["knorm:0.25"].codec is None
    assert s.get_config()["press"] == "snapkv" and s.get_config()["keep"] == 0.5


@pytest.mark.parametrize("text,match", [
    ("snapkv", "needs a keep ratio"), ("snapkv:0", "must be in \\(0, 1\\]"), ("snapkv:1.5", "must be in"),
    ("snapkv:half", "is not a number"), ("kvcx+", "empty part"), ("kvcx+kvcx3", "two codecs"),
    ("snapkv:0.5+knorm:0.5", "two presses")])
def test_bad_scheme_strings(text, match):
    with pytest.raises(KvcxError, match=match):
        split_scheme(text)


def test_unknown_press_and_codec_named():
    with pytest.raises(KvcxError, match="press 'snap' does not exist; the presses are knorm, snapkv, streaming"):
        parse_press("snap:0.5")
    with pytest.raises(KvcxError, match="unknown scheme 'kvcx9'"):
        from kvcx.quality.peers import PEERS

        validation_settings("kvcx9+snapkv:0.5", peers=PEERS)
    assert sorted(PRESSES) == ["knorm", "snapkv", "streaming"]


def test_snapkv_without_queries_and_bad_shapes():
    with pytest.raises(KvcxError, match="scores tokens with the model's queries"):
        Press("snapkv", 0.5).select(keys())
    with pytest.raises(KvcxError, match="do not match keys"):
        Press("snapkv", 0.5).select(keys(dim=8), np.zeros((3, 4, 8), np.float32))
    with pytest.raises(KvcxError, match="must be \\[kv_heads, tokens, head_dim\\]"):
        Press("knorm", 0.5).select(np.zeros((4, 8), np.float32))


def test_where_presses_do_not_run_the_error_says_so():
    for scheme in ("kvcx+snapkv:0.5", "snapkv:0.5"):
        with pytest.raises(KvcxError, match="presses run in `kvcx validate`, `kvcx calibrate` and KvcxCache"):
            KVConfig.from_scheme(scheme)
