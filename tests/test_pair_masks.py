"""The LLM pair under head-wise and per-layer presses, on a tiny random Llama-3.1 (GQA, 3 layers).

The reference side never sees a press; every row attends only to its own document's kept
positions per layer and head, through batching, row removal, column trimming and rewinds;
kept counts follow each press's promise; one prefill gives both caches.
"""

import kvpress
import pytest
import torch
from transformers import DynamicCache

from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument, merge_caches
from kvdiverge.engine.llm.masks import check_patched
from kvdiverge.engine.llm.prefill import attention_weights, prefill
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.promises import KeptPromise, check_kept
from kvdiverge.engine.presses.registry import kept_promise, shares_prefill
from kvdiverge.models.standins import MINIATURE, random_model

LAYERS, HEADS = 3, 2
LENGTHS = (41, 60, 52)
#: Largest |log q| difference between a document in a batch of three and the same document
#: alone, over every step and press below (measured: at most 2.5e-6 on this model's
#: float32 logits; rows in a batch round differently, and kvpress's masked keys differ by
#: where the padding sits).
BATCH_TOL = 2e-5


@pytest.fixture(scope="module")
def model():
    m = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=LAYERS)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # peaked distributions: evictions move them visibly
    return m


def prompt(n, seed=1):
    return [int(i) for i in torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed + n))]


def snap(ratio=0.5):
    return kvpress.SnapKVPress(ratio, window_size=8)


PRESSES = {
    "snapkv": lambda r: snap(r),
    "adakv": lambda r: kvpress.AdaKVPress(snap(r)),
    "critical-adakv": lambda r: kvpress.CriticalAdaKVPress(snap(r)),
    "pyramidkv": lambda r: kvpress.PyramidKVPress(r, window_size=8),
    "per-layer": lambda r: kvpress.PerLayerCompressionPress(kvpress.KnormPress(), [r * 0.4, r, r * 1.4]),
    "observed-attention": lambda r: kvpress.ObservedAttentionPress(r),
    "adakv-observed": lambda r: kvpress.AdaKVPress(kvpress.ObservedAttentionPress(r)),
    "dms": lambda r: kvpress.DMSPress(kvpress.KnormPress(), threshold=-0.45 if r else -1e9, sliding_window_size=8),
}


def tokens(step, n_rows, seed):
    return torch.randint(1, 500, (n_rows,), generator=torch.Generator().manual_seed(1000 * seed + step))


def drive(pair, n_rows, steps=5, script=None):
    """Start ``pair`` and feed it fixed tokens; ``script[step]`` runs keep_rows/rewind first.

    Returns the list of (log p, log q) per step; the reference side gets tokens of stream 0,
    the evicted side tokens of stream 1, both indexed by each row's original index.
    """
    out = [pair.start(n_rows)]
    rows = torch.arange(n_rows)
    for step in range(steps):
        if script and step in script:
            rows = script[step](pair, rows)
        x, y = tokens(step, n_rows, 0)[rows], tokens(step, n_rows, 1)[rows]
        out.append(pair.advance(x, y))
    return out


def keep_and_rewind(pair, rows):
    """Drop the first row of each document but the last, rewind the rest to one token."""
    keep = torch.tensor([i for i in range(rows.numel()) if i % 2 == 1 or i == rows.numel() - 2])
    pair.keep_rows(keep)
    pair.rewind(torch.ones(keep.numel(), dtype=torch.long))
    return rows[keep]


SCRIPT = {2: keep_and_rewind}


@pytest.mark.miniature
@pytest.mark.parametrize("name", list(PRESSES))
def test_the_reference_side_equals_a_no_press_pair_at_every_step(model, name):
    ids = prompt(60)
    pressed = drive(LLMKernelPair(model, ids, PRESSES[name](0.5), decoding=Decoding(temperature=1.0)), 4, script=SCRIPT)
    plain = drive(LLMKernelPair(model, ids, None, decoding=Decoding(temperature=1.0)), 4, script=SCRIPT)
    for (lp, lq), (bp, bq) in zip(pressed, plain):
        assert torch.equal(lp, bp)
    assert any(not torch.equal(lq, bq) for (_, lq), (_, bq) in zip(pressed, plain))  # the press acted


@pytest.mark.miniature
@pytest.mark.parametrize("name", [n for n in PRESSES if n != "dms"] + ["dms"])
def test_ratio_zero_gives_exactly_zero_tv(model, name):
    pair = LLMKernelPair(model, prompt(60), PRESSES[name](0.0), decoding=Decoding(temperature=1.0))
    out = [pair.start(2)]
    for step in range(5):
        x = tokens(step, 2, 0)
        out.append(pair.advance(x, x))
    assert all(torch.equal(lp, lq) for lp, lq in out)
    assert pair.kept_lens == [60]


#: Rows left of 6 (three documents, R = 2) after step 2: the longest document (rows 2, 3)
#: leaves whole; the columns of its longer prompt stay in the cache, masked for every row.
SURVIVORS = [1, 4, 5]


def drop_and_rewind(pair, rows):
    pair.keep_rows(torch.tensor(SURVIVORS))
    pair.rewind(torch.ones(len(SURVIVORS), dtype=torch.long))
    return rows[torch.tensor(SURVIVORS)]


@pytest.mark.miniature
@pytest.mark.parametrize("name", list(PRESSES))
def test_three_documents_in_one_batch_equal_each_alone(model, name):
    """Rows of three documents (R = 2), through row removal (in place) and rewinds."""
    docs = [prompt(n) for n in LENGTHS]
    press = PRESSES[name](0.5)
    batch = LLMKernelPair.from_documents(
        model, [PairDocument(d, press, kept_promise(press, len(d))) for d in docs], decoding=Decoding(temperature=1.0)
    )
    together = drive(batch, 6, script={2: drop_and_rewind})
    valid = batch._sides.valid(evicted=False)
    assert valid.shape[1] == max(LENGTHS) + 5  # the longest prompt's columns stay, masked
    assert not valid[:, : max(LENGTHS) - max(LENGTHS[0], LENGTHS[2])].any()
    for d, ids in enumerate(docs):
        alone = LLMKernelPair(model, ids, press, decoding=Decoding(temperature=1.0))
        mine = [2 * d, 2 * d + 1]  # this document's rows in the batch, by original index
        out, where = [alone.start(2)], [mine]
        for step in range(5):
            if step == 2:
                stay = [i for i, r in enumerate(mine) if r in SURVIVORS]
                if not stay:
                    break
                alone.keep_rows(torch.tensor(stay))
                alone.rewind(torch.ones(len(stay), dtype=torch.long))
                mine = [mine[i] for i in stay]
            out.append(alone.advance(tokens(step, 6, 0)[mine], tokens(step, 6, 1)[mine]))
            where.append([SURVIVORS.index(r) for r in mine] if step >= 2 else mine)
        assert batch.kept_lens[d] == alone.kept_lens[0] and batch.kept_per_layer[d] == alone.kept_per_layer[0]
        for step, ((bp, bq), (ap, aq), at) in enumerate(zip(together, out, where)):
            assert (bp[at] - ap).abs().max() < BATCH_TOL, (name, d, step)
            assert (bq[at] - aq).abs().max() < BATCH_TOL, (name, d, step)


@pytest.mark.miniature
def test_headwise_masks_are_a_per_head_top_k_when_every_head_keeps_its_share(model):
    """AdaKV with alpha_safeguard = 1 keeps n_kept positions in every head: SnapKV's choice,
    masked in place instead of gathered, so the two evicted kernels agree to rounding."""
    ids = prompt(60)
    ada = drive(
        LLMKernelPair(model, ids, kvpress.AdaKVPress(snap(), alpha_safeguard=1.0), decoding=Decoding(temperature=1.0)),
        2,
        script=SCRIPT,
    )
    plain = drive(LLMKernelPair(model, ids, snap(), decoding=Decoding(temperature=1.0)), 2, script=SCRIPT)
    unmasked = drive(LLMKernelPair(model, ids, None, decoding=Decoding(temperature=1.0)), 2, script=SCRIPT)
    for (_, aq), (_, sq), (_, uq) in zip(ada[1:], plain[1:], unmasked[1:]):
        assert (aq - sq).abs().max() < 1e-5
        assert (aq - uq).abs().max() > 1e-3  # the masks matter


@pytest.mark.miniature
def test_kept_counts_follow_each_press_promise(model):
    n = 60
    cases = {
        "adakv": (kvpress.AdaKVPress(snap()), [30 * HEADS] * LAYERS),
        "pyramidkv": (kvpress.PyramidKVPress(0.5, window_size=8), None),
        "per-layer": (
            kvpress.PerLayerCompressionPress(kvpress.KnormPress(), [0.2, 0.5, 0.7]),
            [48 * HEADS, 30 * HEADS, 18 * HEADS],
        ),
    }
    pyramid = kvpress.PyramidKVPress(0.5, window_size=8)
    budgets = [pyramid.get_layer_budget(m, n) for m in (model.model.layers[i].self_attn for i in range(LAYERS))]
    cases["pyramidkv"] = (pyramid, [b * HEADS for b in budgets])
    assert len(set(budgets)) == LAYERS  # the layers really keep different counts
    for name, (press, want) in cases.items():
        pair = LLMKernelPair(
            model, prompt(n), press, decoding=Decoding(temperature=1.0), expected_kept=kept_promise(press, n)
        )
        pair.start(1)
        assert pair.kept_per_layer == [want], name
        assert pair.kept_lens == [round(sum(want) / (HEADS * LAYERS))], name
    twin = evicted_twin(model)
    with torch.inference_mode():
        kept = prefill(model, twin, torch.tensor(prompt(n)), kvpress.AdaKVPress(snap())).kept
    assert (kept.sum(1) == 30 * HEADS).all() and bool((kept != 30).any())  # spread unevenly over heads


@pytest.mark.miniature
def test_a_broken_promise_names_the_layer(model):
    press = kvpress.PyramidKVPress(0.5, window_size=8)
    pair = LLMKernelPair(model, prompt(60), press, decoding=Decoding(temperature=1.0), expected_kept=30)
    with pytest.raises(CompressionError, match="layer 0 of the evicted cache keeps"):
        pair.start(1)
    ada = KeptPromise("AdaKVPress", "test", "layer", lambda c: (30,) * LAYERS)
    with pytest.raises(CompressionError, match=r"layer 2 .* keeps 61 prompt positions over its 2 heads"):
        check_kept(torch.tensor([[27, 33], [30, 30], [30, 31]]), ada, model.config, None, 60)
    check_kept(torch.tensor([[27, 33], [30, 30], [29, 31]]), ada, model.config, None, 60)
    with pytest.raises(CompressionError, match="left the cache at the full 60 positions"):
        check_kept(torch.full((3, 2), 60), None, model.config, snap(), 60)


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["snapkv", "adakv", "pyramidkv", "observed-attention", "dms"])
def test_one_prefill_gives_the_plain_reference_cache_bit_for_bit(model, name):
    ids = torch.tensor(prompt(60))
    twin = evicted_twin(model)
    with torch.inference_mode():
        done = prefill(model, twin, ids, PRESSES[name](0.5))
        cache = DynamicCache()
        logits = model(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    assert done.forwards == 1
    assert torch.equal(done.ref_logits, logits) and torch.equal(done.ev_logits, logits)
    for a, b in zip(done.ref.layers, cache.layers):
        assert a.keys.dtype == torch.float32
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert all(getattr(m, "masked_key_indices", None) is None for m in model.modules())


@pytest.mark.miniature
def test_presses_with_their_own_forward_get_two_prefills(model):
    own = sorted(
        n
        for n in kvpress.__all__
        if isinstance(getattr(kvpress, n), type)
        and issubclass(getattr(kvpress, n), kvpress.BasePress)
        and not shares_prefill(getattr(kvpress, n).__new__(getattr(kvpress, n)))
    )
    assert own == ["FastKVzipPress", "FinchPress", "KVComposePress", "KVgradPress", "KVzipPress", "RestoreKVPress"]
    pair = LLMKernelPair(
        model,
        prompt(60),
        kvpress.KVComposePress(compression_ratio=0.5),
        decoding=Decoding(temperature=1.0),
        expected_kept=kept_promise(kvpress.KVComposePress(compression_ratio=0.5), 60),
    )
    pair.start(1)
    assert pair.prefill_forwards == [2] and sum(pair.kept_per_layer[0]) >= 90 * HEADS


@pytest.mark.miniature
def test_supplied_attention_weights_are_eager_attentions(model):
    """ObservedAttentionPress scores with the weights eager attention returns (layer 0: same inputs)."""
    ids = torch.tensor([prompt(30)])
    eager = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=LAYERS, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    seen = {}

    def grab(module, args, kwargs, output):
        seen["w"] = attention_weights(module, kwargs["hidden_states"], kwargs["past_key_values"].layers[0].keys, kwargs)

    handle = model.model.layers[0].self_attn.register_forward_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        want = eager(input_ids=ids, output_attentions=True).attentions[0]
    handle.remove()
    assert seen["w"].shape == want.shape == (1, 8, 30, 30)
    assert (seen["w"] - want).abs().max() < 1e-6


@pytest.mark.miniature
def test_masks_need_a_patched_attention_implementation(model):
    check_patched(model)
    eager = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=1, attn_implementation="eager")
    with pytest.raises(ValueError, match="'eager' does not apply kvpress's per-head key masks"):
        check_patched(eager)


def test_merge_caches_pads_values_with_their_own_head_dim():
    """Keys of head dim 8, values of head dim 4 (as in models whose value head dim differs)."""

    def cache(n, seed, layers=(None, None)):
        c = DynamicCache()
        g = torch.Generator().manual_seed(seed)
        for li, m in enumerate(layers):
            k = m or n
            c.update(torch.randn(1, 2, k, 8, generator=g), torch.randn(1, 2, k, 4, generator=g), li)
        return c

    a, b = cache(3, 0), cache(5, 1, layers=(5, 2))  # b's second layer is shorter (a per-layer budget)
    ka, va = a.layers[1].keys.clone(), a.layers[1].values.clone()
    kb, vb = b.layers[1].keys.clone(), b.layers[1].values.clone()
    merged, valid = merge_caches([a, b], [3, 5], 2, torch.device("cpu"))
    assert merged.layers[0].keys.shape == (4, 2, 5, 8) and merged.layers[0].values.shape == (4, 2, 5, 4)
    assert valid.tolist() == [[False, False, True, True, True]] * 2 + [[True] * 5] * 2
    layer = merged.layers[1]
    assert torch.equal(layer.keys[0, :, 2:], ka[0]) and torch.equal(layer.values[1, :, 2:], va[0])
    assert torch.equal(layer.keys[2, :, 3:], kb[0]) and torch.equal(layer.values[3, :, 3:], vb[0])
    assert not layer.keys[2:, :, :3].any() and not layer.values[2:, :, :3].any()
    with pytest.raises(ValueError, match="layer 0: 5 cache columns, more than its length 4"):
        merge_caches([cache(5, 2), cache(3, 3)], [4, 3], 1, torch.device("cpu"))


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["adakv", "pyramidkv", "per-layer", "dms"])
def test_the_evicted_side_is_kvpress_own_decoding(model, name):
    """Log q at every step equals a plain kvpress decode of the pressed cache (one sequence,
    no padding: per-layer caches keep their own lengths, head-wise masks their own indices)."""
    ids, press = prompt(60), PRESSES[name](0.5)
    pair = LLMKernelPair(model, ids, press, decoding=Decoding(temperature=1.0))
    steps = drive(pair, 1, steps=4)
    twin, cache = evicted_twin(model), DynamicCache()
    with torch.inference_mode():
        with press(twin):
            twin(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        if name == "pyramidkv":
            assert len({layer.keys.shape[2] for layer in cache.layers}) == LAYERS
        for step, (_, lq) in enumerate(steps[1:]):
            y = tokens(step, 1, 1)
            logits = twin(
                input_ids=y[None], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[60 + step]])
            ).logits[:, -1]
            want = torch.log_softmax(logits.double(), -1)
            assert (lq - want).abs().max() < 1e-5, (name, step)


@pytest.mark.miniature
def test_rerotated_keys_continue_from_the_cache_length_as_kvpress_pipeline(model):
    """KeyRerotationPress's evicted side: the first generated token at RoPE position len(cache), as kvpress's pipeline."""
    ids, x = prompt(60), torch.tensor([7])
    press = kvpress.KeyRerotationPress(snap())
    pair = LLMKernelPair(model, ids, press, decoding=Decoding(temperature=1.0), expected_kept=kept_promise(press, 60))
    pair.start(1)
    _, q2 = pair.advance(x, x)
    cache = DynamicCache()
    with torch.inference_mode():
        with kvpress.KeyRerotationPress(snap())(model):
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 30
        logits = model(input_ids=x[None], past_key_values=cache, position_ids=torch.tensor([[30]])).logits[0, -1]
    assert torch.allclose(q2[0], torch.log_softmax(logits.double(), -1), atol=1e-5)
    assert pair._sides.prompt_len(evicted=True).tolist() == [30] and pair._sides.prompt_len(evicted=False).tolist() == [
        60
    ]


@pytest.mark.miniature
def test_a_document_prefill_seeds_torch_and_restores_the_callers_generator(model):
    """Presses drawing from torch's global generator (here RandomPress without a seed) reproduce under ``seeded``."""
    from kvdiverge.engine.llm.prefill import prefill_seed, seeded

    ids, seed, twin = torch.tensor(prompt(60)), prefill_seed(0, "m", "doc"), evicted_twin(model)
    assert seed == prefill_seed(0, "m", "doc") != prefill_seed(0, "m", "other") != prefill_seed(1, "m", "doc")
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    kept = []
    for s in (seed, seed, prefill_seed(0, "m", "other")):
        with seeded(s, "cpu"):
            kept.append([layer.keys for layer in prefill(model, twin, ids, kvpress.RandomPress(0.5)).ev.layers])
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(kept[0], kept[1]))
    assert not all(torch.equal(a, b) for a, b in zip(kept[0], kept[2]))
