"""The LLM kernel pair and trajectory shards on a random-weight miniature with Llama-3.1's
structure (:data:`kvdiverge.models.standins.MINIATURE`): kvpress's own generation under
head-wise and per-layer presses, a repetition penalty, the one prefill, a press that skips
its compression, and shards. The equalities with ``model.generate`` on the embedded model
are tests/test_llm_pair.py."""

import polars as pl
import pytest
import torch
from kvpress import AdaKVPress, PyramidKVPress, SnapKVPress
from test_llm_pair import T, coupled_greedy, greedy_generate
from transformers import DynamicCache

from kvdiverge.data.prompts import SCHEMA as PROMPTS_SCHEMA
from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair
from kvdiverge.engine.llm.prefill import prefill
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.registry import kept_promise
from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA
from kvdiverge.jobs.params import ShardSettings
from kvdiverge.jobs.shard import generation_options, run_shard
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = [pytest.mark.miniature, pytest.mark.usefixtures("quiet_kvpress")]


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["llama-3.1-8b"], seed=7)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    """400 random ids of the miniature's vocabulary (none of its EOS ids)."""
    return torch.randint(1, 509, (400,), generator=torch.Generator().manual_seed(19)).tolist()


def test_greedy_coupled_run_with_a_repetition_penalty_equals_model_generate(model, prompt):
    """Each side penalizes its own context (the prompt and the tokens it generated, the residual
    branch's own after the divergence), as ``model.generate(repetition_penalty=1.3)`` does."""
    press = SnapKVPress(compression_ratio=0.5, window_size=32)
    decoding = Decoding(temperature=0.0, repetition_penalty=1.3)
    ref, ev, _ = coupled_greedy(model, prompt, press, expected_kept=len(prompt) // 2, decoding=decoding)
    want_ref = greedy_generate(model, prompt, repetition_penalty=1.3)
    want_ev = greedy_generate(evicted_twin(model), prompt, press, repetition_penalty=1.3)
    assert ref[: len(want_ref)] == want_ref
    assert ev[: len(want_ev)] == want_ev
    assert want_ref != greedy_generate(model, prompt)  # the penalty changes the generation: the test can fail
    assert want_ref != want_ev


@pytest.mark.parametrize(
    "press",
    [
        AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=32)),
        PyramidKVPress(compression_ratio=0.5, window_size=32),
    ],
    ids=["adakv-snapkv-50", "pyramidkv-50"],
)
def test_headwise_and_per_layer_presses_equal_kvpress_generate(model, prompt, press):
    """The reference side is plain ``generate``; the evicted side is kvpress's own
    ``generate`` under the press (on a twin, so the press never touches ``model``)."""
    n = len(prompt)
    ref, ev, pair = coupled_greedy(model, prompt, press, expected_kept=kept_promise(press, n))
    twin = evicted_twin(model)
    want_ev = greedy_generate(twin, prompt, press)
    assert ref[:T] == greedy_generate(model, prompt)
    assert ev[: len(want_ev)] == want_ev
    assert abs(pair.kept_lens[0] - n // 2) <= 1 and pair.prefill_forwards == [1]
    heads = model.config.num_key_value_heads
    if isinstance(press, AdaKVPress):
        assert pair.kept_per_layer == [[(n // 2) * heads] * model.config.num_hidden_layers]
    else:
        assert len(set(pair.kept_per_layer[0])) > 1  # the layers keep different counts


def test_one_prefill_gives_the_plain_reference_cache_bit_for_bit(model, prompt):
    ids = torch.tensor(prompt)
    twin = evicted_twin(model)
    with torch.inference_mode():
        plain = DynamicCache()
        logits = model(input_ids=ids[None], past_key_values=plain, use_cache=True, logits_to_keep=1).logits[:, -1]
        for press in (SnapKVPress(compression_ratio=0.5, window_size=32), AdaKVPress(SnapKVPress(0.5, window_size=32))):
            done = prefill(model, twin, ids, press)
            assert done.forwards == 1 and torch.equal(done.ref_logits, logits)
            for a, b in zip(done.ref.layers, plain.layers):
                assert a.keys.dtype == torch.float32
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_silently_skipped_compression_is_caught(model, prompt):
    class NoOpSnapKV(SnapKVPress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            return keys, values

    pair = LLMKernelPair(
        model,
        prompt,
        NoOpSnapKV(compression_ratio=0.5),
        decoding=Decoding(temperature=0.7),
        expected_kept=len(prompt) // 2,
    )
    with pytest.raises(CompressionError, match="promises"):
        pair.start(2)


@pytest.fixture(scope="module")
def shard_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    gen = torch.Generator().manual_seed(17)
    rows = []
    for i, (n, split) in enumerate(
        [(180, "exploratory"), (240, "exploratory"), (210, "exploratory"), (200, "confirmatory")]
    ):
        ids = torch.randint(1, 509, (n,), generator=gen).tolist()
        rows.append(
            {
                "doc_id": f"doc-{i}",
                "split": split,
                "n_prompt_tokens": len(ids),
                "input_ids": ids,
                "exclusion_reason": None,
            }
        )
    rows.append(
        {
            "doc_id": "doc-9",
            "split": "exploratory",
            "n_prompt_tokens": 5,
            "input_ids": [1, 2, 3, 4, 5],
            "exclusion_reason": "too short",
        }
    )
    prompts = root / "prompts.parquet"
    pl.DataFrame(rows, schema=PROMPTS_SCHEMA).write_parquet(prompts)
    # one document per forward: only then do shards equal the whole run bit for bit (batched
    # documents share rounding with their batch; test_batching checks that case)
    config = {
        "seed": 3,
        "shards": 2,
        "replicates": 2,
        "generation": {"batch_documents": 1},
        "decoding": {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 5},
        "policies": {
            "snapkv-50": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16},
            "none": {"press": "SnapKVPress", "compression_ratio": 0.0},
        },
        "runs": {
            "exploratory": ["snapkv-50"],
            "confirmatory": [],
            "control": {"policy": "none", "split": "exploratory", "documents": 1},
        },
    }
    return root, prompts, config


def test_shards_are_reproducible_and_partition_the_documents(model, shard_setup):
    root, prompts, config = shard_setup

    def run(cfg, shard, name):
        job = ShardSettings.from_config(cfg, "m", "snapkv-50", "exploratory", shard)
        options = generation_options(cfg["generation"])
        return run_shard(job, prompts, root / name, model=model, options=options).drop("seconds")

    b1 = run(config, 1, "b1.parquet")  # shard 1 first, then shard 0
    a0 = run(config, 0, "a0.parquet")
    again = run(config, 0, "a0-again.parquet")
    assert a0.equals(again)
    assert pl.read_parquet(root / "a0.parquet").schema == pl.Schema(TRAJECTORY_SCHEMA)
    whole = run({**config, "shards": 1}, 0, "whole.parquet")
    both = pl.concat([a0, b1]).sort("doc_id", "replicate")
    assert both.equals(whole.sort("doc_id", "replicate"))
    assert sorted(set(whole["doc_id"])) == ["doc-0", "doc-1", "doc-2"]  # excluded and other split left out
    assert whole["kept_len"].to_list() == [max(1, int(n * 0.5)) for n in whole["prompt_len"].to_list()]


def test_control_runs_on_its_first_documents_only(model, shard_setup):
    root, prompts, config = shard_setup
    job = ShardSettings.from_config({**config, "shards": 1}, "m", "none", "exploratory", 0)
    df = run_shard(job, prompts, root / "none.parquet", model=model)
    assert df["doc_id"].unique().to_list() == ["doc-0"]
    assert (df["kept_len"] == df["prompt_len"]).all()
    with pytest.raises(ValueError, match="shard 2 out of range"):
        run_shard(
            ShardSettings.from_config(config, "m", "none", "exploratory", 2), prompts, root / "x.parquet", model=model
        )
