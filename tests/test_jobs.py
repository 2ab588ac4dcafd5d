"""kvdiverge.jobs.params: the settings object a generation job reads from its params, which is also its rerun key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdiverge.config.provenance import shard_settings, teacher_settings
from kvdiverge.config.workflow import load_config
from kvdiverge.jobs.params import ShardSettings, TeacherSettings
from kvdiverge.jobs.shard import generation_options

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smoke():
    return load_config(REPO / "config" / "smoke.yaml")


def test_the_settings_come_back_from_their_params_form(smoke):
    job = ShardSettings.from_config(smoke, MODEL, ["snapkv-90", "none"], "exploratory", 1)
    params = job.to_params()
    assert json.loads(json.dumps(params)) == params  # plain JSON values: a rule's params
    assert params["policies"] == ["snapkv-90", "none"]  # the order of the job's outputs
    assert ShardSettings.from_params(params) == job
    assert job.settings["none"] == shard_settings(smoke, MODEL, "none", "exploratory")  # what the shard records
    assert job.model_entry() == smoke["models"][MODEL] and job.shard == 1
    runs = [("snapkv-50", "confirmatory"), ("none", "exploratory"), ("snapkv-90", "exploratory")]
    teacher = TeacherSettings.from_config(smoke, MODEL, runs)
    params = teacher.to_params()
    assert json.loads(json.dumps(params)) == params and params["runs"] == [list(r) for r in runs]
    assert TeacherSettings.from_params(params) == teacher
    assert teacher.settings["confirmatory"]["snapkv-50"] == teacher_settings(smoke, MODEL, "snapkv-50", "confirmatory")
    assert teacher.splits() == {"confirmatory": ("snapkv-50",), "exploratory": ("none", "snapkv-90")}
    assert teacher.model_entry() == smoke["models"][MODEL]


def test_each_policy_of_a_shard_job_reads_typed_settings(smoke):
    job = ShardSettings.from_config(smoke, MODEL, ["snapkv-50", "none", "noise-floor"], "exploratory", 1)
    snapkv, control, floor = (job.run(p) for p in job.policies)
    assert snapkv.entry == smoke["policies"]["snapkv-50"] and floor.entry == {"press": "PermutationPress", "seed": 0}
    # the smoke config: T = 8, R = 2, temperature 0.7, top-p 0.95, 2 shards; the control on 1 document
    assert (snapkv.sampling.T, snapkv.sampling.replicates, snapkv.sampling.seed) == (8, 2, 20261129)
    assert (snapkv.sampling.decoding.temperature, snapkv.sampling.decoding.top_p) == (0.7, 0.95)
    assert snapkv.sampling.model_name == MODEL and snapkv.sampling.eos_ids is None  # the model's own
    assert (snapkv.shards, snapkv.documents, control.documents, floor.documents) == (2, None, 1, None)
    assert control.sampling == snapkv.sampling == floor.sampling  # one decoding, R and seed per job
    assert "run" not in job.to_params()  # the typed view adds nothing to the rerun key


def test_each_run_of_a_teacher_forced_job_reads_typed_settings(smoke):
    runs = [("snapkv-50", "exploratory"), ("none", "exploratory"), ("snapkv-90", "confirmatory")]
    job = TeacherSettings.from_config(smoke, MODEL, runs)
    snapkv, control, other = (job.run(p, s) for p, s in runs)
    assert snapkv.entry == smoke["policies"]["snapkv-50"] and other.entry == smoke["policies"]["snapkv-90"]
    # the smoke config: the control on 1 document, the master seed, 16 corpus tokens after each excerpt
    assert (snapkv.documents, control.documents, other.documents) == (None, 1, None)
    assert snapkv.seed == other.seed == 20261129 and snapkv.corpus == smoke["corpus"]
    assert snapkv.forced["length"] == 16 and snapkv.forced["continuation"] == "corpus"
    assert "repeat_instruction" not in snapkv.forced  # read by the reconstruction target only
    assert TeacherSettings.from_params(job.to_params()).run("none", "exploratory") == control


def test_a_job_reads_the_settings_of_its_policies_only(smoke):
    with pytest.raises(ValueError, match="give one each"):
        ShardSettings(model=MODEL, split="exploratory", policies=("a",), settings={"b": {}})
    other = {**smoke, "teacher_forced": {**smoke["teacher_forced"], "length": 9}}
    shard = ShardSettings.from_config(smoke, MODEL, "snapkv-50", "exploratory", 0)
    assert ShardSettings.from_config(other, MODEL, "snapkv-50", "exploratory", 0).to_params() == shard.to_params()
    with pytest.raises(ValueError, match="give one each"):
        TeacherSettings(model=MODEL, runs=(("a", "exploratory"),), settings={"confirmatory": {"a": {}}})
    runs = [("snapkv-50", "exploratory")]
    teacher = TeacherSettings.from_config(smoke, MODEL, runs)
    changed = TeacherSettings.from_config(other, MODEL, runs)
    assert changed.to_params() != teacher.to_params()
    decoding = {**smoke, "decoding": {**smoke["decoding"], "temperature": 0.9}, "replicates": 7, "shards": 3}
    assert TeacherSettings.from_config(decoding, MODEL, runs) == teacher


def test_the_batching_options_default_to_auto():
    assert generation_options(None).batch_documents is None
    assert generation_options({"batch_documents": "auto", "memory_budget_gb": 2.5}).memory_budget_gb == 2.5
    assert generation_options({"batch_documents": 3}).batch_documents == 3


@pytest.mark.parametrize(
    "change, reruns",
    [
        ({"target": "reconstruction"}, True),
        ({"key_tokens": {"short": 32, "alpha": 2.0, "beta": -2.0}}, True),
        ({"key_tokens": {"short": 128, "alpha": 1.0, "beta": -2.0}}, True),
        ({"repeat_instruction": "Say it again."}, False),  # read by the reconstruction only
        ({"target": "reconstruction", "repeat_instruction": "Say it again."}, True),
    ],
)
def test_the_target_and_key_tokens_rerun_the_teacher_forced_job_and_no_shard(smoke, change, reruns):
    """The teacher_forced section's target, key tokens and (with the reconstruction) repeat instruction
    are the teacher-forced job's rerun key, never a shard's."""
    assert smoke["teacher_forced"]["target"] == "continuation" and smoke["teacher_forced"]["key_tokens"]["short"] == 128
    base = {**smoke, "teacher_forced": {**smoke["teacher_forced"], "target": change.get("target", "continuation")}}
    other = {**smoke, "teacher_forced": {**smoke["teacher_forced"], **change}}
    runs = [("snapkv-50", "exploratory")]
    teacher = TeacherSettings.from_config(smoke if "repeat_instruction" not in change else base, MODEL, runs)
    assert (TeacherSettings.from_config(other, MODEL, runs).to_params() != teacher.to_params()) is reruns
    shard = ShardSettings.from_config(smoke, MODEL, "snapkv-50", "exploratory", 0)
    assert ShardSettings.from_config(other, MODEL, "snapkv-50", "exploratory", 0).to_params() == shard.to_params()


def test_the_shard_jobs_read_the_teacher_forced_settings_the_workflow_exports(smoke, monkeypatch):
    from kvdiverge.jobs.positions import SETTINGS_ENV, export_settings, exported_settings

    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    assert exported_settings(MODEL, "exploratory") is None  # none exported: the teacher-forced job runs the pass
    job = TeacherSettings.from_config(smoke, MODEL, [("snapkv-50", "exploratory"), ("none", "exploratory")])
    assert export_settings({MODEL: {"exploratory": job.to_params()}})
    assert exported_settings(MODEL, "exploratory") == job
    assert exported_settings(MODEL, "confirmatory") is None and exported_settings("other", "exploratory") is None
    # a value beyond what one environment string may hold is not exported, and the older one is removed
    assert not export_settings({MODEL: {"exploratory": job.to_params()}, "long": "x" * 200_000})
    assert exported_settings(MODEL, "exploratory") is None
