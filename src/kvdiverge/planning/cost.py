"""The cost of a config's generation work, from the config alone.

Counts, per (model, policy, split) run of :func:`kvdiverge.config.workflow.runs`, the documents,
the forward passes and the token-steps that the trajectory engine performs (:func:`study_cost`),
so that the study estimate of ``docs/benchmarks.md`` and the GPU benchmark's projection come
from one place; the same for the other stages that generate (:func:`stage_costs`): the
teacher-forced pass of every run (:func:`teacher_cost`) and the task sides of a ``prediction``
block (:func:`task_cost`). The command ``kvdiverge cost`` (:mod:`kvdiverge.doors.cli`) prints them
(:func:`format_table`, :func:`format_stages`, :func:`format_hours`)::

    kvdiverge cost config/paper.yaml                 # the coupled runs' table, a line per stage, the sum
    kvdiverge cost config/paper.yaml --rate 5000     # + hours at 5000 token-steps/s

Definitions (estimators.md §2 and §5, :mod:`kvdiverge.engine.core.coupled`):

- A **token-step** is one next-token distribution of one row on one side (the unit of
  ``benchmarks/engine_speed.py``: one token decoded for one sequence). Per replicate the
  agreement chain takes at most ``T`` steps and the residual branch ``T - t*`` steps with
  ``t* >= 1``, so at most ``2T - 1`` steps per side. The engine does about
  ``2T - t*`` (fewer when a chain stops at ``tv = 1``); this module counts the upper
  bound ``2T - 1``, so its figures are upper bounds (by ``(t* - 1) / (2T - 1)``, small
  for the paper's early divergence times). Per document:
  ``token_steps = R x 2 sides x (2T - 1)``.
- A **forward** is one model call. Per document the prompt is prefilled alone under its
  press, once for both caches when the press allows it (its row's ``prefill``,
  :func:`kvdiverge.engine.presses.catalogue.shares_prefill`; for a decode-time policy the
  chain lane's prefill gives the reference's full cache), else twice. Decoding takes at
  most ``2T - 2`` steps (``T - 1`` chain advances after the prefill's first distribution,
  then ``T - t* <= T - 1`` branch advances), each one forward over both sides' rows
  (:class:`kvdiverge.engine.llm.side.JointSides`). With ``B`` documents per forward
  (``generation.batch_documents``, the batching engine), a shard of ``n`` documents
  decodes ``ceil(n / B)`` groups: ``decode_forwards = (2T - 2) x ceil(n / B)`` per shard.

A **decode-time policy** (:func:`kvdiverge.engine.presses.catalogue.is_decode_time`) runs on
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`: the evicted side decodes in lanes of
one document each (one forward per lane per step, not batched across documents; a
press with ``merge_lanes`` decodes a document's lanes as one), and a branch starting at
``t*`` is replayed from a fresh prefill, ``t* - 1`` forwards. Upper bounds per document,
with every replicate in a lane of its own: the reference side decodes by its own
forwards, ``2T - 2`` (one forward per document; all of a group's documents in one where
every prefill evicts), and the evicted side's lanes take ``(R + 1)(T - 1)`` (the chain
lane, then ``R`` branch lanes); ``replay_prefills = R``;
``replay_forwards = replay_token_steps = R (T - 2)``.

The policies of a split run in one job per model, split and shard; those that evict at prefill
only, and decode-time ones whose lanes start from a shared prefill (the sliding window), share each
document's prefill forward in groups of up to ``2R`` (:func:`kvdiverge.engine.runner.run_policies`), and the
controls on a shard's first documents take theirs from those forwards
(:class:`kvdiverge.engine.llm.sharing.PrefillCarry`): the counts here are each run's own, so for them upper bounds. A stage's jobs (:class:`StageCost`) are the workflow's.

Documents per run: ``corpus.documents[split]``; the noise-floor control
(``runs.control``) runs on its first ``runs.control.documents`` documents unless the same
policy is scheduled on that split in full (as :func:`kvdiverge.jobs.documents.shard_documents`
selects them). These are the requested counts: documents excluded at the prompts stage
(too short, too long) lower the real figures slightly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdiverge.config.frontier import FrontierSpec, frontier_points, frontier_split
from kvdiverge.config.workflow import control_documents, runs
from kvdiverge.engine.presses import catalogue
from kvdiverge.io.render import text_table
from kvdiverge.jobs.prediction import PredictionTaskSettings, prediction_sides, reconstruction_config

__all__ = [
    "RunCost",
    "StageCost",
    "format_hours",
    "format_stages",
    "format_table",
    "projected_hours",
    "run_documents_count",
    "stage_costs",
    "study_cost",
    "task_cost",
    "teacher_cost",
    "totals",
]


@dataclass(frozen=True)
class RunCost:
    """Cost of one (model, policy, split) run of the generation stage.

    Attributes
    ----------
    model, policy, split : str
        The run.
    documents : int
        Documents the run generates (requested count).
    shards : int
        Shards of the run (config ``shards``).
    replicates : int
        ``R``.
    T : int
        Horizon (steps).
    batch_documents : int
        Documents per forward ``B`` assumed for ``decode_forwards``.
    prefill_forwards : int
        ``documents`` (both prompt caches from one forward), or ``2 x documents`` for a
        press with a forward of its own and for a decode-time policy.
    decode_forwards : int
        Upper bound ``(2T - 2) x sum over shards of ceil(n_shard / B)`` (both sides in
        one forward per step), plus the evicted lanes of a decode-time policy.
    token_steps : int
        Upper bound ``documents x R x 2 x (2T - 1)``.
    decode_time : bool
        The policy evicts while generating (replayed branches).
    replay_prefills, replay_forwards, replay_token_steps : int
        Upper bounds of the branch replays of a decode-time policy (module docstring); 0 otherwise.
    stage : str
        ``"coupled"`` (the trajectory shards), ``"teacher-forced"`` or ``"task <side>"`` (a task side
        of the prediction study, ``"task niah-after"``).
    """

    model: str
    policy: str
    split: str
    documents: int
    shards: int
    replicates: int
    T: int
    batch_documents: int
    prefill_forwards: int
    decode_forwards: int
    token_steps: int
    decode_time: bool = False
    replay_prefills: int = 0
    replay_forwards: int = 0
    replay_token_steps: int = 0
    stage: str = "coupled"

    @property
    def forwards(self) -> int:
        """Prefill plus decode forwards, replays included."""
        return self.prefill_forwards + self.decode_forwards + self.replay_prefills + self.replay_forwards


def run_documents_count(config: dict[str, Any], policy: str, split: str) -> int:
    """Documents one (policy, split) run generates, from the config alone.

    Raises
    ------
    KeyError
        If ``corpus.documents.<split>`` is missing (the message names the key).
    """
    try:
        n = int(config["corpus"]["documents"][split])
    except KeyError:
        raise KeyError(f"config key corpus.documents.{split} is missing") from None
    limit = control_documents(config, policy, split)  # the controls' counts (none, noise floor)
    return n if limit is None else min(n, limit)


def _batch_documents(config: dict[str, Any], batch_documents: int | None) -> int:
    """``B`` from the argument, else ``generation.batch_documents`` when an integer, else 1."""
    if batch_documents is None:
        value = (config.get("generation") or {}).get("batch_documents")
        batch_documents = value if isinstance(value, int) and not isinstance(value, bool) else 1
    if int(batch_documents) < 1:
        raise ValueError(f"batch_documents must be >= 1, got {batch_documents}")
    return int(batch_documents)


def _entry(spec) -> Any:
    """A policy entry as the press catalogue reads it: a press object (the noise floor a task side adds,
    :func:`kvdiverge.config.inputs.frontier_presses`) by its class name."""
    return spec if spec is None or isinstance(spec, Mapping) else {"press": type(spec).__name__}


def _prefills(spec) -> int:
    """Prefill forwards per document of a policy's press: 1 where one forward gives both caches, else 2."""
    try:
        return 1 if catalogue.shares_prefill(_entry(spec)) else 2
    except (KeyError, TypeError, ValueError, LookupError):  # no press of its own (a cache alone), or unknown: the bound
        return 2


def study_cost(config: dict[str, Any], batch_documents: int | None = None) -> list[RunCost]:
    """Cost of every run of a validated config (:func:`kvdiverge.config.workflow.load_config`).

    Parameters
    ----------
    config : dict
        Validated workflow config (``corpus.documents``, ``runs``, ``decoding.max_new_tokens``,
        ``replicates``, ``shards``).
    batch_documents : int, optional
        Documents per forward ``B``; default ``generation.batch_documents`` when the config
        gives an integer, otherwise 1 (one document per forward).

    Returns
    -------
    list[RunCost]
        One entry per run, in :func:`kvdiverge.config.workflow.runs` order.

    Raises
    ------
    ValueError
        If ``batch_documents < 1``.
    """
    B = _batch_documents(config, batch_documents)
    grid = _Grid(int(config["replicates"]), int(config["decoding"]["max_new_tokens"]), B, int(config["shards"]))
    return [
        _coupled_run(
            model, policy, split, config["policies"].get(policy), run_documents_count(config, policy, split), grid
        )
        for model, policy, split in runs(config)
    ]


@dataclass(frozen=True)
class _Grid:
    """What the runs of one stage share: replicates ``R``, horizon ``T``, documents per forward ``B``, shards."""

    R: int
    T: int
    B: int
    shards: int


def _coupled_run(model: str, policy: str, split: str, spec, n: int, grid: _Grid, stage: str = "coupled") -> RunCost:
    """The cost of one coupled run of ``n`` documents under the policy entry ``spec`` (module docstring)."""
    R, T = grid.R, grid.T
    per_shard = [len(range(i, n, grid.shards)) for i in range(grid.shards)]
    groups = sum(math.ceil(k / grid.B) for k in per_shard)
    decode_time = catalogue.is_decode_time(_entry(spec))
    steps = max(2 * T - 2, 0) * (n if decode_time else groups)  # decode-time: bounded per document
    return RunCost(
        model=model,
        policy=policy,
        split=split,
        documents=n,
        shards=grid.shards,
        replicates=R,
        T=T,
        batch_documents=grid.B,
        prefill_forwards=_prefills(spec) * n,
        decode_forwards=steps + ((R + 1) * max(T - 1, 0) * n if decode_time else 0),
        token_steps=n * R * 2 * (2 * T - 1),
        decode_time=decode_time,
        replay_prefills=R * n if decode_time else 0,
        replay_forwards=R * max(T - 2, 0) * n if decode_time else 0,
        replay_token_steps=R * max(T - 2, 0) * n if decode_time else 0,
        stage=stage,
    )


def teacher_cost(config: dict[str, Any]) -> list[RunCost]:
    """Cost of the teacher-forced pass of every run of a validated config (rules ``teacher_forced_<split>``).

    Upper bounds per run, over the run's documents (its coupled run's, :func:`run_documents_count`),
    with ``L = teacher_forced.length`` continuation tokens (cut to what the context leaves): the
    press's prefill forwards as the coupled run counts them (:func:`kvdiverge.engine.presses.catalogue.shares_prefill`;
    a document's prefill is shared by the policies that run on it), then per side one forward
    over the continuation, or ``L - 1`` forwards token by token for a quantized cache or a press
    that evicts while decoding (a sliding window takes one); ``2 L`` token-steps (every position on
    both sides: the reference side's are computed once per document). With ``continuation:
    greedy``, each (model, split) also generates the full-cache greedy continuation of its
    documents once (policy ``"greedy continuation"``: ``L`` forwards and ``L`` token-steps a
    document; with ``corpus``, only a document whose corpus text has ended takes one, not counted).

    Returns
    -------
    list[RunCost]
        One entry per run (``stage="teacher-forced"``, ``T = L``, ``R = 1``, ``B = 1``, one shard), in
        :func:`kvdiverge.config.workflow.runs` order, and the greedy continuations.
    """
    section = config["teacher_forced"]
    L = int(section["length"])
    out, documents = [], {}
    for model, policy, split in runs(config):
        n, spec = run_documents_count(config, policy, split), config["policies"].get(policy)
        stepwise = (spec or {}).get("cache") == "quantized" or catalogue.is_decode_time(spec)
        feed = 0 if L == 1 else 2 * (L - 1) if stepwise else 2
        out.append(_pass_cost((model, policy, split), n, L, _prefills(spec) * n, n * feed, n * 2 * L))
        documents[model, split] = max(n, documents.get((model, split), 0))
    if section.get("continuation") == "greedy":
        for (model, split), n in documents.items():
            out.append(_pass_cost((model, "greedy continuation", split), n, L, n, n * (L - 1), n * L))
    return out


def _pass_cost(run: tuple[str, str, str], n: int, L: int, prefills: int, feed: int, steps: int) -> RunCost:
    """A teacher-forced pass's :class:`RunCost`: the ``(model, policy, split)`` run of ``n`` documents and ``L``
    continuation tokens, its prefill and continuation forwards and its token-steps."""
    model, policy, split = run
    return RunCost(model=model, policy=policy, split=split, documents=n, shards=1, replicates=1, T=L,
                   batch_documents=1, prefill_forwards=prefills, decode_forwards=feed, token_steps=steps,
                   stage="teacher-forced")  # fmt: skip


def task_cost(config: dict[str, Any], batch_documents: int | None = None) -> list[RunCost]:
    """Cost of the task sides of a validated config's ``prediction`` block (rule ``prediction_task``).

    Each side runs, in one job per model, every point of the frontier (its presses at its ratios and
    budgets; with the question inside the prompt, its caches too; the noise floor) greedily on the
    documents of ``prediction.split`` (``corpus.documents``; those that do not take the task are left
    out, so an upper bound), with one replicate and ``T = prediction.max_new_tokens``: coupled runs,
    counted as :func:`study_cost` counts them, with the same ``B``. The points are those
    :func:`kvdiverge.measure` expands (:func:`kvdiverge.config.inputs.frontier_presses`,
    :meth:`kvdiverge.jobs.prediction.PredictionTaskSettings.measure_options`).

    Returns
    -------
    list[RunCost]
        One entry per (model, side, point), ``stage="task <side>"``; empty without a ``prediction`` block.

    Raises
    ------
    ValueError
        If ``batch_documents < 1``.
    """
    # lazy: torch and kvpress load where the points are expanded as kvdiverge.measure expands them;
    # kvdiverge.doors.cli imports this module for --help
    from kvdiverge.config.inputs import frontier_presses

    B = _batch_documents(config, batch_documents)
    out = []
    for model in config["models"] if config.get("prediction") else ():
        for side in prediction_sides(config):
            job = PredictionTaskSettings.from_config(config, model, side)
            options = job.measure_options()
            spec = FrontierSpec(options["ratios"], options["budgets"], options["caches"], options["cache_ratios"])
            points, _ = frontier_presses({k: dict(v) for k, v in job.entries["frontier"]["presses"].items()}, spec)
            n = int(config["corpus"]["documents"][job.split])
            grid = _Grid(1, options["max_new_tokens"], B, 1)
            out += [
                _coupled_run(model, name, job.split, entry, n, grid, f"task {side}") for name, entry in points.items()
            ]
    return out


@dataclass(frozen=True)
class StageCost:
    """Cost of one stage of a config's generation work, summed over its runs (:func:`stage_costs`).

    Attributes
    ----------
    stage : str
        ``"coupled runs"``, ``"teacher-forced pass"`` or ``"task side <side>"``.
    settings : str
        What the stage's runs share, in words (``"T = 16, R = 1, greedy"``).
    jobs : int
        Its jobs: one coupled job per (model, split, shard) and one teacher-forced job per (model, split), as
        the workflow runs them; one reconstruction job per model, one job per model and task side.
    runs : int
        Its (model, policy, split) runs.
    documents : int
        Its document-policy runs.
    prefill_forwards, forwards, token_steps : int
        Sums over its runs (forwards and token-steps with the decode-time replays).
    """

    stage: str
    settings: str
    jobs: int
    runs: int
    documents: int
    prefill_forwards: int
    forwards: int
    token_steps: int

    @classmethod
    def of(cls, stage: str, settings: str, jobs: int, costs: Sequence[RunCost]) -> StageCost:
        """The stage's sums over ``costs``."""
        tot = totals(costs)
        return cls(stage, settings, jobs, tot["runs"], tot["documents"], tot["prefill_forwards"], tot["forwards"],
                   tot["token_steps"] + tot["replay_token_steps"])  # fmt: skip


def stage_costs(config: dict[str, Any], batch_documents: int | None = None) -> list[StageCost]:
    """The cost of every stage that generates: the coupled runs (:func:`study_cost`), the
    teacher-forced pass (:func:`teacher_cost`), the prediction study's reconstruction pass of the
    frontier's runs (:func:`kvdiverge.jobs.prediction.reconstruction_config`, costed as the
    teacher-forced pass with its length an upper bound) and each task side of the prediction study
    (:func:`task_cost`), in that order.

    Raises
    ------
    ValueError
        If ``batch_documents < 1``.
    """
    coupled, teacher = study_cost(config, batch_documents), teacher_cost(config)
    T, R, L = (
        config["decoding"]["max_new_tokens"],
        config["replicates"],
        (config.get("teacher_forced") or {}).get("length", 64),
    )
    models = len(config["models"])
    out = [
        StageCost.of("coupled runs", f"T = {T}, R = {R}", _jobs(coupled), coupled),
        StageCost.of("teacher-forced pass", f"{L} continuation tokens", _jobs(teacher), teacher),
    ]
    rebuilt = reconstruction_config(config)
    if rebuilt:  # the prediction study's reconstruction pass: the frontier's runs, the excerpt's text at most
        points = {(p.policy, frontier_split(config)) for p in frontier_points(config)}
        costs = [c for c in teacher_cost(rebuilt) if (c.policy, c.split) in points]
        length = rebuilt["teacher_forced"]["length"]
        out.append(StageCost.of("reconstruction pass", f"{length} excerpt tokens at most", models, costs))
    sides: dict[str, list[RunCost]] = {}
    for c in task_cost(config, batch_documents):
        sides.setdefault(c.stage, []).append(c)
    for stage, costs in sides.items():
        side = stage.removeprefix("task ")
        out.append(StageCost.of(f"task side {side}", f"T = {costs[0].T}, R = 1, greedy", models, costs))
    return out


def _jobs(costs: Sequence[RunCost]) -> int:
    """The workflow's jobs for ``costs``: one per (model, split, shard) with runs (a teacher-forced run has
    one shard: one job per model and split)."""
    return len({(c.model, c.split, i) for c in costs for i in range(c.shards)})


def totals(costs: Sequence[RunCost]) -> dict[str, int]:
    """Sums over runs: ``runs``, ``documents`` (document-policy runs), ``shards`` (each run's, summed),
    ``prefill_forwards``, ``decode_forwards``, ``forwards``, ``token_steps``, and the
    decode-time policies' ``replay_forwards`` (prefills included) and ``replay_token_steps``."""
    return {
        "runs": len(costs),
        "documents": sum(c.documents for c in costs),
        "shards": sum(c.shards for c in costs),
        "prefill_forwards": sum(c.prefill_forwards for c in costs),
        "decode_forwards": sum(c.decode_forwards for c in costs),
        "forwards": sum(c.forwards for c in costs),
        "token_steps": sum(c.token_steps for c in costs),
        "replay_forwards": sum(c.replay_prefills + c.replay_forwards for c in costs),
        "replay_token_steps": sum(c.replay_token_steps for c in costs),
    }


def projected_hours(
    config: dict[str, Any], token_steps_per_s: float, gpus: int = 1, batch_documents: int | None = None
) -> float:
    """Hours of the generation stage at a measured rate (upper-bound token-steps / rate / GPUs).

    Parameters
    ----------
    config : dict
        Validated workflow config.
    token_steps_per_s : float
        Measured engine rate on one device (token-steps per second, both sides counted).
    gpus : int
        Devices working in parallel (one generation job each).

    Raises
    ------
    ValueError
        If the rate or ``gpus`` is not positive.
    """
    if not token_steps_per_s > 0:
        raise ValueError(f"token_steps_per_s must be > 0, got {token_steps_per_s}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    tot = totals(study_cost(config, batch_documents))
    steps = tot["token_steps"] + tot["replay_token_steps"]
    return steps / float(token_steps_per_s) / gpus / 3600.0


def format_table(costs: Sequence[RunCost]) -> str:
    """A plain-text table of the runs and their totals."""
    head = ("model", "policy", "split", "docs", "shards", "B", "forwards", "token-steps")
    rows = [
        (
            c.model,
            c.policy,
            c.split,
            f"{c.documents}",
            f"{c.shards}",
            f"{c.batch_documents}",
            f"{c.forwards:,}",
            f"{c.token_steps:,}",
        )
        for c in costs
    ]
    tot = totals(costs)
    rows.append(
        (
            "total",
            "",
            "",
            f"{tot['documents']}",
            f"{tot['shards']}",
            "",
            f"{tot['forwards']:,}",
            f"{tot['token_steps']:,}",
        )
    )
    return "\n".join(text_table(head, rows, left=3))


def format_stages(stages: Sequence[StageCost], coupled: dict[str, int] | None = None) -> list[str]:
    """One line per stage (:func:`stage_costs`) and one for their sum; with the coupled runs'
    :func:`totals`, a line for their decode-time branch replays where there are any."""
    out = []
    for s in stages:
        out.append(
            f"{s.stage} ({s.settings}): {s.documents:,} document-policy runs in {s.jobs:,} job(s), "
            f"{s.forwards:,} forwards ({s.prefill_forwards:,} prefill), {s.token_steps:,} token-steps"
        )
        if s.stage == "coupled runs" and coupled and coupled["replay_forwards"]:
            out.append(
                f"  of which decode-time branch replays: {coupled['replay_forwards']:,} forwards (prefills "
                f"included), {coupled['replay_token_steps']:,} token-steps"
            )
    out.append(
        f"all stages: {sum(s.jobs for s in stages):,} jobs, {sum(s.forwards for s in stages):,} forwards, "
        f"{sum(s.token_steps for s in stages):,} token-steps (upper bounds: every chain and branch its full length)"
    )
    return out


def format_hours(stages: Sequence[StageCost], rate: float, gpus: int = 1) -> str:
    """The hours of each stage (:func:`stage_costs`) and of all of them at ``rate`` token-steps per second on
    ``gpus`` devices, in one line (upper bounds, as the token-steps)."""
    spent = ", ".join(f"{s.stage} {_duration(s.token_steps, rate, gpus)}" for s in stages)
    everything = _duration(sum(s.token_steps for s in stages), rate, gpus)
    return f"at {rate:,g} token-steps/s on {gpus} device(s): {spent}; all stages {everything}"


def _duration(token_steps: int, rate: float, gpus: int) -> str:
    """``token_steps`` at ``rate`` token-steps per second on ``gpus`` devices: ``"1.25 h (4,500 s)"``
    (three significant digits from a million hours up)."""
    seconds = token_steps / rate / gpus
    hours = seconds / 3600.0
    return f"{hours:,.2f} h ({seconds:,.0f} s)" if hours < 1e6 else f"{hours:.3g} h ({seconds:.3g} s)"
