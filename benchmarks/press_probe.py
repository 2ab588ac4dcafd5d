"""Every press of the registry on the embedded model: status, p_div, and the reference side untouched.

One ~200-token chat prompt on SmolLM2-135M (the embedded GGUF model,
:data:`kvdiverge.models.embedded.EMBEDDED_MODEL`), ``T = 4`` new tokens, ``R = 2`` replicates,
each press's test instance from the registry (:func:`kvdiverge.engine.presses.status.test_spec`:
``compression_ratio=0.5`` where the press takes one, SnapKV or Knorm inside wrappers).

For each measured press: ``p_div`` (the probability that the coupled chains diverge within
``T``) from :func:`kvdiverge.measure`, and a check on a kernel pair with the greedy tokens of
a no-press pair forced on both sides that the reference log-distributions at every step are
exactly those of the no-press pair. Refused presses print the start of their sentence.

Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/press_probe.py`` (about 2 minutes on one core).
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from kvdiverge.engine.core.sampling import Decoding

T, R = 4, 2


def prompt_ids(tokenizer) -> list[int]:
    """A chat prompt of about 200 tokens (an address to summarise)."""
    text = (
        "Fellow citizens, we meet today to speak of the river, the harvest and the roads that join our towns. "
    ) * 8 + "\nSummarize the speech in one sentence."
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])


def reference_untouched(model, ids: list[int], policy) -> bool:
    """True when the reference side of ``policy``'s pair equals a no-press pair's at every step, exactly."""
    from kvdiverge.engine.llm.llm_pair import LLMKernelPair

    def trace(press, expected):
        pair = LLMKernelPair(model, ids, press, decoding=Decoding(temperature=1.0), expected_kept=expected)
        steps = [pair.start(1)]
        for _ in range(T - 1):
            x = steps[-1][0].argmax(-1)
            steps.append(pair.advance(x, x))
        return [p for p, _ in steps]

    press = policy.build_press(len(ids))
    plain, pressed = trace(None, None), trace(press, policy.expected_kept(len(ids), press))
    return all(torch.equal(a, b) for a, b in zip(plain, pressed))


def main() -> None:
    import kvdiverge
    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses import status as press_status
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.models.embedded import EMBEDDED_MODEL
    from kvdiverge.models.loading import load_model

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    model, tokenizer = load_model(EMBEDDED_MODEL)
    ids = prompt_ids(tokenizer)
    print(f"prompt: {len(ids)} tokens, T = {T}, R = {R}\n")
    print("| press | status | p_div | kept | reference untouched |")
    print("|---|---|---|---|---|")
    for name in sorted(press_status.ROWS):
        spec = press_status.test_spec(name)
        if name == "PerLayerCompressionPress":  # one ratio per layer of this model, mean 0.5
            spec["params"]["compression_ratios"] = [0.25, 0.75] * (model.config.num_hidden_layers // 2)
        reason = press_status.spec_refusal(spec, model)
        if reason:
            print(f"| {name} | refused | | | {reason[:90].replace('|', '/')}... |")
            continue
        start = time.perf_counter()
        try:
            m = kvdiverge.measure(
                model, tokenizer, {"p": ids}, {name: spec}, max_new_tokens=T, replicates=R, progress=False, bootstrap=50
            )
            untouched = reference_untouched(model, ids, Policy.from_config(name, spec))
        except (PressError, ValueError) as exc:
            print(f"| {name} | error | | | {type(exc).__name__}: {str(exc)[:90]} |")
            continue
        row = m.summary.row(0, named=True)
        print(
            f"| {name} | measured | {row['p_div']:.2f} | {row['kept_fraction']:.2f} | "
            f"{'yes' if untouched else 'NO'} ({time.perf_counter() - start:.1f} s) |",
            flush=True,
        )
    rerotation_positions(model, tokenizer, ids)


def rerotation_positions(model, tokenizer, ids) -> None:
    """KeyRerotationPress with the evicted side's positions from the prompt length instead of the cache length."""
    import kvdiverge
    from kvdiverge.engine.llm import llm_pair
    from kvdiverge.engine.presses import status as press_status

    spec, kept_start = press_status.test_spec("KeyRerotationPress"), llm_pair.generation_start
    llm_pair.generation_start = lambda press, prompt_len, cache_len: int(prompt_len)
    try:
        m = kvdiverge.measure(
            model,
            tokenizer,
            {"p": ids},
            {"rerotation": spec},
            max_new_tokens=T,
            replicates=R,
            progress=False,
            bootstrap=50,
        )
    finally:
        llm_pair.generation_start = kept_start
    row = m.summary.row(0, named=True)
    print(
        f"\nKeyRerotationPress with generated positions from the prompt length ({len(ids)}) instead of the "
        f"cache length: p_div = {row['p_div']:.2f}"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
