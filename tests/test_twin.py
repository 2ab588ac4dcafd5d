"""The evicted side's module tree shares every tensor with the reference model and keeps press state to itself."""

import kvpress
import pytest
import torch
from transformers import DynamicCache

from kvdiverge.engine.llm.twin import evicted_twin, shares_weights
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = pytest.mark.miniature


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["llama-3.1-8b"])


def _prefill(model, ids, press=None):
    cache = DynamicCache()
    if press is None:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def _step(model, cache, n):
    return model(
        input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[n]])
    ).logits


def test_twin_shares_every_tensor_and_no_module(model):
    twin = evicted_twin(model)
    assert shares_weights(model, twin)
    assert all(a is not b for a, b in zip(model.modules(), twin.modules()))
    assert sum(p.data_ptr() for p in twin.parameters()) == sum(p.data_ptr() for p in model.parameters())


def test_press_state_on_the_twin_never_reaches_the_reference(model):
    ids = torch.randint(0, 100, (1, 40))
    press = kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=8))
    base = _step(model, _prefill(model, ids), 40)
    twin = evicted_twin(model)
    full = _prefill(model, ids)
    _prefill(twin, ids, press)  # sets masked_key_indices on the twin's attention modules
    assert any(getattr(m, "masked_key_indices", None) is not None for m in twin.modules())
    assert torch.equal(_step(model, full, 40), base)
    # the hazard the twin removes: the same press entered on the reference model itself
    full = _prefill(model, ids)
    _prefill(model, ids, press)
    assert not torch.equal(_step(model, full, 40), base)


def test_twin_refuses_a_model_with_hooks(model):
    with kvpress.SnapKVPress(0.5)(model):
        with pytest.raises(ValueError, match="forward hooks of a press"):
            evicted_twin(model)


def test_hooks_of_no_press_are_shared_and_later_hooks_stay_on_their_tree(model):
    calls = []
    handle = model.model.register_forward_pre_hook(lambda module, args: calls.append(module))
    twin = evicted_twin(model)
    handle.remove()
    ids = torch.randint(0, 100, (1, 8))
    model(input_ids=ids)
    twin(input_ids=ids)
    assert calls == [twin.model]  # the recorder saw the twin's forward, not the model's after removal
    with kvpress.SnapKVPress(0.5)(twin):
        assert not any(m._forward_hooks for m in model.modules())
