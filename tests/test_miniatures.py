"""The paper's architectures in miniature, through the engine on CPU.

Tiny random-weight models with the structural features of Llama-3.1-8B (GQA 4:1, llama3
RoPE scaling, untied embeddings) and Qwen2.5-7B (q/k/v biases, GQA 7:1, RoPE theta 1e6)
from :mod:`kvdiverge.models.standins`, no download. Every policy of ``config/paper.yaml``
runs through :func:`kvdiverge.engine.runner.run_documents` on three documents of different
lengths at once (several documents per batch where the engine batches them), with the
paper's own budgets: the shortest prompt (600 tokens) is long enough for snapkv-b512
(512 + 64 + 1 = 577). Checked: kept counts, greedy equality with ``model.generate`` per
document with and without the press, EOS handling, positions, and TV = 0 for the
ratio-0 control.

    pytest -m miniature
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdiverge.config.workflow import load_config
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_documents
from kvdiverge.models.standins import MINIATURE, random_model
from kvdiverge.testing.generation import greedy_generate, greedy_sides, until_eos

pytestmark = pytest.mark.miniature

REPO = Path(__file__).resolve().parents[1]
PAPER = load_config(REPO / "config" / "paper.yaml")
POLICIES = [Policy.from_config(name, spec) for name, spec in PAPER["policies"].items()]
LENGTHS = (600, 640, 700)  # disjoint position ranges [P, P + T - 2], none near a kept length
T, R = 5, 2
# weight std 0.1 instead of 0.02: sharper attention, so that eviction changes the greedy
# path (the equality tests can fail) and arg-max gaps stay far above rounding
INIT = 0.1


@pytest.fixture(scope="module", params=list(MINIATURE))
def mini(request):
    """(name, model, documents, reference greedy tokens per document)."""
    torch.manual_seed(0)
    model = random_model(MINIATURE[request.param], initializer_range=INIT, seed=1)
    eos = set(model.generation_config.eos_token_id)
    gen = torch.Generator().manual_seed(7)
    docs = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(1, 500, (n,), generator=gen).tolist()
        assert not eos & set(ids)
        docs.append(Document(f"doc-{i}", ids))
    refs = {d.doc_id: greedy(model, d.input_ids) for d in docs}
    return request.param, model, docs, refs


def greedy(model, ids, press=None, max_new_tokens=T) -> list[int]:
    """``model.generate`` greedy continuation (stops at EOS), with or without the press
    (:func:`kvdiverge.testing.generation.greedy_generate`: the full-attention layers only)."""
    return greedy_generate(model, ids, press, max_new_tokens)


def run(model, docs, policy, temperature=0.0, top_p=1.0, eos_ids=None):
    """run_documents on all documents at once (batched where the engine supports it)."""
    sampling = Sampling(
        T=T,
        replicates=R,
        decoding=Decoding(temperature=temperature, top_p=top_p, eos_ids=eos_ids),
        seed=3,
        model_name="mini",
    )
    return run_documents(model, docs, policy, sampling, RunOptions(batch_documents=len(docs)))


def sides(records, doc_id):
    """Greedy (reference, evicted) token sequences of one document from the coupled run."""
    recs = [r for r in records if r["doc_id"] == doc_id]
    assert len(recs) == R
    first = recs[0]
    for r in recs[1:]:  # greedy: every replicate is the same
        assert (r["chain_token"], r["t_star"], r["branch_x"], r["branch_y"]) == (
            first["chain_token"],
            first["t_star"],
            first["branch_x"],
            first["branch_y"],
        )
    return greedy_sides(first)


class PositionRecorder:
    """Records ``position_ids`` and each row's attended cache columns in every one-token (decode) forward."""

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[list[int], list[int]]] = []

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[1] != 1:
            return
        pos = kwargs.get("position_ids")
        assert pos is not None, "decode forward without position_ids: positions would follow the cache length"
        cache, mask = kwargs.get("past_key_values"), kwargs.get("attention_mask")
        width = int(cache.get_seq_length()) if cache is not None else -1
        # per row, the cache columns it attends to (the mask covers them and the new token)
        if isinstance(mask, dict):  # masks by layer type: the full-attention layers' (B, 1, 1, S), or None
            mask = mask["full_attention"]
            mask = None if mask is None else mask.reshape(mask.shape[0], -1)
        attended = [width] * ids.shape[0] if mask is None else (mask.sum(-1) - 1).tolist()
        self.calls.append((pos[:, -1].tolist(), attended))

    def __enter__(self):
        self._handle = self.model.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def test_miniatures_have_the_paper_structure(mini):
    name, model, _, _ = mini
    cfg, attn = model.config, model.model.layers[0].self_attn
    if name == "gemma-3-270m":
        assert cfg.layer_types.count("full_attention") == 2 and cfg.sliding_window < min(LENGTHS)
        assert attn.is_sliding and not model.model.layers[2].self_attn.is_sliding
        return
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied
    if name == "llama-3.1-8b":
        assert cfg.num_attention_heads // cfg.num_key_value_heads == 4
        assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 8.0
        assert model.model.rotary_emb.rope_type == "llama3"
        assert attn.q_proj.bias is None
    else:
        assert cfg.num_attention_heads // cfg.num_key_value_heads == 7
        assert cfg.rope_parameters["rope_theta"] == 1e6
        assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj))


@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_every_paper_policy_keeps_counts_matches_generate_and_positions(mini, policy):
    name, model, docs, refs = mini
    with PositionRecorder(model) as rec:
        records = run(model, docs, policy)
    eos = set(model.generation_config.eos_token_id)
    differs = False
    for doc in docs:
        n = doc.prompt_len
        kept = {r["kept_len"] for r in records if r["doc_id"] == doc.doc_id}
        assert kept == {policy.kept_tokens(n)}, (name, policy.name, doc.doc_id)
        ref, ev = sides(records, doc.doc_id)
        assert until_eos(ref, eos) == refs[doc.doc_id], (name, policy.name, doc.doc_id, "reference")
        want_ev = greedy(model, doc.input_ids, policy.build_press(n))
        assert until_eos(ev, eos) == want_ev, (name, policy.name, doc.doc_id, "evicted")
        differs |= want_ev != refs[doc.doc_id]
    keeps_all = policy.is_control or policy.press == "PermutationPress"  # the noise floor reorders only
    if policy.is_control:
        assert all(tv == 0.0 for r in records for tv in r["tv"])
    elif keeps_all:
        assert all(policy.kept_tokens(n) == n for n in LENGTHS)
    else:
        assert policy.kept_tokens(LENGTHS[0]) < LENGTHS[0]
    # positions continue from each document's uncompressed prompt length, on both sides
    allowed = {p + k for p in LENGTHS for k in range(T - 1)}
    seen = {p for positions, _ in rec.calls for p in positions}
    assert rec.calls and seen <= allowed, sorted(seen - allowed)[:10]
    assert set(LENGTHS) <= seen  # every document's first generated token sits at its P
    if not keeps_all and name != "gemma-3-270m":  # Gemma's sliding layers keep every column
        # the evicted rows: fewer cache columns than the positions they are asked to continue
        assert any(a < p for positions, attended in rec.calls for p, a in zip(positions, attended))
    if policy.name in ("snapkv-50", "recent-50"):
        assert differs, f"{policy.name} never changed a greedy path on {name}: the test could not fail"


def test_eos_is_absorbing_and_matches_generate(mini):
    """EOS set to the third greedy token of the first document: generate stops there."""
    name, model, docs, refs = mini
    old = model.generation_config.eos_token_id
    first = refs[docs[0].doc_id]
    stop = first[2]
    assert stop not in first[:2]
    model.generation_config.eos_token_id = [stop]
    try:
        policy = next(p for p in POLICIES if p.name == "snapkv-50")
        records = run(model, docs, policy, eos_ids=[stop])
        for doc in docs:
            ref, ev = sides(records, doc.doc_id)
            want_ref = greedy(model, doc.input_ids)
            want_ev = greedy(model, doc.input_ids, policy.build_press(doc.prompt_len))
            assert until_eos(ref, {stop}) == want_ref and until_eos(ev, {stop}) == want_ev
            for seq in (ref, ev):  # absorbing: only EOS after the first EOS
                if stop in seq:
                    assert set(seq[seq.index(stop) :]) == {stop}
        assert len(greedy(model, docs[0].input_ids)) == 3  # generate did stop at the EOS
    finally:
        model.generation_config.eos_token_id = old


def test_sampled_control_has_exactly_zero_tv(mini):
    name, model, docs, _ = mini
    control = next(p for p in POLICIES if p.is_control)
    records = run(model, docs, control, temperature=0.7, top_p=0.95)
    assert len(records) == R * len(docs)
    assert all(tv == 0.0 for r in records for tv in r["tv"])
    assert all(r["t_star"] is None for r in records)
