"""Measure presses in one call: the Python front door, ``kvdiverge.measure``.

:func:`measure` runs prompts through the same engine (:func:`kvdiverge.engine.runner.run_policies`),
estimators and analyses (:mod:`kvdiverge.estimation.tables`) as the workflow, for one model and any
number of presses on the same prompts, with common random numbers (the seeds derive from
(seed, model name, prompt id, replicate), never from the press). It returns a
:class:`Measurement` holding the same tables as ``results/trajectories``,
``results/estimates`` and ``results/analysis``.

Example (a notebook)::

    import kvdiverge, kvpress
    from kvdiverge.models.loading import EMBEDDED_MODEL, load_model
    model, tokenizer = load_model(EMBEDDED_MODEL)
    m = kvdiverge.measure(model, tokenizer, ["Explain KV caches to a child."] * 2,
                          {"snapkv": kvpress.SnapKVPress(compression_ratio=0.5, window_size=8)},
                          max_new_tokens=8, replicates=2)
    m.summary

The mathematics and column names: ``docs/estimators.md``; the tables: ``docs/internals.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvdiverge.doors.llamacpp import is_llama_policies
from kvdiverge.doors.measuring import check_keywords
from kvdiverge.doors.plan import OPTIONS, Plan, build_plan, check_model, plan, run_plan
from kvdiverge.doors.results import Measurement
from kvdiverge.settings.checks import vocab_size

__all__ = ["Measurement", "Plan", "measure", "plan"]


def measure(
    model,
    tokenizer,
    prompts,
    presses,
    *,
    max_new_tokens: int = 32,
    replicates: int = 4,
    seed: int = 0,
    window: int = 8,
    instruction: str | None = None,
    system: str | None = None,
    windows: Mapping[str, Sequence[int]] | None = None,
    bootstrap: int = 2000,
    confidence: float = 0.95,
    model_name: str | None = None,
    split: str = "measure",
    eos_ids: Sequence[int] | None = None,
    progress: bool = True,
    batch_documents: int | None = None,
    memory_budget_gb: float | None = None,
    ratios: Sequence[float] | None = None,
    budgets: Sequence[int] | None = None,
    caches: Mapping[str, Mapping[str, Any]] | None = None,
    cache_ratios: Sequence[float] | None = None,
    teacher_tokens: int | None = None,
    teacher_target: str | None = None,
    task: str | Mapping[str, Any] | None = None,
    **decoding: float,
) -> Measurement:
    """Measure how each press changes what ``model`` generates on ``prompts``.

    Every press runs on the same prompts with common random numbers, through the
    workflow's engine (:func:`kvdiverge.engine.runner.run_policies`) and table functions
    (:mod:`kvdiverge.estimation.tables`): per prompt and replicate, an agreement chain of the
    full-cache and the compressed-cache generation under a stepwise maximal coupling,
    and one residual branch after their first divergence (``docs/estimators.md``).

    Parameters
    ----------
    model : transformers.PreTrainedModel or llama_cpp.Llama
        Causal LM in eval mode that kvpress supports (any that transformers loads); a
        ``llama_cpp.Llama`` for llama.cpp cache policies.
    tokenizer : transformers tokenizer or None
        Renders text prompts with the chat template; may be None for token-id prompts.
    prompts : sequence or mapping
        Strings (rendered as the workflow does: :func:`kvdiverge.config.inputs.prepare_documents`) or token-id
        sequences (used as they are); a mapping names them (ids enter the seeds).
    presses : mapping of str to press, policy entry or PressSource
        kvpress press objects (the user's own ``BasePress`` subclasses too), config policy
        entries (``{"press": "SnapKVPress", "compression_ratio": 0.5}``), or policies;
        see :func:`kvdiverge.config.inputs.prepare_presses`. Or llama.cpp KV cache types
        (:class:`kvdiverge.engine.llamacpp.caches.LlamaCache`), each measured against the full f16
        cache on a ``llama_cpp.Llama`` (:mod:`kvdiverge.doors.llamacpp`: the coupled run alone;
        a frontier, a task or the teacher-forced pass is refused).
    max_new_tokens : int
        Horizon ``T`` (tokens = steps).
    replicates : int
        ``R`` coupled replicates per prompt (>= 2 for standard errors and variances).
    seed : int
        Master seed.
    window : int
        ``W``, divergence-aligned window width (lags) of the §4 interval.
    instruction, system : str, optional
        Appended instruction and system message of text prompts.
    windows : mapping of str to (a, b), optional
        Named lag windows of the §6 branch-aligned TV (adds ``btv_<name>`` columns): integers
        ``1 <= a <= b <= max_new_tokens - 1`` (:func:`kvdiverge.settings.checks.window_problems`).
    bootstrap : int
        Document-bootstrap resamples of the pooled intervals.
    confidence : float
        Interval coverage.
    model_name : str, optional
        ``model`` column, enters the seeds; default the model's ``name_or_path`` basename.
    split : str
        ``split`` column (enters the bootstrap seeds).
    eos_ids : sequence of int, optional
        End-of-sequence ids; default from ``model.generation_config``.
    progress : bool
        A tqdm bar per press on stderr.
    batch_documents : int or None
        Documents decoded together per forward (rows = documents x ``replicates``);
        None lets the memory planner choose (:func:`kvdiverge.engine.runner.plan_documents`,
        once per call, for every press).
        Grouping changes results only by rounding; 1 reproduces a workflow shard that
        holds one document exactly.
    memory_budget_gb : float or None
        Memory budget of the planner (GiB); None: 80% of free CUDA memory, 4 GiB on CPU.
    ratios, budgets : sequence, optional
        Measure a frontier: every press at every compression ratio (and fixed budget),
        named ``<press>@<ratio>`` (``<press>@b<budget>``), beside the noise floor (one is
        added when no ``PermutationPress`` is given); :func:`kvdiverge.config.inputs.frontier_presses`. Then
        :meth:`Measurement.frontier` and :meth:`Measurement.plot_frontier` draw it.
    caches, cache_ratios : optional
        Quantized caches of the frontier by label (``{"int4": {"backend": "quanto", "nbits": 4,
        "q_group_size": 64, "residual_length": 32}}``; a policy's ``cache: quantized`` keys, the
        same defaults), each alone (named by its label) and after each press (a policy entry)
        at each of ``cache_ratios`` above 0 (``<press>@<ratio>+<cache>``; default: 0 and every
        ratio; 0 is the cache alone), as a config's ``frontier.caches``. The frontier then
        ranks every curve on the KV bytes per prompt token it stores.
    teacher_tokens : int, optional
        Also run the teacher-forced pass (:func:`kvdiverge.doors.screening.run_screen`): the full-cache
        model's greedy continuation of each prompt, this many tokens (an integer >= 1, the
        config's ``teacher_forced.length``; cut to what the model context leaves after each
        prompt), fed to both sides; its headline columns (``kld_mean``, ``ppl_ratio``,
        ``same_top_p``, ``delta_p_rms``) join the summary and :attr:`Measurement.teacher_forced`
        holds its tables. Checked before the coupled run. None (default): not run, unless
        ``teacher_target`` is given (then :data:`kvdiverge.engine.llm.teacher.DEFAULT_LENGTH` tokens).
    teacher_target : str, optional
        What the teacher-forced pass scores (the config's ``teacher_forced.target``): ``"continuation"``
        (default) or ``"reconstruction"``: each prompt's own text (its tokens without special tokens; a
        token-id prompt as given), fed after the prompt and the instruction "Repeat the previous context
        exactly." in the model's chat template (KVzip's context reconstruction), its first
        ``teacher_tokens`` tokens scored; needs the tokenizer, and no ``task``. Either target also
        marks LongPPL's key tokens at their defaults (:mod:`kvdiverge.estimation.key_tokens`).
    task : str or mapping, optional
        A task score beside the measures (:mod:`kvdiverge.data.tasks`): ``"niah"`` or a
        config ``task`` block (``{"name": "niah", "depths": [0, 50, 100], "question":
        "after"}``; without ``name``, ``{}`` included, the default ``niah``), checked by the
        config's rules (:func:`kvdiverge.settings.checks.check_task`).
        Text prompts become the task's prompts; needs ``temperature=0`` (the answers are the
        greedy coupled run's own), and with ``question: after`` presses that act on the prefill
        only. :attr:`Measurement.task` then holds the
        workflow's task tables (``documents``, ``accuracy``, ``correlations``, ``auc``:
        :func:`kvdiverge.data.tasks.tables.task_tables`).

    **decoding : float or int
        The decoding transform of both generations, by name
        (:func:`kvdiverge.engine.core.sampling.decoding_options`, ranges as
        :class:`kvdiverge.engine.core.sampling.Decoding`): ``temperature`` (default 0.7; 0 is
        greedy), ``top_k`` (default 0, none), ``top_p`` (default 0.95), ``repetition_penalty``
        (CTRL's, as ``model.generate``'s, :func:`kvdiverge.engine.core.decoding.penalize_repeats`;
        each side penalizes its own context; default 1, none) and ``min_p`` (min-p truncation
        after top-p; default 0, none). Another name raises ``TypeError``, as for any unknown
        keyword.

    Returns
    -------
    Measurement

    Notes
    -----
    ``measure(model, tokenizer, prompts, presses, **settings)`` is
    ``plan(prompts, presses, tokenizer=tokenizer, **settings).run(model)`` (:func:`kvdiverge.plan`): every
    check that needs no weights is the plan's, the model's own (vocabulary, context) the run's.

    Raises
    ------
    ValueError
        Bad prompts or presses (see :func:`kvdiverge.config.inputs.prepare_documents`, :func:`kvdiverge.config.inputs.prepare_presses`),
        a ``model`` that is not one (:func:`kvdiverge.settings.checks.model_problem`), token ids
        (of the prompts or ``eos_ids``) outside the model's vocabulary, a prompt shorter than a
        press needs or too long for the model context, a setting the config would refuse (NaN, out
        of range, a fraction for a count, ``instruction`` or ``system`` not a string:
        :func:`kvdiverge.settings.checks.check_settings`), a ``model_name`` or ``split`` that is
        not a non-empty string, ``windows`` that are not lag windows, frontier values of the
        wrong kind (a single number for ``ratios``; ``cache_ratios`` without ``caches``:
        :func:`kvdiverge.config.frontier.spec_problems`) or a bad ``task``, each before any
        forward, in one sentence naming the argument, the value and what is allowed.
    kvdiverge.engine.core.errors.CompressionError
        A press that promises compression (``compression_ratio > 0``) but does not keep
        the promised number of positions. A press that promises nothing, keeps every
        position and leaves the kernel as the full cache's (TV 0 at every step, under
        sampling) runs and is reported (``summary['untouched']``, and a warning); chains that
        never part under this decoding, from a press that compressed or under greedy decoding,
        are ``summary['no_divergence']``, without a warning.
    """
    settings = {k: v for k, v in locals().items() if k in OPTIONS}
    check_keywords(decoding)  # an unknown keyword first, as Python's own
    if is_llama_policies(presses):  # llama.cpp cache types: the run checks the llama_cpp.Llama
        return run_plan(build_plan(prompts, presses, tokenizer, {**settings, **decoding}), model, stacklevel=3)
    eos = check_model(model, eos_ids)  # the model is in hand: its refusals come before the plan's
    planned = build_plan(prompts, presses, tokenizer, {**settings, **decoding}, vocab=vocab_size(model))
    return run_plan(planned, model, stacklevel=3, eos=eos)
