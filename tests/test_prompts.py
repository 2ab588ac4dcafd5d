"""Prompts stage: exclusion rules and the table, on a stand-in tokenizer; the stage through Snakemake
(the session's smoke run, and dry runs on a copy of it)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import yaml

from kvdiverge.config.workflow import load_config, validate
from kvdiverge.data.prompts import (
    SCHEMA,
    build_prompts,
    exclusion_reason,
    messages,
    policy_minimums,
    prompt_settings,
    split_policies,
    summary,
    usable,
)

ROOT = Path(__file__).resolve().parents[1]


class WordTokenizer:
    """Stand-in chat tokenizer: one token per word plus 3 template tokens."""

    def apply_chat_template(
        self, msgs, add_generation_prompt=True, return_dict=False, tokenize=True, **template_variables
    ):
        assert add_generation_prompt
        text = "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"
        if not tokenize:
            return text
        ids = [1] + [7] * len(" ".join(m["content"] for m in msgs).split()) + [2, 3]
        return {"input_ids": ids} if return_dict else ids


@pytest.fixture
def config():
    return load_config(ROOT / "config" / "config.yaml")


def test_policy_minimums_of_the_default_config(config):
    assert split_policies(config) == {
        "exploratory": ["snapkv-50", "snapkv-b512", "recent-50", "window-50", "none"],
        "confirmatory": ["snapkv-90"],
    }
    assert policy_minimums(config) == {
        "exploratory": {"snapkv-50": 65, "snapkv-b512": 577, "recent-50": 5, "window-50": 5, "none": 1},
        "confirmatory": {"snapkv-90": 65},
    }


def test_exclusion_reasons():
    mins = {"snapkv-50": 65, "snapkv-b512": 577, "recent-50": 5}
    assert exclusion_reason(577, mins, context=8192, max_new_tokens=32) is None
    assert exclusion_reason(576, mins, 8192, 32) == (
        "too short for policy snapkv-b512: prompt of 576 tokens, policy needs at least 577"
    )
    assert exclusion_reason(10, mins, 8192, 32) == (
        "too short for policy snapkv-b512: prompt of 10 tokens, policy needs at least 577 "
        "(also too short for snapkv-50)"
    )
    assert exclusion_reason(8161, mins, 8192, 32) == (
        "too long: prompt of 8161 tokens + 32 new tokens exceeds the model context of 8192 tokens"
    )
    assert exclusion_reason(8160, mins, 8192, 32) is None
    assert exclusion_reason(3, {}, 8192, 32) is None


def test_messages_put_the_instruction_after_the_document():
    assert messages("Doc.", "Summarize.") == [{"role": "user", "content": "Doc.\n\nSummarize."}]
    assert messages("Doc.", "Go.", "Sys.")[0] == {"role": "system", "content": "Sys."}


def test_build_prompts_applies_each_splits_policies(config):
    docs = pl.DataFrame(
        {
            "doc_id": ["a", "b", "c", "d"],
            "split": ["exploratory", "exploratory", "confirmatory", "confirmatory"],
            "text": [" ".join(["w"] * n) for n in (600, 100, 100, 20)],
        }
    )
    out = build_prompts(docs, WordTokenizer(), prompt_settings(config), context=8192)
    assert out.schema == pl.Schema(SCHEMA)
    n_instr = len(config["prompt"]["instruction"].split())
    assert out["n_prompt_tokens"].to_list() == [n + n_instr + 3 for n in (600, 100, 100, 20)]
    reasons = out["exclusion_reason"].to_list()
    assert reasons[0] is None
    assert reasons[1].startswith("too short for policy snapkv-b512")  # budget 512 + window 64 + 1
    assert reasons[2] is None  # snapkv-90 on the confirmatory split needs only 65
    assert reasons[3].startswith("too short for policy snapkv-90")
    assert usable(out)["doc_id"].to_list() == ["a", "c"]
    text = summary(out)
    assert "exploratory: 1/2 usable" in text and "confirmatory: 1/2 usable" in text


# --------------------------------------------------------------------------- the date templates see


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A real fast tokenizer (one token per byte) whose chat template reads the clock."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    # the Llama 3.2/3.3 pattern: date_string if given, else strftime_now, plus a direct call
    tok.chat_template = (
        "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
        "Today Date: {{ date_string }}; stamp {{ strftime_now('%Y-%m-%dT%H:%M') }}\n"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


@pytest.fixture
def clock(monkeypatch):
    """Set transformers' template clock (``datetime.now`` behind ``strftime_now``)."""
    import datetime as dt

    import transformers.utils.chat_template_utils as ctu

    def set_now(moment):
        class Frozen(dt.datetime):
            @classmethod
            def now(cls, tz=None):
                return moment

        monkeypatch.setattr(ctu, "datetime", Frozen)

    return set_now


def test_a_template_reading_the_clock_renders_the_same_ids_every_day(byte_tokenizer, clock):
    import datetime as dt

    from kvdiverge.data.prompts import render_ids, render_text

    msgs = messages("Doc.", "Summarize.")
    days = (dt.datetime(2025, 3, 14, 9, 30), dt.datetime(2031, 12, 2, 23, 59))
    plain, ours = [], []
    for day in days:
        clock(day)
        plain.append(byte_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
        ours.append(render_ids(byte_tokenizer, "Doc.", "Summarize.", date="2026-01-01"))
    assert plain[0] != plain[1] and "14 Mar 2025" in plain[0]  # the clock is really read (and mocked)
    assert ours[0] == ours[1]
    text = byte_tokenizer.decode(ours[0])
    assert text == render_text(byte_tokenizer, "Doc.", "Summarize.", date="2026-01-01")
    assert text.startswith("Today Date: 01 Jan 2026; stamp 2026-01-01T00:00\n<user>Doc.")
    assert render_ids(byte_tokenizer, "Doc.", "Summarize.", date="2026-07-04") != ours[0]
    # the default is a fixed date too
    assert render_ids(byte_tokenizer, "Doc.", "Summarize.") == ours[0]


def test_prompt_date_is_a_prompt_setting(config):
    from kvdiverge.data.prompts import DEFAULT_DATE

    assert config["prompt"]["date"] == DEFAULT_DATE == "2026-01-01"  # schema default
    assert prompt_settings(config)["date"] == "2026-01-01"
    config["prompt"]["date"] = "2027-02-03"
    assert prompt_settings(config)["date"] == "2027-02-03"


def test_build_prompts_uses_the_configured_date(byte_tokenizer, config, clock):
    import datetime as dt

    docs = pl.DataFrame({"doc_id": ["a"], "split": ["exploratory"], "text": [" ".join(["w"] * 600)]})
    clock(dt.datetime(2030, 1, 1))
    config["prompt"]["date"] = "2024-07-26"
    out = build_prompts(docs, byte_tokenizer, prompt_settings(config), context=100000)
    assert byte_tokenizer.decode(out["input_ids"][0].to_list()).startswith("Today Date: 26 Jul 2024;")


@pytest.mark.parametrize(
    "date,expect",
    [
        ("2026-02-30", "prompt.date: '2026-02-30' is not a date"),
        ("1 Jan 2026", "prompt.date: '1 Jan 2026' does not match the pattern"),
    ],
)
def test_bad_prompt_date_is_named(date, expect):
    from kvdiverge.config.workflow import ConfigError

    config = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
    config["prompt"]["date"] = date
    with pytest.raises(ConfigError, match=expect):
        validate(config)


def test_unquoted_yaml_date_is_explained():
    from kvdiverge.config.workflow import ConfigError

    config = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
    config["prompt"].update(yaml.safe_load("date: 2026-01-01"))  # YAML reads a date object
    with pytest.raises(ConfigError, match=r'prompt.date: .*quote the date \("2026-01-01"\)'):
        validate(config)


@pytest.mark.workflow
@pytest.mark.llm
def test_corpus_and_prompts_stages_through_snakemake(smoke_run, tmp_path):
    """The corpus and prompts that Snakemake built from the real corpus and model in the
    session's smoke run (fixture ``smoke_run``); dry runs on a copy of it (``-d``) see which
    settings rerun the prompts stage."""
    from conftest import copy_run, results_dir

    res = results_dir("smoke.yaml")
    target = f"{res}/prompts/smollm2-135m.parquet"
    work = copy_run(Path(smoke_run).parent, tmp_path / "work")
    docs = pl.read_parquet(work / res / "corpus/documents.parquet")
    prompts = pl.read_parquet(work / target)
    assert docs.height == 4 and prompts["doc_id"].to_list() == docs["doc_id"].to_list()
    assert prompts.schema == pl.Schema(SCHEMA)
    assert prompts["exclusion_reason"].null_count() == 4
    assert (prompts["n_prompt_tokens"] > 145).all()  # snapkv-b128 needs 128 + 16 + 1
    log = (work / res / "logs/prompts/smollm2-135m.log").read_text()
    assert "context length: 8192 tokens" in log and "exploratory: 2/2 usable" in log
    assert "exploratory: 2 documents" in (work / res / "logs/corpus.log").read_text()
    # no half-written files left behind by the atomic writes
    assert not list((work / res).rglob("*.tmp"))

    # a new instruction reruns the prompts stage only; an unrelated change reruns nothing
    import yaml
    from conftest import snakemake_here

    def dry_run(change):
        config = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
        change(config)
        path = tmp_path / "changed.yaml"
        path.write_text(yaml.safe_dump(config))  # keys reordered: no change
        # in this process (tests/conftest.py, snakemake_here): no interpreter start per dry run
        out = snakemake_here(ROOT, "-n", "--configfile", str(path), "-d", str(work), target)
        assert out.returncode == 0, out.stdout[-3000:]
        return out.stdout

    text = dry_run(lambda c: c["prompt"].update(instruction="List the topics."))
    assert "rule prompts:" in text and "rule corpus:" not in text and "params have changed" in text
    text = dry_run(lambda c: c["prompt"].update(date="2027-05-05"))  # the date templates see
    assert "rule prompts:" in text and "rule corpus:" not in text and "params have changed" in text
    text = dry_run(lambda c: c["prompt"].update(date="2026-01-01"))  # the default, written out
    assert "Nothing to be done" in text
    text = dry_run(lambda c: c["analysis"].update(bootstrap=100))
    assert "Nothing to be done" in text


def test_a_split_left_without_usable_documents_stops_with_the_reason():
    from kvdiverge.data.prompts import NoUsableDocumentsError, check_usable

    settings = {"minimums": {"exploratory": {"snapkv-b512": 577}, "confirmatory": {}}}
    prompts = pl.DataFrame(
        {
            "doc_id": ["a", "b", "c"],
            "split": ["exploratory", "exploratory", "confirmatory"],
            "exclusion_reason": [
                "too short for policy snapkv-b512: prompt of 400 tokens, policy needs at least 577",
                "too short for policy snapkv-b512: prompt of 420 tokens, policy needs at least 577",
                "too short for policy x",
            ],
        }
    )
    with pytest.raises(
        NoUsableDocumentsError,
        match=r"split 'exploratory': none of its 2 documents .*snapkv-b512.*"
        r"most frequent reason: too short for policy snapkv-b512.*min_words",
    ):
        check_usable(prompts, settings)
    # one usable document is enough; a split without scheduled policies is not checked
    check_usable(
        prompts.with_columns(
            pl.when(pl.col("doc_id") == "a").then(None).otherwise(pl.col("exclusion_reason")).alias("exclusion_reason")
        ),
        settings,
    )


def test_the_corpus_stages_exclusions_reach_the_prompts_table_and_its_log(config):
    from kvdiverge.data.corpus import SCHEMA as CORPUS_SCHEMA

    reasons = [None, "duplicate of a", "empty document", "whitespace-only document", None]
    docs = pl.DataFrame(
        {
            "doc_id": ["a", "b", "e", "f", "long"],
            "split": ["exploratory"] * 4 + ["confirmatory"],
            "text": [" ".join(["w"] * 600), " ".join(["w"] * 600), "", "  ", " ".join(["w"] * 9000)],
            "exclusion_reason": reasons,
        },
        schema_overrides={k: v for k, v in CORPUS_SCHEMA.items() if k in ("doc_id", "split", "text")},
    )
    out = build_prompts(docs, WordTokenizer(), prompt_settings(config), context=8192)
    assert out.schema == pl.Schema(SCHEMA)
    got = out["exclusion_reason"].to_list()
    assert got[:4] == reasons[:4] and got[4].startswith("too long: prompt of 9010 tokens")
    assert out["n_prompt_tokens"].to_list()[1:4] == [0, 0, 0] and out["input_ids"].to_list()[1:4] == [[], [], []]
    lines = summary(out).splitlines()
    assert lines[0] == "confirmatory: 0/1 usable; prompt tokens 9010-9010"
    assert lines[2:] == [
        "exploratory: 1/4 usable; prompt tokens 610-610",
        "  excluded b: duplicate of a",
        "  excluded e: empty document",
        "  excluded f: whitespace-only document",
    ]
    assert lines[1].startswith("  excluded long: too long: prompt of 9010 tokens")


def test_the_advice_follows_from_the_reasons():
    from kvdiverge.data.prompts import NoUsableDocumentsError, check_usable

    settings = {"minimums": {"exploratory": {"snapkv": 65}}}

    def advice(*reasons):
        prompts = pl.DataFrame(
            {"doc_id": [f"d{i}" for i in range(len(reasons))], "split": "exploratory", "exclusion_reason": reasons}
        )
        with pytest.raises(NoUsableDocumentsError) as info:
            check_usable(prompts, settings)
        return str(info.value).split("most frequent reason: ")[1]

    too_long = "too long: prompt of 9000 tokens + 32 new tokens exceeds the model context of 8192 tokens"
    assert advice(too_long) == (
        f"{too_long}. Shorten the prompts (a lower corpus.max_words) or decoding.max_new_tokens, or use a model "
        f"with a longer context."
    )
    assert "min_words" not in advice(too_long)
    assert advice("duplicate of a", "empty document", "duplicate of a").endswith(
        "Add distinct documents to the corpus source (duplicates are dropped); or add documents with text to "
        "the corpus source."
    )
    no_break = (
        "document 'd0' has no paragraph break (no blank line): the needle goes between paragraphs, so the "
        "corpus must separate paragraphs by blank lines"
    )
    assert advice(no_break).endswith(
        f"{no_break}. Use excerpts of several paragraphs (a higher corpus.min_words) from a source that "
        f"separates paragraphs by blank lines: the task's needle goes between paragraphs."
    )
    shallow = "document 'd0' is too short for needle depth 50%: its 2 paragraphs allow depths 0, 40, 100%"
    with pytest.raises(NoUsableDocumentsError, match=r"none of its 1 documents \(2 more dropped before selection\)"):
        check_usable(
            pl.DataFrame(
                {
                    "doc_id": ["a", "b", "c"],
                    "split": "exploratory",
                    "exclusion_reason": ["duplicate of x", "empty document", shallow],
                }
            ),
            settings,
        )
    assert advice(shallow).endswith(
        "Use longer excerpts with more paragraphs (a higher corpus.min_words), or a larger task.depth_tolerance."
    )
    short = "too short for policy snapkv: prompt of 40 tokens, policy needs at least 65"
    assert advice(short).endswith(
        "Widen corpus.min_words/max_words (longer prompts), or drop the policy from runs.exploratory "
        "(and analysis.gaps / confirmatory)."
    )
