"""The engine each model entry runs on (config ``models.<name>.backend``), and what the llama_cpp backend refuses.

A model of ``backend: llama_cpp`` runs llama.cpp's KV cache types (policies of ``cache: llama_cpp``:
:func:`kvdiverge.engine.llamacpp.caches.cache_from_entry`) on its GGUF file itself, on the CPU, through
:func:`kvdiverge.engine.llamacpp.run.run_caches` (the workflow's shard job,
:func:`kvdiverge.jobs.shard.run_shard`); a model without the key runs on transformers. The config check
(:func:`kvdiverge.config.workflow.check`) asks :func:`backend_problems` before any job, in the sentences
of the engine and of the other doors (:mod:`kvdiverge.engine.llamacpp.caches`): a kvpress press or a quanto
cache scheduled on a llama_cpp model, a llama.cpp cache on a transformers model, a llama_cpp model that is
no GGUF file or not on the CPU, and what the backend does not run (a frontier, a task, the prediction study,
the teacher-forced pass, a repetition penalty). Neither torch nor ``llama_cpp`` is imported here;
:func:`require_backends` imports ``llama_cpp`` when a run starts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvdiverge.config.frontier import frontier_points
from kvdiverge.engine.llamacpp.caches import (
    ENTRY_KEYS,
    is_cache_entry,
    not_run_sentence,
    penalty_problem,
    refused_policy,
    require_llama_cpp,
)

__all__ = ["LLAMA_CPP", "backend_problems", "llama_models", "require_backends", "runs_on_llama_cpp"]

#: The ``backend`` of a model entry that runs on llama.cpp.
LLAMA_CPP = "llama_cpp"

#: The config keys that ask for what the llama_cpp backend does not run, with its kind
#: (:data:`kvdiverge.engine.llamacpp.caches.NOT_RUN`).
_NOT_RUN = {"frontier": "frontier", "task": "task", "prediction": "prediction", "teacher_forced": "teacher"}


def runs_on_llama_cpp(spec: Mapping[str, Any] | None) -> bool:
    """True for a model entry of ``backend: llama_cpp``."""
    return isinstance(spec, Mapping) and spec.get("backend") == LLAMA_CPP


def llama_models(config: Mapping[str, Any]) -> list[str]:
    """The names of the config's models of ``backend: llama_cpp``, in config order."""
    return [name for name, spec in (config.get("models") or {}).items() if runs_on_llama_cpp(spec)]


def _named(models: Sequence[str]) -> str:
    return ", ".join(f"models.{m}" for m in models)


def _model_problems(name: str, spec: Mapping[str, Any]) -> list[str]:
    """A llama_cpp model entry that is no GGUF file, or that asks for a device other than the CPU."""
    out = []
    source = spec.get("source")
    if source not in ("gguf_package", "gguf_chunks") and not (source == "local" and spec.get("gguf_file")):
        what = f"{source!r} without gguf_file" if source == "local" else repr(source)
        out.append(
            f"models.{name}.source: {what} names no GGUF file, which the llama_cpp backend runs "
            f"(models.{name}.backend); give source gguf_package or gguf_chunks, or local with gguf_file"
        )
    device = spec.get("device", "cpu")
    if device != "cpu":
        out.append(f"models.{name}.device: {device!r} is refused: the llama_cpp backend runs on the CPU; give cpu")
    return out


def _policy_problems(config: Mapping[str, Any], scheduled: Sequence[str], llama: Sequence[str]) -> list[str]:
    """Each scheduled policy on the models that cannot run it: a press or quanto cache on the llama_cpp models
    (a frontier's points left to the frontier's own refusal), a llama.cpp cache on the others, and a llama.cpp
    cache with a key it does not take."""
    policies = config.get("policies") or {}
    others = [m for m in config.get("models") or {} if m not in llama]
    made = {p.policy for p in frontier_points(dict(config))} if config.get("frontier") else set()
    out = []
    for name in scheduled:
        entry = policies.get(name)
        if not isinstance(entry, Mapping):  # not defined: named by the config check
            continue
        if is_cache_entry(entry):
            extra = [k for k in entry if k not in ENTRY_KEYS]
            if extra:
                out.append(
                    f"policies.{name}: a llama.cpp cache (cache: llama_cpp) takes type_k, type_v and rotation, "
                    f"not {', '.join(extra)}; remove {'it' if len(extra) == 1 else 'them'}"
                )
            if others:
                out.append(
                    f"policies.{name}: a llama.cpp cache (cache: llama_cpp) runs on a model of backend llama_cpp, "
                    f"not on {_named(others)} (backend transformers); give the model backend: llama_cpp"
                )
        elif llama and name not in made:
            what = entry.get("press") or "a quantized cache"
            out.append(f"policies.{name}: {refused_policy(str(what), f'the llama_cpp backend of {_named(llama)}')}")
    return out


def backend_problems(
    config: Mapping[str, Any], scheduled: Sequence[str], given: Collection[str] | None = None
) -> list[str]:
    """One sentence per thing a model's backend cannot run, each naming its config key.

    Parameters
    ----------
    config : mapping
        A config that passed the schema, its frontier expanded.
    scheduled : sequence of str
        The policies every model runs (:func:`kvdiverge.config.workflow.scheduled_policies`).
    given : collection of str, optional
        The top-level keys the config file gave, before the schema filled its defaults: a
        ``teacher_forced`` section is refused beside a llama_cpp model only when given (the pass is
        left out of such a config's workflow otherwise). None: every key of ``config``.

    Returns
    -------
    list of str
        Empty for a config of transformers models whose policies are no llama.cpp cache.
    """
    given = set(config) if given is None else set(given)
    llama = llama_models(config)
    out = []
    for name in llama:
        out += _model_problems(name, config["models"][name])
    if llama:
        beside = f"models of backend llama_cpp ({_named(llama)})"
        out += [not_run_sentence(key, kind, beside) for key, kind in _NOT_RUN.items() if key in given and key in config]
        penalty = (config.get("decoding") or {}).get("repetition_penalty", 1)
        problem = penalty_problem("decoding.repetition_penalty", penalty)
        if problem:
            out.append(problem)
    return out + _policy_problems(config, scheduled, llama)


def require_backends(config: Mapping[str, Any]) -> None:
    """Import what the config's backends need: ``llama_cpp`` for a llama_cpp model (a run's start, not a parse).

    Raises
    ------
    ModuleNotFoundError
        Without ``llama_cpp``, in one sentence that says how to install it
        (:data:`kvdiverge.engine.llamacpp.caches.INSTALL`).
    """
    if llama_models(config):
        require_llama_cpp()
