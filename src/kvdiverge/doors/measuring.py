"""The settings of one ``kvdiverge.measure`` call, as one object, and the steps it takes below the door.

:class:`MeasureOptions` holds every option of :func:`kvdiverge.measure` but the model, the tokenizer,
the prompts and the presses. It is built once from the call's keywords (:meth:`MeasureOptions.checked`),
which checks every setting against the config schema before any work
(:func:`kvdiverge.settings.checks.check_settings`), and the door reads its settings from it only:
the coupled run's :class:`~kvdiverge.engine.core.sampling.Sampling` (:meth:`MeasureOptions.sampling`),
the runner's :class:`~kvdiverge.engine.runner.RunOptions` (:meth:`MeasureOptions.run_options`), the
task's documents (:func:`task_inputs`) and tables (:func:`task_tables`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from kvdiverge.config.frontier import FrontierSpec
from kvdiverge.config.inputs import describe_press, is_noise_floor
from kvdiverge.config.task_checks import reconstruction_problem
from kvdiverge.data.tasks import task_documents, task_settings
from kvdiverge.data.tasks.tables import TaskTableOptions
from kvdiverge.data.tasks.tables import task_tables as task_table_stage
from kvdiverge.engine.core.sampling import Decoding, Sampling, decoding_options
from kvdiverge.engine.runner import RunOptions
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.frontier import FrontierPoint
from kvdiverge.settings.checks import check_settings, check_task, spelled, text_problems, window_problems

__all__ = ["MeasureOptions", "MeasureSettings", "check_keywords", "floors", "task_inputs", "task_tables"]


@dataclass(frozen=True, kw_only=True)
class MeasureSettings:
    """What a measurement was made with: :attr:`kvdiverge.doors.results.Measurement.settings`.

    Attributes
    ----------
    sampling : kvdiverge.engine.core.sampling.Sampling
        The coupled run's horizon ``T`` (tokens), replicates, decoding (its end-of-sequence ids the run's),
        seed and model name.
    bootstrap : kvdiverge.estimation.bootstrap.Bootstrap
        The document bootstrap of every interval.
    split, window, instruction, system
        As :func:`kvdiverge.measure`'s keywords.
    presses : mapping
        Press name -> description (:func:`kvdiverge.config.inputs.describe_press`), in the order run.
    frontier : tuple of kvdiverge.estimation.frontier.FrontierPoint or None
        The frontier's grid; None without ratios.
    kv_sizes : dict or None
        The model's ``elements_per_token`` and ``element_bytes`` (:func:`kvdiverge.models.loading.kv_sizes`),
        with a frontier.
    quantized_caches : tuple of str
        Names of the quantized-cache policies.
    compressed_layers : dict or None
        The layers a press compresses on a model with sliding-window layers
        (:func:`kvdiverge.config.provenance.compressed_layers`).
    windows, task
        The named lag windows and the task block; not part of the record (:meth:`record`), so None after
        :meth:`of_record`.
    """

    sampling: Sampling
    bootstrap: Bootstrap
    split: str = "measure"
    window: int = 8
    instruction: str | None = None
    system: str | None = None
    presses: Mapping[str, Any] = field(default_factory=dict)
    frontier: tuple[FrontierPoint, ...] | None = None
    kv_sizes: Mapping[str, int] | None = None
    quantized_caches: tuple[str, ...] = ()
    compressed_layers: Mapping[str, Any] | None = None
    windows: Mapping[str, Sequence[int]] | None = field(default=None, compare=False)
    task: str | Mapping[str, Any] | None = field(default=None, compare=False)

    def record(self) -> dict[str, Any]:
        """The settings as the one dict saved (``measure.json``) and hashed
        (:func:`kvdiverge.config.provenance.settings_hash`).

        model, split, T, R, the decoding settings always recorded (temperature, top_p), seed, window,
        bootstrap, confidence, instruction, system, presses; ``decoding``: the other settings of
        :func:`~kvdiverge.engine.core.sampling.decoding_options` away from neutral, when any; the ``frontier``
        grid and ``kv_sizes`` (``{model: {"elements_per_token", "element_bytes"}}``) with a frontier;
        ``quantized_caches`` and ``compressed_layers`` when any.
        """
        options, values, sampling = decoding_options(), self.sampling.decoding, self.sampling
        record = {
            "model": sampling.model_name, "split": self.split, "T": sampling.T, "R": sampling.replicates,
            **{n: o["type"](getattr(values, n)) for n, o in options.items() if o["recorded"]},
            "seed": int(sampling.seed), "window": int(self.window), "bootstrap": self.bootstrap.n_boot,
            "confidence": self.bootstrap.confidence, "instruction": self.instruction, "system": self.system,
            "presses": dict(self.presses),
        }  # fmt: skip
        decoding = {n: getattr(values, n) for n, o in options.items()
                    if not o["recorded"] and getattr(values, n) != o["neutral"]}  # fmt: skip
        if decoding:  # recorded when set, so records without them stay as they were
            record["decoding"] = decoding
        if self.frontier is not None:
            record["frontier"] = [point.as_dict() for point in self.frontier]
            record["kv_sizes"] = {sampling.model_name: dict(self.kv_sizes)} if self.kv_sizes else None
        if self.quantized_caches:
            record["quantized_caches"] = list(self.quantized_caches)
        if self.compressed_layers is not None:
            record["compressed_layers"] = self.compressed_layers
        return record

    @classmethod
    def of_record(cls, record: Mapping[str, Any], eos_ids: Sequence[int] | None = None) -> MeasureSettings:
        """The settings :meth:`record` gave (read back from ``measure.json``), with the run's ``eos_ids``."""
        options = decoding_options()
        decoding = {n: (record[n] if o["recorded"] else o["neutral"]) for n, o in options.items()}
        decoding.update(record.get("decoding") or {})
        sampling = Sampling(T=record["T"], replicates=record["R"], seed=record["seed"], model_name=record["model"],
                            decoding=Decoding(**decoding, eos_ids=eos_ids))  # fmt: skip
        frontier, sizes = record.get("frontier"), record.get("kv_sizes") or {}
        return cls(
            sampling=sampling, bootstrap=Bootstrap.of(record), split=record["split"], window=record["window"],
            instruction=record["instruction"], system=record["system"], presses=record["presses"],
            frontier=None if frontier is None else tuple(FrontierPoint.of(p) for p in frontier),
            kv_sizes=sizes.get(record["model"]), quantized_caches=tuple(record.get("quantized_caches") or ()),
            compressed_layers=record.get("compressed_layers"),
        )  # fmt: skip

    def replace(self, **changes: Any) -> MeasureSettings:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class MeasureOptions:
    """Every option of :func:`kvdiverge.measure` but its four inputs; see its docstring for each.

    ``decoding`` holds every setting of :func:`kvdiverge.engine.core.sampling.decoding_options`
    by name, at its doors' default unless given. ``T`` and ``R`` are ``max_new_tokens`` and
    ``replicates`` as checked.
    """

    max_new_tokens: int = 32
    replicates: int = 4
    seed: int = 0
    window: int = 8
    instruction: str | None = None
    system: str | None = None
    windows: Mapping[str, Sequence[int]] | None = None
    bootstrap: int = 2000
    confidence: float = 0.95
    model_name: str | None = None
    split: str = "measure"
    eos_ids: Sequence[int] | None = None
    progress: bool = True
    batch_documents: int | None = None
    memory_budget_gb: float | None = None
    ratios: Sequence[float] | None = None
    budgets: Sequence[int] | None = None
    caches: Mapping[str, Mapping[str, Any]] | None = None
    cache_ratios: Sequence[float] | None = None
    teacher_tokens: int | None = None
    teacher_target: str | None = None
    task: str | Mapping[str, Any] | None = None
    decoding: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(cls, decoding: Mapping[str, Any], **options: Any) -> MeasureOptions:
        """The options of a call, every setting checked as the config checks it.

        Raises
        ------
        TypeError
            A decoding keyword that is not one of :func:`~kvdiverge.engine.core.sampling.decoding_options`,
            as Python's own for an unknown keyword.
        ValueError
            A setting the config would refuse, a ``model_name`` or ``split`` that is not a non-empty
            string, or ``windows`` that are not named lag windows within the horizon
            (:func:`kvdiverge.settings.checks.window_problems`), naming the argument, the value and
            what is allowed.
        """
        check_keywords(decoding)
        known = decoding_options()
        decoding = {name: decoding.get(name, option["default"]) for name, option in known.items()}
        opts = cls(**options, decoding=decoding)
        given = {"max_new_tokens": opts.max_new_tokens, "replicates": opts.replicates, "seed": opts.seed}
        given.update(decoding, window=opts.window, bootstrap=opts.bootstrap, confidence=opts.confidence)
        unset_allowed = (
            "memory_budget_gb",
            "batch_documents",
            "teacher_tokens",
            "teacher_target",
            "instruction",
            "system",
        )
        given.update({k: getattr(opts, k) for k in unset_allowed if getattr(opts, k) is not None})  # None: none
        checked = check_settings(given)  # counts given as integral floats come back as int
        names = {"split": opts.split, **({} if opts.model_name is None else {"model_name": opts.model_name})}
        problems = text_problems(names)
        if opts.windows is not None:
            problems += window_problems(opts.windows, checked["max_new_tokens"])
        problems += [p for p in [reconstruction_problem(opts.teacher_target, opts.task, "teacher_target")] if p]
        if problems:
            raise ValueError(problems[0])
        kept = {k: v for k, v in checked.items() if k in cls.__dataclass_fields__}
        return cls(**{**options, **kept}, decoding={name: checked[name] for name in decoding})

    @property
    def boot(self) -> Bootstrap:
        """The document bootstrap of the pooled intervals (:class:`~kvdiverge.estimation.bootstrap.Bootstrap`)."""
        return Bootstrap(self.bootstrap, self.confidence, self.seed)

    @property
    def frontier(self) -> FrontierSpec:
        """The frontier's ratios, budgets and caches (:class:`~kvdiverge.config.frontier.FrontierSpec`)."""
        return FrontierSpec(self.ratios, self.budgets, self.caches, self.cache_ratios)

    def sampling(self, model_name: str) -> Sampling:
        """The coupled run's :class:`~kvdiverge.engine.core.sampling.Sampling`."""
        decoding = Decoding(**self.decoding, eos_ids=self.eos_ids)
        return Sampling(T=self.max_new_tokens, replicates=self.replicates, decoding=decoding, seed=int(self.seed),
                        model_name=model_name)  # fmt: skip

    def recorded(self, sampling: Sampling, sources: Mapping[str, Any], grid, kv_sizes=None) -> MeasureSettings:
        """The :class:`MeasureSettings` of a measurement run with ``sampling`` on ``sources`` (name ->
        press source, described by :func:`kvdiverge.config.inputs.describe_press`), the frontier ``grid``
        (or None) and the model's ``kv_sizes`` (``{"elements_per_token", "element_bytes"}``,
        :func:`kvdiverge.models.loading.kv_sizes`; None without a frontier)."""
        quantized = tuple(n for n, src in sources.items() if getattr(src, "quantized", None) is not None)
        return MeasureSettings(
            sampling=sampling, bootstrap=self.boot, split=self.split, window=int(self.window),
            instruction=self.instruction, system=self.system,
            presses={n: describe_press(s) for n, s in sources.items()},
            frontier=None if grid is None else tuple(FrontierPoint.of(p) for p in grid),
            kv_sizes=dict(kv_sizes) if kv_sizes else None, quantized_caches=quantized,
            windows=self.windows, task=self.task,
        )  # fmt: skip

    def run_options(self):
        """The coupled run's :class:`kvdiverge.engine.runner.RunOptions`: batch size, memory budget, a bar per press."""
        return RunOptions(
            batch_documents=self.batch_documents,
            memory_budget_gb=self.memory_budget_gb,
            owner="press",
            progress=lambda name, total: tqdm(
                total=total, desc=name, unit="step", disable=not self.progress, mininterval=1.0
            ),  # fmt: skip
        )


def check_keywords(decoding: Mapping[str, Any]) -> None:
    """``TypeError`` for a keyword of :func:`kvdiverge.measure` that is neither an option nor a decoding setting
    (:func:`~kvdiverge.engine.core.sampling.decoding_options`), as Python's own for an unknown keyword."""
    unknown = sorted(set(decoding) - set(decoding_options()))
    if unknown:
        raise TypeError(f"measure() got an unexpected keyword argument {unknown[0]!r}")


def floors(sources: Mapping[str, Any]) -> list[str]:
    """Names of the noise-floor presses among ``sources`` (:func:`kvdiverge.config.inputs.is_noise_floor`)."""
    return [n for n, s in sources.items() if is_noise_floor(n, s)]


def task_inputs(opts: MeasureOptions, prompts, tokenizer, names: Mapping[str, str] | None = None):
    """``(documents, prompts table)`` of the options' task, or ``None`` without one.

    ``names`` spells each setting as the door does (:func:`kvdiverge.settings.checks.spelled`); None:
    :func:`kvdiverge.measure`'s keywords.

    Raises
    ------
    ValueError
        A task block the config refuses (:func:`kvdiverge.settings.checks.check_task`), a temperature
        other than 0, prompts that are not text or no tokenizer, or prompts the task cannot take,
        in the door's spelling.
    """
    task = opts.task
    if task is None:
        return None
    block = check_task(task)  # the config's rules for a task block, before any work
    temperature = opts.decoding["temperature"]
    if float(temperature) != 0:
        raise ValueError(f"task={task!r} scores greedy answers: pass temperature=0 (got {temperature})")
    if isinstance(prompts, str) or not isinstance(prompts, Mapping):
        prompts = {f"prompt-{i}": p for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts)}
    if tokenizer is None or not all(isinstance(p, str) for p in prompts.values()):
        raise ValueError(f"task={task!r} builds its prompts from text: pass text prompts and the tokenizer")
    render = {"system": opts.system, "seed": opts.seed, "split": opts.split}
    try:
        return task_documents(prompts, tokenizer, block, opts.max_new_tokens, render)
    except ValueError as exc:  # the task names the config's keys: name measure()'s arguments
        raise type(exc)(spelled(str(exc), names)) from None


def task_tables(opts: MeasureOptions, trajectories, documents, table, tokenizer, floor: str | None):
    """The task's tables of a measurement (the workflow's ``task`` rule's function), bootstrapped with its settings."""
    entry, _ = task_settings(check_task(opts.task))
    options = TaskTableOptions(
        controls=[floor] if floor else [],
        floor=floor,
        boot=opts.boot,
    )
    return task_table_stage(trajectories, documents, table, tokenizer, entry.score, options=options)
