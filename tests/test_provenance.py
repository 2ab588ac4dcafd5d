"""kvdiverge.config.provenance: shard settings, their hash, the metadata a shard records, the stale-shard check."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.config.provenance import (
    KEY_HASH,
    KEY_SETTINGS,
    KEY_SHARD,
    KEY_VERSIONS,
    StaleShardError,
    canonical,
    check_shards,
    differences,
    library_versions,
    provenance_table,
    read_provenance,
    regenerate_command,
    settings_hash,
    shard_metadata,
    shard_settings,
    study_hash,
)
from kvdiverge.config.workflow import load_config
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.report.pages import provenance_html

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke():
    return load_config(REPO / "config" / "smoke.yaml")


def write_shard(path: Path, config, policy="snapkv-50", split="exploratory", shard=0, model="smollm2-135m"):
    frame = pl.DataFrame({"doc_id": [f"d{shard}"], "replicate": [0]})
    meta = shard_metadata(
        shard_settings(config, model, policy, split), model=model, policy=policy, split=split, shard=shard
    )
    write_parquet_atomic(frame, path, metadata=meta)
    return path


def test_canonical_sorts_keys_and_writes_whole_floats_as_ints():
    assert list(canonical({"b": 1, "a": {"d": 2.0, "c": (1, 0.5)}})) == ["a", "b"]
    assert canonical({"b": 1, "a": {"d": 2.0, "c": (1, 0.5)}}) == {"a": {"c": [1, 0.5], "d": 2}, "b": 1}
    assert repr(canonical({"t": 1.0})) == repr(canonical({"t": 1})) == "{'t': 1}"
    assert canonical(True) is True and canonical(0.7) == 0.7


def test_shard_settings_hold_exactly_what_decides_a_shard(smoke):
    s = shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory")
    assert sorted(s) == ["decoding", "documents", "model", "policy", "replicates", "seed", "shards"]
    assert s["policy"] == {"compression_ratio": 0.5, "kernel_size": 5, "press": "SnapKVPress", "window_size": 16}
    assert s["decoding"] == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.95}
    assert (s["replicates"], s["seed"], s["shards"], s["documents"]) == (2, 20261129, 2, None)
    assert s["model"]["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # the control runs on runs.control.documents documents of its split only
    assert shard_settings(smoke, "smollm2-135m", "none", "exploratory")["documents"] == 1
    # unrelated settings leave the settings (and their hash) alone
    other = {**smoke, "analysis": {**smoke["analysis"], "bootstrap": 7}, "window": 3}
    assert shard_settings(other, "smollm2-135m", "snapkv-50", "exploratory") == s


def test_settings_hash_ignores_key_order_and_sees_every_value(smoke):
    s = shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory")
    reordered = json.loads(json.dumps(s, sort_keys=False))
    reordered = dict(reversed(list(reordered.items())))
    assert settings_hash(reordered) == settings_hash(s)
    assert len(settings_hash(s)) == 16 and int(settings_hash(s), 16) >= 0
    changed = {**s, "decoding": {**s["decoding"], "temperature": 1.0}}
    assert settings_hash(changed) != settings_hash(s)


def test_a_shard_records_settings_hash_versions_and_identity(tmp_path, smoke):
    path = write_shard(tmp_path / "shard-1.parquet", smoke, shard=1)
    meta = pl.read_parquet_metadata(path)
    assert {KEY_SETTINGS, KEY_HASH, KEY_VERSIONS, KEY_SHARD} <= set(meta)
    rec = read_provenance(path)
    assert rec.settings == shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory")
    assert rec.settings_hash == settings_hash(rec.settings)
    assert rec.versions == library_versions()
    assert set(rec.versions) == {"python", "torch", "transformers", "kvpress", "kvdiverge"}
    assert rec.versions["kvpress"] == "0.5.5"
    assert rec.shard == {"model": "smollm2-135m", "policy": "snapkv-50", "split": "exploratory", "shard": 1}
    assert pl.read_parquet(path)["doc_id"].to_list() == ["d1"]  # the rows are untouched


def test_differences_name_the_dotted_key_and_both_values():
    assert differences({"a": {"t": 0.7}, "r": 2}, {"a": {"t": 1.0}, "r": 2}) == [("a.t", 0.7, 1.0)]
    assert differences({"a": 1}, {"a": 1.0}) == []
    assert differences({"a": 1}, {"b": 1}) == [("a", 1, "<absent>"), ("b", "<absent>", 1)]


def test_check_shards_accepts_matching_shards(tmp_path, smoke):
    paths = [write_shard(tmp_path / f"shard-{i}.parquet", smoke, shard=i) for i in range(2)]
    expected = shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory")
    recs = check_shards(paths, expected, model="smollm2-135m", policy="snapkv-50", split="exploratory")
    assert [r.shard["shard"] for r in recs] == [0, 1]


def test_check_shards_refuses_another_temperature_naming_setting_values_and_command(tmp_path, smoke):
    hot = {**smoke, "decoding": {**smoke["decoding"], "temperature": 0.9}}
    paths = [
        write_shard(tmp_path / "shard-0.parquet", hot, shard=0),
        write_shard(tmp_path / "shard-1.parquet", smoke, shard=1),
    ]
    expected = shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory")
    with pytest.raises(StaleShardError) as err:
        check_shards(paths, expected, configfiles=["config/smoke.yaml"])
    msg = str(err.value)
    assert f"{paths[0]}: decoding.temperature = 0.9 in the shard, 0.7 in the config" in msg
    assert str(paths[1]) + ":" not in msg  # the good shard is not named
    assert (f"snakemake --cores all --configfile config/smoke.yaml --forcerun {paths[0]}") in msg
    # without a config, the shards are compared with each other
    with pytest.raises(StaleShardError, match=r"decoding.temperature = 0.7 in the shard, 0.9 in .*shard-0"):
        check_shards(paths)


def test_check_shards_refuses_shards_without_settings_and_misplaced_shards(tmp_path, smoke):
    old = tmp_path / "shard-0.parquet"
    pl.DataFrame({"doc_id": ["a"]}).write_parquet(old)
    with pytest.raises(StaleShardError, match=r"(?s)record no settings .*older kvdiverge.*--forcerun .*shard-0"):
        check_shards([old], {})
    moved = write_shard(tmp_path / "x" / "shard-1.parquet", smoke, shard=0)
    with pytest.raises(StaleShardError, match=r"shard.shard = 0 in the shard, 1 in the config"):
        check_shards([moved], shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory"))
    with pytest.raises(StaleShardError, match=r'shard.policy = "snapkv-50" in the shard, "snapkv-90"'):
        check_shards([moved], shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory"), policy="snapkv-90")


def test_regenerate_command_reads_the_config_files_of_the_workflow(monkeypatch):
    monkeypatch.setenv("KVDIVERGE_CONFIGFILES", "config/smoke.yaml")
    assert (
        regenerate_command(["a.parquet", "b.parquet"])
        == "snakemake --cores all --configfile config/smoke.yaml --forcerun a.parquet b.parquet"
    )
    monkeypatch.delenv("KVDIVERGE_CONFIGFILES")
    assert "--configfile <your config>" in regenerate_command(["a.parquet"])


def test_provenance_table_one_row_per_run(tmp_path, smoke):
    paths = [
        write_shard(tmp_path / p / f"shard-{i}.parquet", smoke, policy=p, shard=i)
        for p in ("snapkv-50", "snapkv-b128")
        for i in range(2)
    ]
    table = provenance_table(read_provenance(p) for p in paths)
    assert table["policy"].to_list() == ["snapkv-50", "snapkv-b128"]
    assert table["shards"].to_list() == [2, 2]
    assert table["settings_hash"][0] == settings_hash(shard_settings(smoke, "smollm2-135m", "snapkv-50", "exploratory"))
    assert table["kvpress"].to_list() == ["0.5.5", "0.5.5"]
    html = provenance_html(table, study_hash(table))
    assert study_hash(table) in html and table["settings_hash"][1] in html and "<table>" in html
    assert "<th>kvpress</th>" in html and "<th>settings</th>" not in html
    assert study_hash(table) != study_hash(table.head(1))
