"""The cost of a config's generation stage, from the config alone.

Counts, per (model, policy, split) run of :func:`kvdiverge.study.config.runs`, the documents,
the forward passes and the token-steps that the trajectory engine performs, so that the
study estimate of ``docs/benchmarks.md`` and the GPU benchmark's projection come from one place;
the command ``kvdiverge cost`` prints them (:func:`add_cost_parser`, :func:`run_cost`)::

    kvdiverge cost config/paper.yaml                 # table and totals
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
  :func:`kvdiverge.engine.presses.registry.shares_prefill`; for a decode-time policy the
  chain lane's prefill gives the reference's full cache), else twice. Decoding takes at
  most ``2T - 2`` steps (``T - 1`` chain advances after the prefill's first distribution,
  then ``T - t* <= T - 1`` branch advances), each one forward over both sides' rows
  (:class:`kvdiverge.engine.llm.side.JointSides`). With ``B`` documents per forward
  (``generation.batch_documents``, the batching engine), a shard of ``n`` documents
  decodes ``ceil(n / B)`` groups: ``decode_forwards = (2T - 2) x ceil(n / B)`` per shard.

A **decode-time policy** (:func:`kvdiverge.engine.presses.registry.is_decode_time`) runs on
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`: the evicted side decodes in lanes of
one document each (one forward per lane per step, not batched across documents; a
press with ``merge_lanes`` decodes a document's lanes as one), and a branch starting at
``t*`` is replayed from a fresh prefill, ``t* - 1`` forwards. Upper bounds per document,
with every replicate in a lane of its own: the reference side decodes by its own
forwards, ``2T - 2`` (one forward per document; all of a group's documents in one where
every prefill evicts), and the evicted side's lanes take ``(R + 1)(T - 1)`` (the chain
lane, then ``R`` branch lanes); ``replay_prefills = R``;
``replay_forwards = replay_token_steps = R (T - 2)``.

Policies that evict at prefill only and run in one call (a frontier's points: one job per
model and shard) share each document's prefill forward in groups of up to ``2R``
(:func:`kvdiverge.engine.runner.run_policies`); the counts here are each run's own, so for
them upper bounds, and ``shards`` counts a frontier's jobs per point.

Documents per run: ``corpus.documents[split]``; the noise-floor control
(``runs.control``) runs on its first ``runs.control.documents`` documents unless the same
policy is scheduled on that split in full (as :func:`kvdiverge.study.shard.shard_documents`
selects them). These are the requested counts: documents excluded at the prompts stage
(too short, too long) lower the real figures slightly.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdiverge.io.render import text_table
from kvdiverge.study.config import control_documents, load_config, runs

__all__ = [
    "RunCost",
    "add_cost_parser",
    "format_table",
    "projected_hours",
    "run_cost",
    "run_documents_count",
    "study_cost",
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


def _prefills(spec) -> int:
    """Prefill forwards per document of a policy's press: 1 where one forward gives both caches, else 2."""
    # lazy: kvpress loads when a press is asked; kvdiverge.cli imports this module for --help
    from kvdiverge.engine.presses.registry import shares_prefill

    try:
        return 1 if shares_prefill(spec) else 2
    except (KeyError, TypeError, ValueError):  # no press of its own (a cache alone), or unknown: the bound
        return 2


def study_cost(config: dict[str, Any], batch_documents: int | None = None) -> list[RunCost]:
    """Cost of every run of a validated config (:func:`kvdiverge.study.config.load_config`).

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
        One entry per run, in :func:`kvdiverge.study.config.runs` order.

    Raises
    ------
    ValueError
        If ``batch_documents < 1``.
    """
    # lazy: kvpress loads when a press is asked; kvdiverge.cli imports this module for --help
    from kvdiverge.engine.presses.registry import is_decode_time

    B = _batch_documents(config, batch_documents)
    T = int(config["decoding"]["max_new_tokens"])
    R = int(config["replicates"])
    n_shards = int(config["shards"])
    out = []
    for model, policy, split in runs(config):
        n = run_documents_count(config, policy, split)
        per_shard = [len(range(i, n, n_shards)) for i in range(n_shards)]
        groups = sum(math.ceil(k / B) for k in per_shard)
        spec = config["policies"].get(policy)
        decode_time = is_decode_time(spec)
        steps = max(2 * T - 2, 0) * (n if decode_time else groups)  # decode-time: bounded per document
        out.append(
            RunCost(
                model=model,
                policy=policy,
                split=split,
                documents=n,
                shards=n_shards,
                replicates=R,
                T=T,
                batch_documents=B,
                prefill_forwards=_prefills(spec) * n,
                decode_forwards=steps + ((R + 1) * max(T - 1, 0) * n if decode_time else 0),
                token_steps=n * R * 2 * (2 * T - 1),
                decode_time=decode_time,
                replay_prefills=R * n if decode_time else 0,
                replay_forwards=R * max(T - 2, 0) * n if decode_time else 0,
                replay_token_steps=R * max(T - 2, 0) * n if decode_time else 0,
            )
        )
    return out


def totals(costs: Sequence[RunCost]) -> dict[str, int]:
    """Sums over runs: ``runs``, ``documents`` (document-policy runs), ``shards`` (jobs),
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


def _positive_rate(text: str) -> float:
    """``--rate``: a finite number of token-steps per second, > 0 (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: a finite number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not allowed; allowed: a finite number > 0")
    return value


def _at_least_one(text: str) -> int:
    """``--batch-documents``, ``--gpus``: an integer >= 1 (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not allowed; allowed: an integer >= 1")
    return value


def _hours_text(hours: float) -> str:
    """Hours and seconds, in fixed point up to a million hours, else in three significant digits."""
    if hours < 1e6:
        return f"{hours:.2f} h ({hours * 3600:,.0f} s)"
    return f"{hours:.3g} h ({hours * 3600:.3g} s)"


def add_cost_parser(subparsers) -> argparse.ArgumentParser:
    """Add the command ``kvdiverge cost`` to the command line's subparsers (:mod:`kvdiverge.cli`).

    Parameters
    ----------
    subparsers : argparse._SubParsersAction
        What ``ArgumentParser.add_subparsers`` returned; the command runs :func:`run_cost`.
    """
    p = subparsers.add_parser(
        "cost",
        prog="kvdiverge cost",
        help="a config's generation cost: documents, forwards and token-steps, from the config alone",
        description=__doc__.split("\n\n")[0],
        epilog="Example: kvdiverge cost config/paper.yaml --rate 5000. Exit status: 0 on success; "
        "2 for a config that cannot be read or is invalid, one line on stderr.",
    )
    p.add_argument("config", help="workflow config file, e.g. config/paper.yaml")
    p.add_argument(
        "--batch-documents",
        type=_at_least_one,
        default=None,
        help="documents per forward B (default: generation.batch_documents, else 1)",
    )
    p.add_argument(
        "--rate",
        type=_positive_rate,
        default=None,
        help="measured token-steps per second on one device: also print the hours",
    )
    p.add_argument("--gpus", type=_at_least_one, default=1, help="devices in parallel for --rate (default 1)")
    return p


def run_cost(args: argparse.Namespace) -> int:
    """``kvdiverge cost``: print a config's generation cost (and hours at ``--rate``); the exit code.

    0 on success; 2 when the config cannot be read or is invalid, or an option is out of range
    (one line on stderr).
    """
    try:
        config = load_config(args.config)
        costs = study_cost(config, args.batch_documents)
        hours = None if args.rate is None else projected_hours(config, args.rate, args.gpus, args.batch_documents)
    except (OSError, ValueError) as exc:  # a config error is a ValueError; its reasons on one line
        head, *reasons = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
        print(f"kvdiverge cost: error: {' '.join([head, '; '.join(reasons)]).strip()}", file=sys.stderr)
        return 2
    print(format_table(costs))
    tot = totals(costs)
    print(
        f"\n{tot['documents']} document-policy runs, {tot['shards']} shard jobs, "
        f"{tot['forwards']:,} forwards ({tot['prefill_forwards']:,} prefill), "
        f"{tot['token_steps']:,} token-steps (upper bound: 2T - 1 steps per side)"
    )
    if tot["replay_forwards"]:
        print(
            f"decode-time branch replays: {tot['replay_forwards']:,} forwards (prefills included), "
            f"{tot['replay_token_steps']:,} token-steps (upper bounds)"
        )
    if hours is not None:
        print(f"at {args.rate:,.6g} token-steps/s on {args.gpus} device(s): {_hours_text(hours)}")
    return 0
