"""config/paper-rehearsal.yaml stays the paper's study with stand-in models: the same config
apart from the models (and results_dir), and the same job graph (`snakemake -n`, jobs per
rule), and its stand-ins load as the architectures they stand in for."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from kvdiverge.config.workflow import load_config

REPO = Path(__file__).resolve().parents[1]
PAPER, REHEARSAL = "config/paper.yaml", "config/paper-rehearsal.yaml"


def without_models(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("models", "results_dir")}


def test_the_rehearsal_is_the_paper_but_for_its_models():
    paper, rehearsal = load_config(REPO / PAPER), load_config(REPO / REHEARSAL)
    assert without_models(rehearsal) == without_models(paper)
    assert list(rehearsal["models"]) == list(paper["models"])  # same names: same seeds, same paths
    for name, entry in rehearsal["models"].items():
        assert entry["source"] == "miniature" and entry["architecture"] == name
        assert entry["dtype"] == paper["models"][name]["dtype"] and entry["device"] == "cpu"
    assert rehearsal["results_dir"] != paper["results_dir"]


def job_counts(configfile: str, workdir: Path) -> Counter:
    """Jobs per rule of `snakemake -n` on `configfile` in an empty `workdir`."""
    from conftest import snakemake_here  # in this process: no interpreter start

    workdir.mkdir(parents=True)
    args = ["-n", "--snakefile", str(REPO / "Snakefile"), "--configfile", str(REPO / configfile)]
    proc = snakemake_here(workdir, *args, "--directory", str(workdir))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return Counter(m.group(1) for m in re.finditer(r"^(?:local)?rule (\w+):$", proc.stdout, re.M))


@pytest.mark.workflow
def test_the_rehearsal_has_the_papers_job_graph(tmp_path):
    paper = job_counts(PAPER, tmp_path / "paper")
    rehearsal = job_counts(REHEARSAL, tmp_path / "rehearsal")
    assert rehearsal == paper
    # 2 models x 7 runs (3 exploratory policies, snapkv-90, the floor on both splits, the
    # control) x 24 shards, made by one job per (model, split, shard); one estimate per run
    assert paper["trajectories_exploratory"] == paper["trajectories_confirmatory"] == 2 * 24
    assert paper["estimate"] == 2 * 7 and paper["prompts"] == 2


@pytest.mark.miniature
@pytest.mark.parametrize(
    "arch, kv_heads, heads, bias",
    [("llama-3.1-8b", 2, 8, False), ("qwen-2.5-7b", 1, 7, True)],
)
def test_a_miniature_entry_loads_its_architecture_with_the_real_vocabulary(arch, kv_heads, heads, bias):
    from kvdiverge.models.loading import entry_kv_sizes, load_model, load_model_config
    from kvdiverge.models.standins import PAPER as REAL

    spec = {"source": "miniature", "architecture": arch, "dtype": "float32", "device": "cpu"}
    config = load_model_config(spec, arch)
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv_heads)
    assert config.vocab_size == REAL[arch]["vocab_size"]
    model, tokenizer = load_model(spec, arch)
    assert model.get_output_embeddings().weight.shape[0] == REAL[arch]["vocab_size"]
    assert model.generation_config.eos_token_id == REAL[arch]["eos_token_id"]
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == bias
    assert max(tokenizer.get_vocab().values()) < config.vocab_size  # every prompt id is in range
    head_dim = config.hidden_size // heads
    # K and V, per layer, per KV head: 2 layers x kv_heads x head_dim x 2
    assert entry_kv_sizes(spec, arch) == {"elements_per_token": 2 * 2 * kv_heads * head_dim, "element_bytes": 4}


def test_a_miniature_entry_names_an_unknown_architecture_and_a_vocabulary_past_the_real_one():
    from kvdiverge.models.loading import load_model_config, miniature_values

    with pytest.raises(ValueError, match=r"models.m.architecture: 'gpt-2' is not one of the miniature"):
        load_model_config({"source": "miniature", "architecture": "gpt-2"}, "m")
    assert miniature_values({"architecture": "qwen-2.5-7b", "vocab_size": 152064})["vocab_size"] == 152064
    with pytest.raises(ValueError, match=r"^models.q.vocab_size: 152065 ids exceed .* allowed: at most 152064 "):
        load_model_config({"source": "miniature", "architecture": "qwen-2.5-7b", "vocab_size": 152065}, "q")


@pytest.mark.miniature
@pytest.mark.parametrize("arch, eos", [("llama-3.1-8b", [4093, 4094, 4095]), ("qwen-2.5-7b", [4094, 4095])])
def test_a_small_vocabulary_stand_in_keeps_its_eos_count_and_reads_every_prompt(arch, eos):
    from kvdiverge.models.loading import load_model

    spec = {"source": "miniature", "architecture": arch, "vocab_size": 4096, "dtype": "float32", "device": "cpu"}
    model, tokenizer = load_model(spec, arch)
    assert model.config.vocab_size == 4096 and model.get_output_embeddings().weight.shape[0] == 4096
    assert model.generation_config.eos_token_id == eos
    assert max(tokenizer.get_vocab().values()) == 4095  # every id it gives is in range
    text = "Mr. Speaker, the state of the Union is strong: 1,234 appropriations in fiscal 1923."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < 4096 and tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert chat["input_ids"][0] == 1  # SmolLM2's <|im_start|>: the chat template and its special tokens kept


def test_a_tokenizer_cut_at_its_own_size_is_the_same_tokenizer_and_a_smaller_one_never_breaks_text():
    from kvdiverge.models.embedded import EMBEDDED_MODEL, EMBEDDED_NAME
    from kvdiverge.models.loading import load_tokenizer
    from kvdiverge.models.standins import truncated_tokenizer

    full = load_tokenizer(EMBEDDED_MODEL, EMBEDDED_NAME)
    text = (REPO / "README.md").read_text()[:4000]
    ids = full.encode(text, add_special_tokens=False)
    assert truncated_tokenizer(full, 49152).encode(text, add_special_tokens=False) == ids
    small = truncated_tokenizer(full, 1024)
    cut = small.encode(text, add_special_tokens=False)
    assert max(cut) < 1024 and small.decode(cut) == text and len(cut) > len(ids)
    with pytest.raises(ValueError, match="vocab_size 512: a stand-in's vocabulary needs at least 1024 ids"):
        from kvdiverge.models.standins import MINIATURE, small_vocabulary

        small_vocabulary(MINIATURE["llama-3.1-8b"], 512)


@pytest.mark.miniature
def test_the_small_vocabulary_stand_in_is_peaked_and_the_default_one_flat():
    """The nucleus of the stand-in's distributions is as small as a trained model's, not the whole vocabulary."""
    import torch

    from kvdiverge.models.loading import miniature_values
    from kvdiverge.models.standins import random_model

    values = miniature_values({"architecture": "llama-3.1-8b", "vocab_size": 4096})
    ids = torch.randint(17, 4000, (2, 300), generator=torch.Generator().manual_seed(0))
    medians = []
    for overrides in ({}, {"initializer_range": 0.02}):
        with torch.no_grad():
            p = random_model(values, **overrides)(ids).logits[:, -100:].float().softmax(-1)
        nucleus = (p.sort(-1, descending=True).values.cumsum(-1) < 0.95).sum(-1) + 1
        medians.append(float(nucleus.float().median()))
    assert medians[0] <= 32 and medians[1] >= 3000, medians
