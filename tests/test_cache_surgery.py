"""The batched cache surgery of the language-model pair against each document run alone.

Three documents of different prompt lengths (7, 12, 17 tokens) share one pair (two rows
each) on a miniature random-weight Llama. A row's log-distributions after a rewind, after
``keep_rows`` (which moves later rows of a cache with capacity into the dropped rows' places, in
place, and drops the columns no remaining row attends to from a ``DynamicCache``) and from a merged
cache must be those of its document run alone in a pair of its own, fed the row's
surviving history directly. Batched and alone differ only by the rounding of the batched,
padded forward: measured at most 2.1e-7 (log-probabilities, float32 weights, one CPU
thread), against 0.1 for a history that differs in one token; the tolerance is 1e-5.
Bit for bit where the code promises it: with no press the two sides hold the same cache,
so equal tokens give equal log-distributions on both sides, and a merged cache holds each
document's keys and values unchanged.
"""

from __future__ import annotations

import pytest
import torch
from kvpress import KnormPress

from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument, merge_caches
from kvdiverge.engine.llm.side import JointSides
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = pytest.mark.miniature

TOL = 1e-5
LENGTHS = (7, 12, 17)
R = 2


@pytest.fixture(scope="module")
def mini():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield random_model(MINIATURE["llama-3.1-8b"], seed=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in LENGTHS]


def presses(kind):
    return [None if kind == "none" else KnormPress(compression_ratio=0.5) for _ in LENGTHS]


def pair_of(model, prompts, press_list, fast=True):
    return LLMKernelPair.from_documents(
        model,
        [PairDocument(ids, press) for ids, press in zip(prompts, press_list)],
        decoding=Decoding(temperature=1.0, eos_ids=[]),
        fast=fast,
    )


def reference_cache(pair):
    """The cache holding the reference rows: the joint cache of both sides, or the reference side's own."""
    sides = pair._sides
    return sides.side.cache if isinstance(sides, JointSides) else sides.ref.cache


def alone(model, ids, press, hx, hy):
    """Both log-distributions after histories ``hx`` / ``hy`` of one document in a pair of its own."""
    pair = pair_of(model, [ids], [press])
    logp, logq = pair.start(1)
    for a, b in zip(hx, hy):
        logp, logq = pair.advance(torch.tensor([a]), torch.tensor([b]))
    return logp[0], logq[0]


def tokens(seed, *shape):
    return torch.randint(1, 500, shape, generator=torch.Generator().manual_seed(seed))


class Widths:
    """Forward hook: the cache length after each forward given a cache (reference side first)."""

    def __init__(self, model):
        self.seen: list[int] = []
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, out):
        if kwargs.get("past_key_values") is not None:
            self.seen.append(int(kwargs["past_key_values"].get_seq_length()))


def run_rewound(mini, prompts, kind, fast=True):
    """Chains of 5 tokens, rewound per row to ``CUT`` (earlier than the chain's end but for one
    row), then 3 branch tokens that differ between the sides."""
    pair = pair_of(mini, prompts, presses(kind), fast=fast)
    N = len(prompts) * R
    pair.start(N)
    chain = tokens(10, N, 5)
    for k in range(5):
        pair.advance(chain[:, k], chain[:, k])
    cut = torch.tensor([1, 4, 0, 2, 3, 5])
    pair.rewind(cut)
    xs, ys = tokens(11, N, 3), tokens(12, N, 3)
    for k in range(3):
        logp, logq = pair.advance(xs[:, k], ys[:, k])
    hist = [
        (chain[g, : cut[g]].tolist() + xs[g].tolist(), chain[g, : cut[g]].tolist() + ys[g].tolist()) for g in range(N)
    ]
    return pair, logp, logq, hist


@pytest.mark.parametrize("kind", ["none", "knorm"])
def test_rewind_to_an_earlier_step_equals_each_document_alone(mini, prompts, kind):
    _, logp, logq, hist = run_rewound(mini, prompts, kind)
    for g, (hx, hy) in enumerate(hist):
        ap, aq = alone(mini, prompts[g // R], presses(kind)[0], hx, hy)
        assert (logp[g] - ap).abs().max() < TOL, g
        assert (logq[g] - aq).abs().max() < TOL, g


@pytest.mark.parametrize("fast", [True, False], ids=["capacity-cache", "dynamic-cache"])
@pytest.mark.parametrize("kind", ["none", "knorm"])
def test_keep_rows_equals_each_document_alone(mini, prompts, kind, fast):
    pair, _, _, hist = run_rewound(mini, prompts, kind, fast)
    cache = reference_cache(pair)
    buffer = cache.layers[0].keys.untyped_storage().data_ptr()
    keep = torch.tensor([0, 1, 2, 3])  # the longest document leaves; its padding columns and chain
    pair.keep_rows(keep)  # step 5 (kept rows are cut at 1, 4, 0, 2) are attended by no row
    nxt = tokens(13, keep.numel())
    widths = Widths(pair.twin if fast else mini)  # the joint rows run on the twin
    try:
        logp, logq = pair.advance(nxt, nxt)
    finally:
        widths.handle.remove()
    # the reference cache: 17 prompt + 5 chain + 3 branch columns + 1; a DynamicCache drops
    # the 5 padding and 1 chain columns no kept row attends to, a cache with capacity keeps
    # them masked and compacts its rows in its own buffers
    if fast:
        assert widths.seen[0] == 17 + 5 + 3 + 1
        assert cache.layers[0].keys.untyped_storage().data_ptr() == buffer
        assert cache.layers[0].keys.shape[0] == 2 * keep.numel()  # both sides' rows
    else:
        assert widths.seen[0] == 17 + 5 + 3 - 5 - 1 + 1
    for i, g in enumerate(keep.tolist()):
        hx, hy = hist[g]
        ap, aq = alone(mini, prompts[g // R], presses(kind)[0], hx + [int(nxt[i])], hy + [int(nxt[i])])
        assert (logp[i] - ap).abs().max() < TOL, g
        assert (logq[i] - aq).abs().max() < TOL, g


def test_keep_rows_fills_the_gaps_with_later_rows_and_keeps_their_values(mini, prompts):
    pair, _, _, _ = run_rewound(mini, prompts, "knorm")
    side = pair._sides.side
    layer = side.cache.layers[-1]  # both sides' rows: reference 0..5, evicted 6..11
    before_k, before_v = layer.keys.clone(), layer.values.clone()
    keep = torch.tensor([0, 2, 5])
    pair.keep_rows(keep)
    rows = torch.cat([keep, keep + 6])
    assert torch.equal(side.logical(layer.keys), before_k[rows]) and torch.equal(
        side.logical(layer.values), before_v[rows]
    )
    # rows 0, 2 and 5 stay where they are; 6, 8 and 11 move into the gaps 1, 3 and 4
    assert torch.equal(layer.keys, before_k[[0, 6, 2, 8, 11, 5]])


def test_without_a_press_both_sides_stay_bit_identical_through_rewind_and_keep_rows(mini, prompts):
    pair = pair_of(mini, prompts, presses("none"))
    N = len(prompts) * R
    logp, logq = pair.start(N)
    assert torch.equal(logp, logq)
    chain = tokens(20, N, 4)
    for k in range(4):
        logp, logq = pair.advance(chain[:, k], chain[:, k])
        assert torch.equal(logp, logq)
    pair.rewind(torch.tensor([0, 3, 1, 4, 2, 2]))
    pair.keep_rows(torch.tensor([5, 1, 2]))
    for k in range(2):
        t = tokens(21 + k, 3)
        logp, logq = pair.advance(t, t)
        assert torch.equal(logp, logq)


@pytest.mark.parametrize("capacity", [None, 30], ids=["dynamic", "capacity"])
def test_merge_caches_left_pads_each_document_and_keeps_its_keys_and_values(mini, prompts, capacity):
    from transformers import DynamicCache

    from kvdiverge.engine.llm.cache import CapacityLayer

    caches, copies = [], []
    with torch.inference_mode():
        for ids in prompts:
            cache = DynamicCache()
            mini(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
            caches.append(cache)
            copies.append([(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])
        merged, valid = merge_caches(caches, list(LENGTHS), R, torch.device("cpu"), capacity)
    longest = max(LENGTHS)
    if capacity is not None:  # written into buffers of that many columns
        assert all(type(layer) is CapacityLayer and layer.capacity == capacity for layer in merged.layers)
    assert valid.shape == (len(LENGTHS) * R, longest)
    for li, layer in enumerate(merged.layers):
        assert layer.keys.shape[:3] == layer.values.shape[:3] == (len(LENGTHS) * R, copies[0][li][0].shape[1], longest)
        for d, n in enumerate(LENGTHS):
            k, v = copies[d][li]
            for row in range(d * R, (d + 1) * R):
                assert torch.equal(layer.keys[row, :, longest - n :], k[0])
                assert torch.equal(layer.values[row, :, longest - n :], v[0])
                assert not layer.keys[row, :, : longest - n].any() and not layer.values[row, :, : longest - n].any()
                assert valid[row].tolist() == [False] * (longest - n) + [True] * n
    # one document: its cache repeated, every column valid
    cache = DynamicCache()
    with torch.inference_mode():
        mini(input_ids=torch.tensor([prompts[0]]), past_key_values=cache, use_cache=True)
        keys = cache.layers[0].keys.clone()
        one, valid = merge_caches([cache], [LENGTHS[0]], R, torch.device("cpu"), capacity)
    assert valid.shape == (R, LENGTHS[0]) and bool(valid.all())
    assert all(torch.equal(one.layers[0].keys[r], keys[0]) for r in range(R))


def test_a_merged_start_equals_each_document_alone(mini, prompts):
    logp, logq = pair_of(mini, prompts, presses("knorm")).start(len(prompts) * R)
    for g in range(len(prompts) * R):
        ap, aq = alone(mini, prompts[g // R], presses("knorm")[0], [], [])
        assert (logp[g] - ap).abs().max() < TOL and (logq[g] - aq).abs().max() < TOL
