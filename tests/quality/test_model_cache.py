"""A GGUF model's conversion kept on disk: read back as the same model bit for bit, used only when verified."""
import json
import os

import pytest

from kvcx.quality import model_cache

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_where_the_cache_lives_and_turning_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "c"))
    assert model_cache.cache_root() == tmp_path / "c"
    for off in ("off", "0", "false"):
        monkeypatch.setenv(model_cache.CACHE_ENV, off)
        assert model_cache.cache_root() is None and model_cache.entry_for(__file__) is None
    monkeypatch.delenv(model_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_root() == tmp_path / "xdg" / "kvcx" / "models"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    a = model_cache.entry_for(str(gguf))
    gguf.write_bytes(b"GGUF two")                    # other contents, another entry (never a stale model)
    assert model_cache.entry_for(str(gguf)) != a and a.name.startswith("m-")


@pytest.mark.model
def test_the_cached_conversion_is_the_gguf_model_bit_for_bit(wikitext_path, tmp_path, monkeypatch):
    from kvcx.quality.models import embedded_model_path, load_model_and_tokenizer

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    entry = model_cache.entry_for(embedded_model_path())
    m1, tok1, name1 = load_model_and_tokenizer(cpu=True)         # from the GGUF; the conversion written
    assert m1.config._name_or_path != str(entry) and model_cache.verified(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]      # no temporary directory left
    umask = os.umask(0)
    os.umask(umask)
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~umask for p in entry.iterdir())
    m2, tok2, name2 = load_model_and_tokenizer(cpu=True)         # from the cache
    assert m2.config._name_or_path == str(entry) and name2 == name1
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr()   # still tied
    text = wikitext_path.read_text(encoding="utf-8")[:20000]
    ids1, ids2 = tok1(text).input_ids, tok2(text).input_ids
    assert ids1 == ids2 and tok1.eos_token == tok2.eos_token and tok1.chat_template == tok2.chat_template
    with torch.no_grad():
        x = torch.tensor([ids1[:200]])
        assert torch.equal(m1(x).logits, m2(x).logits)
    # a damaged copy is not a model: one byte of the weights changed, or a file missing, fails verification
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    assert not model_cache.verified(entry)
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    assert model_cache.verified(entry)
    (entry / "tokenizer.json").unlink()
    assert not model_cache.verified(entry)
    # and save() replaces it (as a load that found it damaged does) by one rename
    assert model_cache.save(m2, tok2, entry) and model_cache.verified(entry)
    assert json.loads((entry / model_cache.MANIFEST).read_text())["files"].keys() >= {"model.safetensors",
                                                                                    "config.json", "tokenizer.json"}


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    """Where the cache cannot be written (here: its directory is a file) the save says so and leaves nothing."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert model_cache.save(None, None, blocker / "entry") is False     # fails before it reads the model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_damaged_gguf_is_a_model_error_and_nothing_is_cached(tmp_path, monkeypatch):
    from kvcx.errors import ModelError
    from kvcx.quality.models import load_model_and_tokenizer

    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelError, match="cannot load model"):
        load_model_and_tokenizer(str(bad), cpu=True)
    assert not (tmp_path / "cache").exists()


def test_an_engine_checkpoint_another_process_wrote_first_is_kept(loaded, tmp_path):
    """Two processes converting the same GGUF at once (two test workers, two ranks, a bench beside a server): the one
    that finishes second keeps the first one's verified checkpoint, which a server may be reading, instead of
    deleting it for its own copy; a damaged one is still written again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcx.quality import engine_model

    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=len(loaded[1]), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=True))
    entry = tmp_path / "tiny-engine-bf16"
    engine_model._write(tiny, loaded[1], entry)                  # the first process
    assert model_cache.verified(entry)
    first = {p.name: p.stat().st_ino for p in entry.iterdir()}
    engine_model._write(tiny, loaded[1], entry)                  # the second, finishing later
    assert {p.name: p.stat().st_ino for p in entry.iterdir()} == first     # the same files, never removed
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]       # its own copy cleaned up
    (entry / "config.json").write_text("{}")                     # damaged: written again
    engine_model._write(tiny, loaded[1], entry)
    assert model_cache.verified(entry) and json.loads((entry / "config.json").read_text())["architectures"]
