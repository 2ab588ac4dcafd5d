"""The press matrix: every press kvpress exports, measured exactly or refused with what it needs.

In kvpress's own test style (``tests/default_presses.py`` + one parametrized test per
property): one row per class in ``kvpress.__all__`` (and the project's presses), read
through :data:`kvdiverge.engine.presses.registry.ROWS`, so a new kvpress release adds rows by
itself. Each row runs on tiny random-weight models with the Llama-3.1 and Qwen2.5 miniature
structure (grouped-query attention, :mod:`kvdiverge.models.standins`), its test
instance from :func:`kvdiverge.engine.presses.status.test_spec` (ratio 0.5 where the press
takes one; SnapKV or Knorm inside wrappers).

A *measured* press must give, on three prompts of 48, 64 and 96 tokens decoded together
(``R = 2`` rows each, ``T = 4`` steps, the same forced tokens on both sides):

- a reference side equal, exactly and at every step, to a pair run without any press;
- at ratio 0 (where it takes a ratio) an evicted side equal to the reference: TV exactly 0
  (one stated exception, :data:`RATIO0_SAME`);
- per document, the distributions of the document run alone, within :data:`BATCH_TOL`
  (presses drawing from torch's global generator included: each document's prefill seeds it,
  :func:`kvdiverge.engine.llm.prefill.prefill_seed`);
- the kept counts per layer and head that the press promises (``expected_kept``, checked by
  :func:`kvdiverge.engine.presses.promises.check_kept`), and an eviction at ratio 0.5.

A *refused* press must stop before any work (no model forward) with a
:class:`kvdiverge.engine.core.errors.PressError` carrying the registry's sentence, which names
what it needs (:data:`REASONS`), and kvpress alone must indeed fail on it here with the error
of :data:`KVPRESS_FAILS` (``CAMPress``, decode-time and not replayable, runs).

Pairs are built as the engine builds them (:func:`kvdiverge.engine.runner.build_pair`), which
picks the pair class from the press's row.
"""

from __future__ import annotations

import contextlib
import dataclasses

import kvpress
import pytest
import torch

from kvdiverge.engine.core.errors import PressError
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument
from kvdiverge.engine.presses import registry
from kvdiverge.engine.presses import status as press_status
from kvdiverge.engine.presses.adapters import PressAdapter, resolve
from kvdiverge.engine.presses.policies import Policy, PressPolicy, press_from_spec
from kvdiverge.engine.presses.promises import check_kept
from kvdiverge.engine.presses.registry import is_decode_time
from kvdiverge.engine.runner import Document, RunOptions, build_pair
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = pytest.mark.usefixtures("quiet_kvpress")

T, R = 4, 2
LENGTHS = (48, 64, 96)
#: Largest |log p| difference (nats, over tokens of probability > 1e-6) between a document
#: decoded in a batch of three and alone. Measured: at most 2.4e-7 over every measured press
#: and both miniatures (float32 on CPU, KeyRerotationPress on the Qwen2.5 miniature); the
#: bound leaves a factor of about 20.
BATCH_TOL = 5e-6


@dataclasses.dataclass
class EagerPrefill(kvpress.BasePress):
    """Keeps every position; runs the prefill in eager attention (the decode steps in sdpa)."""

    @contextlib.contextmanager
    def __call__(self, model):
        implementation = model.config._attn_implementation
        model.config._attn_implementation = "eager"
        try:
            yield
        finally:
            model.config._attn_implementation = implementation


#: The one exception to "ratio 0 gives TV exactly 0", with what it must equal instead:
#: KVComposePress runs its own prefill in eager attention (it needs the attention weights),
#: so at ratio 0 its cache is the eager prefill's, which equals the sdpa cache only up to
#: rounding. What bounds its TV is that rounding, which grows with the model (measured: TV
#: at most 1.2e-8 on both miniatures, 1.5e-6 on the embedded model, float32): at ratio 0
#: its evicted side must equal, exactly, that of :class:`EagerPrefill` (a press that keeps
#: every position and only switches the prefill to eager attention).
RATIO0_SAME = {"KVComposePress": EagerPrefill}

#: Measured presses whose kept counts the matrix checks against a promise (never ``None``):
#: the head-wise, per-layer and channel presses among them.
PROMISED = {
    "AdaKVPress",
    "CriticalAdaKVPress",
    "PyramidKVPress",
    "PerLayerCompressionPress",
    "KVComposePress",
    "ThinKPress",
    "SimLayerKVPress",
    "SnapKVPress",
    "KnormPress",
    "StreamingLLMPress",
    "CompactorPress",
    "LeverageScorePress",
}

#: What each refused press's sentence must name (written here, independently of the registry).
REASONS = {
    "CAMPress": "global random generator",
    "CriticalKVPress": "model.config.head_dim",  # on Qwen2 configs only
    "CriticalAdaKVPress": "model.config.head_dim",
    "DuoAttentionPress": "meta-llama/Meta-Llama-3.1-8B-Instruct",
    "ExpectedAttentionStatsPress": "params.stats_folder",
    "FastKVzipPress": "Jang-Hyun/Fast-KVzip",
    "FinchPress": "params.delimiter_token_id",
    "KVgradPress": "AutoTokenizer.from_pretrained",
    "KVzipPress": "AutoTokenizer.from_pretrained",
    "KVzapPress": "nvidia/KVzap-",
    "LUKVPress": "BUDGET_CURVE_URLS",
    "QFilterPress": "nthngdy/",
    "RestoreKVPress": "higokri/RestoreKV-",
}

#: How kvpress alone fails on each refused press here (offline, on the miniatures), written here
#: independently of the registry; CAMPress runs (it is refused as not replayable).
KVPRESS_FAILS = {
    "CriticalAdaKVPress": AttributeError,  # model.config.head_dim, on Qwen2 configs
    "CriticalKVPress": AttributeError,
    "DuoAttentionPress": AssertionError,  # the checkpoint has no published pattern
    "ExpectedAttentionStatsPress": (OSError, AttributeError),  # no hub copy (Llama); head_dim (Qwen2)
    "FastKVzipPress": RuntimeError,  # no released gates
    "FinchPress": ValueError,  # no delimiter token id
    "KVgradPress": OSError,  # the tokenizer cannot be reloaded from an empty name_or_path
    "KVzapPress": OSError,
    "KVzipPress": OSError,
    "LUKVPress": KeyError,  # no budget curve
    "QFilterPress": OSError,  # no hub copy
    "RestoreKVPress": ValueError,  # the repository id is not valid
}


def _rows():
    return [pytest.param(name, id=name) for name in sorted(registry.ROWS)]


@pytest.fixture(scope="module", params=["llama-3.1-8b", "qwen-2.5-7b", "gemma-3-270m"])
def model(request):
    """A miniature with random weights, sdpa attention, float32, eval mode (one per module)."""
    return random_model(MINIATURE[request.param], seed=3)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in LENGTHS]


#: Largest |log p - log p'| between the decode-time pair's reference side (each document alone,
#: stock kernels) and the batched pair's (padded, the engine's kernels): float32 rounding.
REFERENCE_TOL = 1e-5


@pytest.fixture(scope="module")
def forced():
    """The tokens fed at every step, per document (the same on both sides and in every run)."""
    gen = torch.Generator().manual_seed(12)
    return torch.randint(1, 500, (len(LENGTHS), T), generator=gen)


def trace(model, prompts, forced, policy: Policy | PressPolicy | None, doc_ids=None):
    """``(log p, log q)`` per step, each (len(prompts) * R, vocab), and the pair (kept counts, presses, promises).

    Each document's prefill seeds torch's generator from its id (``doc{d}``, ``d`` from ``doc_ids``,
    default ``0, 1, ...``). Without a policy, a pair with no press.
    """
    doc_ids = range(len(prompts)) if doc_ids is None else doc_ids
    if policy is None:
        pair = LLMKernelPair.from_documents(
            model, [PairDocument(ids) for ids in prompts], decoding=Decoding(temperature=1.0)
        )
    else:
        docs = [Document(f"doc{d}", ids) for d, ids in zip(doc_ids, prompts)]
        pair = build_pair(
            model,
            docs,
            policy,
            Sampling(T=T, replicates=R, decoding=Decoding(temperature=1.0, top_p=1.0), seed=0, model_name="miniature"),
        )
    steps = [pair.start(len(prompts) * R)]
    for t in range(T - 1):
        tokens = forced[:, t].repeat_interleave(R)
        steps.append(pair.advance(tokens, tokens))
    return steps, pair


def _policy(name: str, ratio: float | None = None) -> Policy:
    spec = press_status.test_spec(name)
    if ratio is not None and "compression_ratio" in spec:
        spec["compression_ratio"] = ratio
    return Policy.from_config(name, spec)


@pytest.mark.miniature
@pytest.mark.parametrize("name", _rows())
def test_press_matrix(model, prompts, forced, name, monkeypatch):
    if press_status.status(name, model) == "refused":
        check_refused(model, prompts, name, monkeypatch)
    else:
        check_measured(model, prompts, forced, name)


def check_measured(model, prompts, forced, name):
    policy = _policy(name)
    plain, _ = trace(model, prompts, forced, None)
    steps, pair = trace(model, prompts, forced, policy)
    decode_time = is_decode_time(pair.presses[0])  # evicts along the chain: the lanes' own tests check counts
    for t, ((p0, _), (p, _)) in enumerate(zip(plain, steps)):
        if decode_time:  # one unpadded reference side per document, on the lanes' stock kernels: the
            # batched reference's distributions up to float32 rounding (kvdiverge.engine.llm.decode_pair)
            gap = (p - p0).abs().max().item()
            assert gap <= REFERENCE_TOL, f"{name}: the reference side changed at step {t + 1} by {gap:.3g}"
        else:
            assert torch.equal(p, p0), f"{name}: the reference side changed at step {t + 1}"
    for d, ids in enumerate(prompts):
        n = len(ids)
        alone, pair_alone = trace(model, [ids], forced[d : d + 1], policy, doc_ids=[d])
        if not decode_time:
            kept = pair.kept_counts[d]
            check_kept(kept, pair.expected[d], model.config, pair.presses[d], n)
            if name in PROMISED:
                assert pair.expected[d] is not None, f"{name} promises no kept count"
            if policy.takes_ratio:
                assert kept.double().mean() < n, f"{name} kept all {n} positions at ratio 0.5"
            assert torch.equal(pair_alone.kept_counts[0], kept), f"{name}: document {d} keeps other counts alone"
        rows = slice(d * R, (d + 1) * R)
        for t, ((p, q), (pa, qa)) in enumerate(zip(steps, alone)):
            for batched, single in ((p[rows], pa), (q[rows], qa)):
                live = single > -13.8  # probability > 1e-6
                gap = (batched - single).abs()[live].max().item()
                assert gap <= BATCH_TOL, f"{name}: document {d} step {t + 1} differs by {gap:.2e} in a batch"
    if policy.takes_ratio:
        # a decode-time pair decodes each document in its own lane, unpadded: compare it with one document
        control, _ = (
            trace(model, prompts[:1], forced[:1], _policy(name, ratio=0.0))
            if decode_time
            else trace(model, prompts, forced, _policy(name, ratio=0.0))
        )
        same = (
            trace(model, prompts, forced, PressPolicy("eager", RATIO0_SAME[name]()))[0] if name in RATIO0_SAME else None
        )
        for t, (p, q) in enumerate(control):
            tv = 0.5 * (p.exp() - q.exp()).abs().sum(-1)
            if same is not None:
                assert torch.equal(q, same[t][1]), f"{name} at ratio 0: not the eager prefill's kernel at step {t + 1}"
            else:
                assert torch.equal(p, q) and tv.max().item() == 0.0, (
                    f"{name} at ratio 0: TV {tv.max():.2e} at step {t + 1}"
                )


def check_refused(model, prompts, name, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a hub press fails at once, offline
    spec = press_status.test_spec(name)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        import kvdiverge

        with pytest.raises(PressError) as err:
            kvdiverge.measure(
                model, None, {"p": prompts[0]}, {name: spec}, max_new_tokens=T, replicates=R, progress=False
            )
    finally:
        handle.remove()
    assert calls == [], f"{name}: the model ran before the refusal"
    sentence = press_status.spec_refusal(spec, model)
    press = press_from_spec({"press": name, "params": spec["params"]}, spec.get("compression_ratio"), "press")
    if name == "PerLayerCompressionPress" and model.config.num_hidden_layers == 6:  # one ratio per layer of 2
        assert err.value.problem == sentence and "the model has 6 layers" in sentence
        return
    if sentence == registry.sliding_refusal(press, model.config):  # the Gemma 3 miniature: for its sliding layers
        assert err.value.problem == sentence and sentence.startswith("the model has 2 full-attention and 4 sliding")
        assert name in sentence and press_status.spec_refusal(spec) != sentence
        return
    assert err.value.problem == sentence and REASONS[name] in sentence, (name, sentence)
    assert name in sentence
    # kvpress alone cannot run it here: it fails with the error of KVPRESS_FAILS; CAMPress runs, decode-time
    press = press_from_spec({"press": name, "params": spec["params"]}, spec.get("compression_ratio"), "press")
    from transformers import DynamicCache

    def prefill():
        with torch.inference_mode(), press(model):
            model(input_ids=torch.tensor([prompts[0]]), past_key_values=DynamicCache(), use_cache=True)

    try:
        if name == "CAMPress":
            prefill()
            assert is_decode_time(press) and sentence == registry.ROWS["CAMPress"].refused
        else:
            gemma = model.config.model_type == "gemma3_text" and name in ("KVzipPress", "KVgradPress")
            with pytest.raises(ValueError if gemma else KVPRESS_FAILS[name]):  # kvpress: "not supported for Gemma3"
                prefill()
    finally:
        for module in model.modules():  # head-wise presses leave their masks on the attention modules
            if getattr(module, "masked_key_indices", None) is not None:
                module.masked_key_indices = None


def test_every_kvpress_press_has_a_row():
    import kvpress

    exported = {
        n
        for n in kvpress.__all__
        if isinstance(getattr(kvpress, n), type) and issubclass(getattr(kvpress, n), kvpress.BasePress)
    } - {"BasePress", "ScorerPress"}
    missing = sorted(exported - set(registry.ROWS))
    assert missing == [], f"kvpress presses without a row: {missing}"
    assert all(registry.ROWS[n].name == n for n in exported)
    assert set(REASONS) >= {n for n in registry.ROWS if press_status.status(n) == "refused"}


def test_a_row_of_the_adapter_registry_decides(monkeypatch):
    import kvpress

    class EveryStepPress(kvpress.KnormPress):
        """A user's press without a row: a prefill score-based press, measured."""

    press = EveryStepPress(compression_ratio=0.5)
    assert registry.refusal(press) is None and not is_decode_time(press)
    assert registry.kept_promise(press, 100) == 50  # a ScorerPress: compute_n_kept(100, 0.5)
    row = PressAdapter(
        "EveryStepPress",
        refused="EveryStepPress is refused by its row.",
        decode_time=True,
        promise=None,
        rerotates=True,
        prefill="two",
    )
    monkeypatch.setitem(registry.ROWS, "EveryStepPress", resolve(EveryStepPress, {row.name: row}))
    assert registry.refusal(press) == "EveryStepPress is refused by its row."
    assert is_decode_time(press) and is_decode_time(kvpress.ComposedPress([press]))
    assert registry.kept_promise(press, 100) is None
    assert registry.generation_start(press, 100, 50) == 50 and not registry.shares_prefill(press)
    knorm = PressAdapter("KnormPress", refused="Knorm is refused.")
    monkeypatch.setitem(registry.ROWS, "KnormPress", resolve(kvpress.KnormPress, {knorm.name: knorm}))
    assert press_status.status("KnormPress") == "refused"
    assert press_status.spec_refusal(press_status.test_spec("KnormPress")) == "Knorm is refused."


@pytest.mark.miniature
def test_conditional_refusals_follow_the_parameters():
    ok = {"press": "DMSPress", "params": {"press": {"press": "KnormPress"}, "threshold": -1.0}}
    assert press_status.spec_refusal(ok) is None  # head-wise, measured
    assert press_status.spec_refusal({**ok, "params": {**ok["params"], "decoding": True}}) is None  # decode-time DMS
    assert "params.threshold" in press_status.spec_refusal(
        {"press": "DMSPress", "params": {"press": {"press": "KnormPress"}}}
    )
    finch = Policy.from_config("finch", {"press": "FinchPress", "compression_ratio": 0.5, "delimiter_token_id": 7})
    assert finch.build_press(100).delimiter_token_id == 7
    from kvdiverge.models.standins import MINIATURE, random_model

    tiny = random_model(MINIATURE["llama-3.1-8b"])  # 2 layers
    per_layer = {
        "press": "PerLayerCompressionPress",
        "params": {"press": {"press": "KnormPress"}, "compression_ratios": [0.5] * 3},
    }
    assert "it has 3, the model has 2 layers" in press_status.spec_refusal(per_layer, tiny)
    assert press_status.spec_refusal(per_layer) is None  # without the model: only what the parameters tell
    stats = {"press": "ExpectedAttentionStatsPress", "compression_ratio": 0.5, "params": {"stats_folder": "/x"}}
    assert press_status.spec_refusal(stats) is None
    prefill_only = {
        "press": "PrefillDecodingPress",
        "params": {"prefilling_press": {"press": "KnormPress"}},
        "compression_ratio": 0.5,
    }
    assert press_status.spec_refusal(prefill_only) is None


@pytest.mark.miniature
def test_a_kvpress_error_during_the_prefill_names_the_press(model, prompts):
    from kvdiverge.engine.runner import Document, run_documents

    if model.config.model_type == "gemma3_text":
        pytest.skip("FinchPress re-rotates kept keys: refused before any work on a model with sliding layers")

    # Finch with a delimiter id that is not in the prompt finds no window: kvpress fails with a bare assert
    policy = Policy.from_config("finch", {"press": "FinchPress", "compression_ratio": 0.5, "delimiter_token_id": 510})
    with pytest.raises(
        PressError,
        match=r"policy 'finch' \(FinchPress\): kvpress failed during the prefill "
        r"with AssertionError: window_size must be provided",
    ):
        run_documents(
            model,
            [Document("d", prompts[0])],
            policy,
            Sampling(T=2, replicates=1, decoding=Decoding(temperature=1.0, top_p=1.0), seed=0, model_name="m"),
            RunOptions(batch_documents=1),
        )


def test_the_docs_press_table_is_the_registry():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "presses.md").read_text(encoding="utf-8")
    start, end = "<!-- press-table:start -->\n", "\n<!-- press-table:end -->"
    assert start in readme and end in readme
    section = readme[readme.index(start) + len(start) : readme.index(end)]
    assert section == press_status.press_table(), "regenerate it: python -m kvdiverge.engine.presses.status"


def test_refusal_sentences_name_models_by_ids_a_model_can_have():
    """A model id in a refusal is one a loaded model's name_or_path can equal: owner/name, one slash."""
    import re

    for name, row in registry.ROWS.items():
        for sentence in filter(None, [row.refused, *row.required.values()]):
            assert "//" not in sentence, f"{name}: {sentence}"
    duo = registry.ROWS["DuoAttentionPress"].refused
    assert "meta-llama/Meta-Llama-3.1-8B-Instruct, mistralai/Mistral-7B-Instruct-v0.2" in duo
    # the Gradient models kvpress misspells are named as unreachable, not as supported
    assert re.search(r"published only for [^;]*\(on_the_fly", duo) and "gradientai" not in duo.split(";")[0]


HUB_PRESSES = {
    "QFilterPress": "nthngdy/{name}_qfilt",
    "KVzapPress": "nvidia/KVzap-mlp-{name}",
    "FastKVzipPress": "Jang-Hyun/Fast-KVzip",
    "RestoreKVPress": "higokri/RestoreKV-{name}",
}


@pytest.mark.parametrize("name", sorted(HUB_PRESSES))
def test_hub_presses_are_refused_as_their_sentence_says_with_a_cached_copy_too(name, tmp_path, monkeypatch):
    """The sentence of a press that loads its own hub weights says what holds: refused, whatever
    the cache holds; checked with a cache directory that has the repository's folder."""
    import huggingface_hub

    repo = HUB_PRESSES[name].format(name="Llama-3.1-8B-Instruct")
    snapshot = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    sentence = registry.ROWS[name].refused
    assert (
        "whether or not a copy is in the Hugging Face cache" in sentence
        and "HF_HUB_OFFLINE=1 changes nothing" in sentence
    )
    press = press_from_spec(press_status.test_spec(name), None, name)
    assert registry.refusal(press) == sentence


def _shared_rows():
    """Measured rows whose presses share their prefill forward and evict at prefill only."""
    return [
        pytest.param(name, id=name)
        for name in sorted(registry.ROWS)
        if not registry.ROWS[name].refused
        and registry.ROWS[name].prefill == "shared"
        and not registry.ROWS[name].decodes(press_status.test_spec(name))
    ]


def _same_prefill(a, b) -> bool:
    return (
        torch.equal(a.ev_logits, b.ev_logits)
        and torch.equal(a.ref_logits, b.ref_logits)
        and len(a.ev.layers) == len(b.ev.layers) == len(a.ref.layers)
        and all(
            torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
            for x, y in zip(a.ev.layers + a.ref.layers, b.ev.layers + b.ref.layers)
        )
        and all(torch.equal(x, y) for x, y in zip(a.keep, b.keep))
    )


@pytest.mark.miniature
@pytest.mark.parametrize("name", _shared_rows())
def test_shared_prefill_equals_own(model, prompts, name):
    """One forward for several presses gives each the caches, masks and logits of its own prefill, bit for bit.

    The press sits between a head-wise press (its masks) and a press that draws from torch's
    generator, so the hand-over of caches, masks and generator state between presses is tested.
    """
    from kvdiverge.engine.llm.prefill import prefill, prefill_seed, prefill_shared, seeded
    from kvdiverge.engine.llm.twin import evicted_twin

    if press_status.status(name, model) == "refused":
        pytest.skip(f"{name} is refused on this miniature")
    ids = torch.tensor(prompts[1])
    n = len(prompts[1])
    seed = prefill_seed(0, "miniature", "doc1")
    policies = [_policy("AdaKVPress"), _policy(name), _policy("LeverageScorePress")]
    twin = evicted_twin(model)
    with torch.inference_mode():
        with seeded(seed, "cpu"):
            shared = prefill_shared(twin, ids, [p.build_press(n) for p in policies])
        own = []
        for p in policies:
            with seeded(seed, "cpu"):
                own.append(prefill(model, evicted_twin(model), ids, p.build_press(n)))
    assert shared is not None and [s.forwards for s in shared] == [1, 0, 0]
    for p, s, o in zip(policies, shared, own):
        assert _same_prefill(s, o), f"{p.name}: the shared prefill differs from its own beside {name}"
    assert not all(k.all() for k in shared[0].keep), "AdaKVPress masked nothing"
    ev, ref = shared[1].ev.layers, shared[1].ref.layers
    changed = any(e.keys.shape != r.keys.shape or not torch.equal(e.keys, r.keys) for e, r in zip(ev, ref))
    if policies[1].takes_ratio:  # at ratio 0.5 (a threshold press may keep everything on a short prompt)
        assert changed or not all(k.all() for k in shared[1].keep), f"{name} left the cache as it was"
