"""The needle task on the embedded model: the full cache's greedy accuracy, a press keeping only
the last 64 tokens failing the needles placed early, and the question prefilled after
compression equal to kvpress's pipeline."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding, Sampling

pytestmark = pytest.mark.llm


def task_documents(tokenizer, n: int, depths=(0, 25, 50, 75, 100), question: str = "inside"):
    """The first ``n`` embedded excerpts that take their needle, as (Document, needle) pairs."""
    from kvdiverge.config.prompt_sources import sotu_prompts
    from kvdiverge.data.tasks.niah import NiahSettings, TaskError, make_needle, task_prompt
    from kvdiverge.engine.runner import Document

    settings = NiahSettings(depths=depths, seed=5, question=question)
    out = []
    for i, (doc_id, text) in enumerate(sotu_prompts(2 * n, 300, 450).items()):
        needle = make_needle(settings, doc_id, i)
        try:
            p = task_prompt(tokenizer, text, needle, settings, doc_id=doc_id)
        except TaskError:
            continue
        out.append((Document(doc_id, p.input_ids, p.n_question if question == "after" else 0), needle))
        if len(out) == n:
            break
    return out


def greedy_answers(model, tokenizer, docs, policies, T=16):
    from kvdiverge.data.tasks.answers import greedy_pair
    from kvdiverge.data.tasks.niah import score_answer
    from kvdiverge.engine.runner import run_policies

    runs = run_policies(
        model,
        [d for d, _ in docs],
        policies,
        Sampling(T=T, replicates=1, decoding=Decoding(temperature=0.0, top_p=1.0), seed=1, model_name="smollm2-135m"),
        split="exploratory",
    )
    value = {d.doc_id: n.value for d, n in docs}
    out = []
    for row in runs.trajectories.iter_rows(named=True):
        ref, ev = (tokenizer.decode(t, skip_special_tokens=True) for t in greedy_pair(row))
        out.append(
            {
                "policy": row["policy"],
                "doc_id": row["doc_id"],
                "full": score_answer(ref, value[row["doc_id"]]),
                "press": score_answer(ev, value[row["doc_id"]]),
                "tv_max": max(row["tv"]),
            }
        )
    return pl.DataFrame(out)


def test_full_cache_answers_the_needle_and_keeping_the_last_64_tokens_fails_early_needles(embedded):
    model, tokenizer = embedded
    docs = task_documents(tokenizer, 10)
    policies = {
        "none": {"press": "SnapKVPress", "compression_ratio": 0.0},
        "last64": {"press": "StreamingLLMPress", "n_sink": 0, "budget": 64},
    }
    from kvdiverge.engine.presses.policies import Policy

    got = greedy_answers(model, tokenizer, docs, {k: Policy.from_config(k, v) for k, v in policies.items()})
    full = got.filter(pl.col("policy") == "none")
    accuracy = full["full"].mean()
    print(f"full-cache accuracy on {full.height} embedded excerpts: {accuracy:.0%}")
    assert full.height == 10 and accuracy >= 0.9
    assert full["press"].to_list() == full["full"].to_list() and full["tv_max"].max() == 0.0  # the control
    depth = {d.doc_id: n.depth for d, n in docs}
    last = got.filter(pl.col("policy") == "last64").with_columns(
        pl.col("doc_id").replace_strict(depth, return_dtype=pl.Float64).alias("depth")
    )
    early = last.filter(pl.col("depth") <= 25)
    assert early.height >= 4 and not early["press"].any()


@pytest.mark.parametrize("press_entry", [{"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16}])
def test_question_after_compression_equals_kvpress_pipeline(embedded, press_entry):
    """Greedy tokens of the engine's evicted side equal kvpress's pipeline: the context prefilled under
    the press, then the question on the compressed cache at the uncompressed positions, then greedy decoding."""
    from transformers import DynamicCache

    from kvdiverge.engine.presses.policies import Policy

    model, tokenizer = embedded
    docs = task_documents(tokenizer, 2, question="after")
    policy = Policy.from_config("p", press_entry)
    T = 8
    from kvdiverge.data.tasks.answers import greedy_pair
    from kvdiverge.engine.runner import run_policies

    got = run_policies(
        model,
        [d for d, _ in docs],
        {"p": policy},
        Sampling(T=T, replicates=1, decoding=Decoding(temperature=0.0, top_p=1.0), seed=1, model_name="smollm2-135m"),
        split="exploratory",
    ).trajectories
    rows = {row["doc_id"]: row for row in got.iter_rows(named=True)}
    for doc, _ in docs:
        row = rows[doc.doc_id]
        assert doc.n_question > 20
        ids = torch.tensor([list(doc.input_ids)])
        n = doc.context_len
        cache = DynamicCache()
        with torch.inference_mode():
            with policy.build_press(n)(model):
                model.model(input_ids=ids[:, :n], past_key_values=cache)
            assert cache.get_seq_length() < n
            pos = torch.arange(n, ids.shape[1]).unsqueeze(0)
            out = model(input_ids=ids[:, n:], past_key_values=cache, position_ids=pos, logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            for i in range(T - 1):
                step = torch.tensor([[tokens[-1]]])
                out = model(input_ids=step, past_key_values=cache, position_ids=pos[:, -1:] + 1 + i)
                tokens.append(int(out.logits[0, -1].argmax()))
        assert greedy_pair(row)[1] == tokens
