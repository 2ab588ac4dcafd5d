"""The decoding kernels of the pair: grouped attention without ``repeat_kv``, caches written in place.

Against the stock path (transformers' ``sdpa`` attention with repeated keys and values, and
a ``DynamicCache`` that appends by concatenation: ``fast=False``):

- :func:`~kvdiverge.engine.llm.attention.grouped_sdpa` equals ``sdpa_attention_forward``
  on one query position with a padding mask, for both miniatures' groupings (4:1, 7:1), in
  float32 and bfloat16;
- :class:`~kvdiverge.engine.llm.cache.CapacityLayer` holds exactly what a ``DynamicLayer``
  holds after the same updates (growing past its capacity included), and keeps rows and
  columns as asked;
- every measured prefill press of the press matrix gives, on both miniatures, three
  documents batched (padding), rewound, and with rows dropped and reordered, the stock
  path's log-distributions within :data:`TOL`;
- both sides decode as the rows of one forward per step on the twin (none on the model),
  and give what a forward per side gives, within :data:`TOL`, for plain, head-wise,
  per-layer and re-rotating presses;
- with no press the two sides stay bit-identical (ratio 0: TV exactly 0), jointly or not;
- a head-wise press's masks still act through kvpress's attention patch: the evicted side
  differs from the same pair with its masks dropped.
"""

from __future__ import annotations

import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.attention import GROUPED_SDPA, grouped_sdpa
from kvdiverge.engine.llm.cache import CapacityLayer, capacity_cache
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument
from kvdiverge.engine.llm.side import fill_holes
from kvdiverge.engine.presses import registry
from kvdiverge.engine.presses import status as press_status
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.presses.registry import is_decode_time
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = pytest.mark.usefixtures("quiet_kvpress")

#: Largest |log p| difference (nats, tokens of probability > 1e-6) allowed between the
#: fast and the stock path.
TOL = 1e-5
LENGTHS = (24, 40, 33)
R, STEPS = 2, 5
#: Rows kept (in this order) before the fourth decoding step of :func:`trace`.
KEEP = (4, 0, 3, 1)


@pytest.fixture(scope="module", params=["llama-3.1-8b", "qwen-2.5-7b"])
def model(request):
    return random_model(MINIATURE[request.param], seed=5)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in LENGTHS]


class _Module:
    def __init__(self, groups):
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_equals_sdpa_with_repeated_keys(heads, kv_heads, dtype):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, heads, 1, 16, generator=gen).to(dtype)
    k, v = (torch.randn(5, kv_heads, 30, 16, generator=gen).to(dtype) for _ in range(2))
    mask = torch.ones(5, 1, 1, 30, dtype=torch.bool)
    mask[1, ..., :7] = False
    mask[3, ..., 10:20] = False
    module = _Module(heads // kv_heads)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (5, 1, heads, 16) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max().item() <= tol
    # a row with a different mask gets a different output: the mask is applied per row
    other = mask.clone()
    other[0, ..., :15] = False
    assert not torch.allclose(grouped_sdpa(module, q, k, v, other, scaling=0.25)[0][0], got[0])


def test_grouped_attention_is_registered_with_kvpress_patch_and_sdpa_masks():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    fn = AttentionInterface()[GROUPED_SDPA]
    assert "attention_patch" in fn.__qualname__
    assert ALL_MASK_ATTENTION_FUNCTIONS[GROUPED_SDPA] is sdpa_mask


def test_capacity_layer_holds_what_a_dynamic_layer_holds():
    from transformers.cache_utils import DynamicLayer

    gen = torch.Generator().manual_seed(1)
    k0, v0 = torch.randn(3, 2, 5, 4, generator=gen), torch.randn(3, 2, 5, 6, generator=gen)
    dyn, cap = DynamicLayer(), CapacityLayer(k0, v0, capacity=7)
    dyn.update(k0, v0)
    buffer = cap._k
    for step in range(4):  # the third update outgrows the 7 columns
        k, v = torch.randn(3, 2, 1, 4, generator=gen), torch.randn(3, 2, 1, 6, generator=gen)
        dk, dv = dyn.update(k, v)
        ck, cv = cap.update(k, v)
        assert torch.equal(ck, dk) and torch.equal(cv, dv)
        if step < 2:
            assert cap._k is buffer  # written in place
    assert cap.capacity >= 9 and cap.get_seq_length() == 9
    rows, cols = torch.tensor([2, 0]), torch.tensor([0, 3, 8])
    cap.select(rows, cols)
    assert torch.equal(cap.keys, dk[rows][:, :, cols]) and torch.equal(cap.values, dv[rows][:, :, cols])
    assert cap.get_mask_sizes(torch.arange(1)) == (4, 0)


@pytest.mark.parametrize(
    "rows,total,want",
    [
        ([0, 2, 4, 5], 6, [0, 4, 2, 5]),  # rows 1 and 3 dropped: 4 and 5 move into them
        ([5, 0, 2], 6, [0, 5, 2]),  # the caller's order does not matter: row 5 fills row 1
        ([0, 1, 2], 5, [0, 1, 2]),  # only the last rows dropped: nothing moves
        ([3, 4], 5, [3, 4]),
        ([], 3, []),
    ],
)
def test_fill_holes_moves_only_the_rows_past_the_new_count(rows, total, want):
    assert fill_holes(torch.tensor(rows, dtype=torch.long), total).tolist() == want


def test_capacity_layer_rearranges_rows_in_place():
    gen = torch.Generator().manual_seed(2)
    k0, v0 = torch.randn(6, 2, 5, 4, generator=gen), torch.randn(6, 2, 5, 3, generator=gen)
    cap = CapacityLayer(k0, v0, capacity=8)
    buffer = cap._k.data_ptr()
    rows = torch.tensor([0, 5, 2, 4])
    cap.select(rows)
    assert cap._k.data_ptr() == buffer and cap.keys.shape[0] == 4
    assert torch.equal(cap.keys, k0[rows]) and torch.equal(cap.values, v0[rows])
    k, v = torch.randn(4, 2, 1, 4, generator=gen), torch.randn(4, 2, 1, 3, generator=gen)
    keys, _ = cap.update(k, v)
    assert torch.equal(keys, torch.cat([k0[rows], k], dim=2))


def test_capacity_layer_selects_repeated_rows_into_new_buffers():
    k0, v0 = torch.arange(12.0).reshape(2, 1, 3, 2), -torch.arange(12.0).reshape(2, 1, 3, 2)
    cap = CapacityLayer(k0, v0, capacity=5)
    rows = torch.tensor([1, 1, 0, 0])  # more rows than the buffers hold: no in-place move
    cap.batch_select_indices(rows)
    assert cap.keys.shape == (4, 1, 3, 2) and cap.capacity == 5
    assert torch.equal(cap.keys, k0[rows]) and torch.equal(cap.values, v0[rows])


def test_a_side_with_capacity_keeps_the_callers_row_order(model, prompts):
    """Dropped rows' places are filled by later rows; the caller still sees its own order."""
    trace_fast, pair = trace(model, prompts, None, True, joint=False)
    side = pair._sides.ref
    assert side.order is not None  # rows 4 and 1 moved: the cache's order is not the caller's
    assert side.logical(side.n_gen).tolist() == [3, 3, 4, 4]  # rewound to [0, 1, 2, 1, 0, 2], rows 4, 0, 3, 1 kept
    stock, _ = trace(model, prompts, None, False, joint=False)
    for (p, _), (ps, _) in zip(trace_fast, stock):
        assert (p - ps).abs().max().item() <= TOL


def test_a_capacity_cache_copies_its_source():
    from transformers import DynamicCache

    src = DynamicCache()
    src.update(torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), 0)
    cache = capacity_cache(src, 10)
    assert cache.layers[0].capacity == 10 and cache.get_seq_length() == 3
    src.layers[0].keys.mul_(5)
    assert bool((cache.layers[0].keys == 1).all())


def _measured_prefill_presses():
    for name in sorted(registry.ROWS):
        if press_status.status(name) != "measured":
            continue
        if is_decode_time(Policy.from_config(name, press_status.test_spec(name)).build_press(64)):
            continue
        yield name


def trace(model, prompts, name, fast, joint=None):
    """Log-distributions of a batched, rewound run, and the pair; forced tokens, the same on both sides."""
    from kvdiverge.engine.llm.prefill import prefill_seed

    policy = None if name is None else Policy.from_config(name, press_status.test_spec(name))
    presses = [None if policy is None else policy.build_press(len(ids)) for ids in prompts]
    expected = [None if policy is None else policy.expected_kept(len(ids), p) for ids, p in zip(prompts, presses)]
    documents = [
        PairDocument(ids, press, kept, prefill_seed(0, "mini", f"d{d}"))
        for d, (ids, press, kept) in enumerate(zip(prompts, presses, expected))
    ]
    pair = LLMKernelPair.from_documents(model, documents, decoding=Decoding(temperature=1.0), fast=fast, joint=joint)
    n = len(prompts) * R
    out = [pair.start(n)]
    gen = torch.Generator().manual_seed(4)
    for step in range(STEPS):
        if step == 2:
            pair.rewind(torch.tensor([0, 1, 2, 1, 0, 2]))
        if step == 3:  # drop two rows and reorder the rest: the capacity cache fills the holes in place
            pair.keep_rows(torch.tensor(KEEP))
            n = len(KEEP)
        x = torch.randint(1, 500, (n,), generator=gen)
        out.append(pair.advance(x, x))
    return out, pair


@pytest.mark.miniature
@pytest.mark.parametrize("name", list(_measured_prefill_presses()))
def test_measured_presses_give_the_stock_path_distributions(model, prompts, name):
    if press_status.status(name, model) != "measured":
        pytest.skip(f"{name} is refused on this model's config")
    fast, pair = trace(model, prompts, name, True)
    stock, _ = trace(model, prompts, name, False)
    assert all(type(layer) is CapacityLayer for layer in pair._sides.side.cache.layers)
    for t, ((p, q), (ps, qs)) in enumerate(zip(fast, stock)):
        for a, b in ((p, ps), (q, qs)):
            live = b > -13.8
            gap = (a - b).abs()[live].max().item()
            assert gap <= TOL, f"{name}: step {t} differs from the stock path by {gap:.2e}"


class Forwards:
    """Forward hook: the rows of every decoding forward (one new token per row) of a module tree."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, out):
        if kwargs["input_ids"].shape[1] == 1:
            self.rows.append(int(kwargs["input_ids"].shape[0]))


@pytest.mark.miniature
@pytest.mark.parametrize("joint", [True, False], ids=["joint", "a-forward-per-side"])
def test_both_sides_decode_in_one_forward_per_step_on_the_twin(model, prompts, joint):
    """Joint: one forward of 2n rows per step on the twin, none on the model; otherwise n rows on each."""
    import kvpress

    presses = [kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=4)) for _ in prompts]
    pair = LLMKernelPair.from_documents(
        model,
        [PairDocument(ids, press) for ids, press in zip(prompts, presses)],
        decoding=Decoding(temperature=1.0),
        joint=joint,
    )
    n = len(prompts) * R
    pair.start(n)
    on_model, on_twin = Forwards(model), Forwards(pair.twin)
    try:
        for k in range(3):
            pair.advance(torch.arange(1, 1 + n), torch.arange(1, 1 + n))
        pair.keep_rows(torch.tensor([0, 3]))
        pair.advance(torch.tensor([5, 6]), torch.tensor([7, 8]))
    finally:
        on_model.handle.remove()
        on_twin.handle.remove()
    if joint:
        assert on_model.rows == [] and on_twin.rows == [2 * n] * 3 + [4]
    else:
        assert on_model.rows == [n] * 3 + [2] and on_twin.rows == [n] * 3 + [2]


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["SnapKVPress", "AdaKVPress", "PyramidKVPress", "KeyRerotationPress"])
def test_joint_decoding_gives_a_forward_per_sides_distributions(model, prompts, name):
    """The joint rows (evicted documents padded to the reference width, masks on evicted rows only)
    give what a forward per side on the same kernels gives, within :data:`TOL`."""
    joint, _ = trace(model, prompts, name, True, joint=True)
    apart, _ = trace(model, prompts, name, True, joint=False)
    for t, ((p, q), (ps, qs)) in enumerate(zip(joint, apart)):
        for a, b in ((p, ps), (q, qs)):
            live = b > -13.8
            gap = (a - b).abs()[live].max().item()
            assert gap <= TOL, f"{name}: step {t} differs from a forward per side by {gap:.2e}"
    assert any((p - q).abs().max().item() > 1e-3 for p, q in joint)  # the press matters: the test can fail


@pytest.mark.miniature
@pytest.mark.parametrize("joint", [True, False], ids=["joint", "a-forward-per-side"])
def test_without_a_press_both_sides_are_bit_identical(model, prompts, joint):
    steps, _ = trace(model, prompts, None, True, joint=joint)
    for p, q in steps:
        assert torch.equal(p, q)
        assert (0.5 * (p.exp() - q.exp()).abs().sum(-1)).max().item() == 0.0


@pytest.mark.miniature
def test_headwise_masks_still_apply(model, prompts):
    import kvpress

    def run(drop):
        presses = [kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=4)) for _ in prompts]
        pair = LLMKernelPair.from_documents(
            model,
            [PairDocument(ids, press) for ids, press in zip(prompts, presses)],
            decoding=Decoding(temperature=1.0),
        )
        pair.start(len(prompts) * R)
        assert pair._sides.side.masks is not None
        if drop:
            pair._sides.side.masks = None
        x = torch.arange(1, 1 + len(prompts) * R)
        return pair.advance(x, x)[1]

    masked, unmasked = run(False), run(True)
    assert (masked - unmasked).abs().max().item() > 1e-3
