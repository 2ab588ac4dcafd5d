"""The llama.cpp backend at the doors: a plan of KV cache types, run on a ``llama_cpp.Llama``.

:func:`kvdiverge.measure` and :func:`kvdiverge.plan` take llama.cpp cache policies
(:class:`kvdiverge.engine.llamacpp.caches.LlamaCache`) where they take presses. The plan then measures
each cache type against the full f16 cache (:func:`run_llama_plan`) through
:func:`kvdiverge.engine.llamacpp.run.run_caches` and the unchanged coupling core, estimators and tables.
What the backend does not run is refused in one sentence before any work (:func:`llama_problems`): a
kvpress press beside the caches, a frontier of ratios or budgets, a task, the teacher-forced pass. The cache
types themselves are the measurement's frontier (:func:`cache_points`): each at its bits per element on the
KV-bytes axis, counted from the GGUF file's header (:func:`kvdiverge.config.layers.gguf_kv_sizes`).

Example::

    import llama_cpp
    from kvdiverge.engine.llamacpp.caches import LlamaCache

    llm = llama_cpp.Llama("SmolLM2-135M-Instruct.Q4_1.gguf", n_threads=2, verbose=False)
    m = kvdiverge.measure(llm, tokenizer, prompts, {"q8_0": LlamaCache("q8_0", "q8_0"),
                                                    "q4_0": LlamaCache("q4_0", "q4_0")})
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvdiverge.config.inputs import check_lengths
from kvdiverge.config.layers import gguf_kv_sizes
from kvdiverge.doors import measuring
from kvdiverge.doors.results import Measurement
from kvdiverge.engine.llamacpp.caches import LlamaCache, not_run_sentence
from kvdiverge.engine.llamacpp.context import load_model
from kvdiverge.engine.llamacpp.run import check_policies, provenance, run_caches
from kvdiverge.engine.runner import PolicyRuns
from kvdiverge.estimation.frontier import FrontierPoint
from kvdiverge.settings.checks import eos_id_problems, token_id_problems

__all__ = ["cache_points", "is_llama_model", "is_llama_policies", "llama_problems", "run_llama_plan"]

#: What the llama_cpp backend does not run (a kind of :data:`kvdiverge.engine.llamacpp.caches.NOT_RUN`), by the
#: option that asks for it.
_NOT_RUN = {
    "ratios": "frontier",
    "budgets": "frontier",
    "caches": "quanto",
    "task": "task",
    "teacher_tokens": "teacher",
    "teacher_target": "teacher",
}


def is_llama_policies(presses: Any) -> bool:
    """True when ``presses`` is a mapping with a llama.cpp cache policy among its values."""
    return isinstance(presses, Mapping) and any(isinstance(v, LlamaCache) for v in presses.values())


def is_llama_model(model: Any) -> bool:
    """True for a ``llama_cpp.Llama`` (by its class's module: llama_cpp is not imported here)."""
    return type(model).__module__.split(".")[0] == "llama_cpp"


def llama_problems(presses: Mapping[str, Any], opts: measuring.MeasureOptions) -> list[str]:
    """One sentence per setting of ``opts`` the llama_cpp backend cannot run, and a policy that is no cache type
    (:func:`kvdiverge.engine.llamacpp.run.check_policies`'s sentence)."""
    out = []
    try:
        check_policies(presses)
    except ValueError as exc:
        out.append(str(exc))
    said = set()
    for option, kind in _NOT_RUN.items():
        if getattr(opts, option) is not None and kind not in said:
            said.add(kind)
            out.append(not_run_sentence(option, kind, "llama.cpp cache policies"))
    return out


def cache_points(policies: Mapping[str, LlamaCache]) -> tuple[FrontierPoint, ...]:
    """Each cache type as a frontier point on the KV-bytes axis: every prompt position kept (ratio 0), the cache's
    types as its settings (:meth:`~kvdiverge.engine.llamacpp.caches.LlamaCache.describe`), so that
    :attr:`kvdiverge.doors.results.Measurement.frontier` counts its bits per element
    (:data:`kvdiverge.estimation.kv_bytes.GGML_BITS`) and its KV bytes per prompt token."""
    return tuple(
        FrontierPoint(policy=name, press=None, compression_ratio=0.0, cache=name, cache_settings=cache.describe())
        for name, cache in policies.items()
    )


def run_llama_plan(p, model, stacklevel: int) -> Measurement:
    """Measure a plan of llama.cpp cache policies on ``model``: :meth:`kvdiverge.doors.plan.Plan.run`'s result.

    ``model`` is a ``llama_cpp.Llama`` (its weights shared, its own context unused; the threads are its
    ``n_threads``). Each policy's coupled run pairs a full f16 context with the policy's, one document at a
    time (``batch_documents`` 1). The settings record each policy's cache types, rotation and flash attention
    with the llama.cpp build and the threads.

    Raises
    ------
    ValueError
        A ``model`` that is not a ``llama_cpp.Llama``, prompt token ids or ``eos_ids`` outside its
        vocabulary, or a prompt with ``T`` new tokens longer than its training context: each before any forward.
    """
    if not is_llama_model(model):
        raise ValueError(
            f"model: llama.cpp cache policies ({', '.join(p.sources)}) run on a llama_cpp.Llama, "
            f"got {type(model).__name__}"
        )
    loaded, opts = load_model(model), p.options
    eos = tuple(opts.eos_ids) if opts.eos_ids is not None else loaded.eos_ids
    problems = [q for doc in p.documents for q in token_id_problems(doc.doc_id, doc.input_ids, loaded.n_vocab)]
    problems += eos_id_problems("eos_ids", eos, loaded.n_vocab)
    if problems:
        raise ValueError(problems[0])
    check_lengths(p.documents, {}, opts.max_new_tokens, loaded.context)
    name = opts.model_name or Path(loaded.path).stem
    sampling = opts.sampling(name)
    sampling = sampling.replace(decoding=sampling.decoding.replace(eos_ids=eos))
    threads = int(getattr(model, "n_threads", 1) or 1)
    documents = {d.doc_id: list(d.input_ids) for d in p.documents}
    progress = opts.run_options().progress  # a bar per cache type, as the transformers door's per press
    frame = run_caches(model, p.sources, documents, sampling, threads, split=opts.split, progress=progress)
    record = provenance(p.sources, threads)
    build = {k: v for k, v in record.items() if k not in ("caches", "system_info")}
    settings = opts.recorded(sampling, p.sources, cache_points(p.sources), gguf_kv_sizes(loaded.path)).replace(
        presses={n: {**build, **record["caches"][n]} for n in p.sources}
    )
    result = Measurement.of_run(PolicyRuns(frame, 1, {}), settings, p.sources, eos)
    result.warn_untouched(stacklevel=stacklevel)
    return result
