"""The command line: ``kvdiverge measure``, a thin layer over :func:`kvdiverge.plan`.

Parse, plan, load, run: the arguments parsed, checked and planned (:func:`kvdiverge.doors.arguments.plan_arguments`:
policies, prompts and :func:`kvdiverge.plan`'s keywords), the measurement planned with the
tokenizer and checked with the model's config (:mod:`kvdiverge.doors.plan`), the weights loaded,
the plan run (:meth:`~kvdiverge.doors.plan.Plan.run`, or :meth:`~kvdiverge.doors.plan.Plan.screen`
with ``--screen``); then the printed summary and the files under ``--out``.
Installed as the console script ``kvdiverge`` (``pyproject.toml``); also
``python -m kvdiverge measure ...``. ``kvdiverge --version`` prints the installed version.
``kvdiverge cost CONFIG`` prints a config's generation cost (:mod:`kvdiverge.planning.cost`).

Exit status (:data:`EXIT_OK`, :data:`EXIT_FAILURE`, :data:`EXIT_USAGE`, :data:`EXIT_INTERRUPTED`): 0 on success; 2 for a
usage error, that is bad arguments or bad input (an unknown option, press or parameter, a
value a setting does not allow, a missing file or field, a model or device that cannot be
found, a prompt shorter than a press needs), one line on stderr, ``kvdiverge measure: error:
...``, before the model's weights load where the input and the model's config decide (the config
is read first, :func:`kvdiverge.models.loading.load_model_config`, then the tokenizer: a prompt longer
than the model's context, a press its layers refuse); 1 for a failure at run time
(anything else, named by its exception type, e.g. running out of memory, on the host or the
device); 130 when interrupted (Ctrl-C), in one line. ``--debug`` shows the traceback instead of
the line.
``--out`` (or, for ``--ratios`` without it, the working directory) is checked before
anything else, and locked while the run writes it: a second run on the same ``--out`` is refused
(:mod:`kvdiverge.doors.outputs`).

Example::

    kvdiverge measure embedded --sotu 2 -T 8 -R 2 \\
        --press SnapKVPress:compression_ratio=0.5,window_size=16 --out measure-out
    kvdiverge measure embedded --sotu 2 --budget 64 \\
        --press "AdaKVPress(press=SnapKVPress(window_size=16))"

With ``--ratios``, every ``--press`` runs at every ratio (a frontier, the same as a config's
``frontier`` section): ``kvdiverge measure embedded --sotu 2 -T 8 -R 2 --press SnapKVPress
--press KnormPress --ratios 0.1 0.25 0.5 0.75`` prints the ranked frontier table and writes
``frontier.png``/``.pdf`` (under ``--out``, else the working directory). Each ``--cache`` then
adds its points: the cache alone and after each press at each of ``--cache-ratios`` (default: 0,
the cache alone, and every ratio), all ranked on the KV bytes per prompt token they store.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from kvdiverge import __version__
from kvdiverge.config.workflow import ConfigError, load_config
from kvdiverge.data.prompts import SOTU_INSTRUCTION
from kvdiverge.data.tasks import TASKS
from kvdiverge.doors.outputs import output_guard
from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.core.sampling import decoding_options
from kvdiverge.engine.llamacpp.caches import require_llama_cpp
from kvdiverge.models import embedded as embedded_models
from kvdiverge.models.loading import load_model
from kvdiverge.models.sources import ModelNotFoundError
from kvdiverge.planning import cost
from kvdiverge.report.formatting import task_text

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "main",
]

PROG = "kvdiverge measure"

#: Exit status: success.
EXIT_OK = 0
#: Exit status: a failure at run time (not decided by the input).
EXIT_FAILURE = 1
#: Exit status: a usage error, bad arguments or bad input (argparse's convention).
EXIT_USAGE = 2
#: Exit status: interrupted (Ctrl-C, SIGINT: the shell's 128 + 2).
EXIT_INTERRUPTED = 130

EXIT_STATUS = (
    "exit status: 0 on success; 2 for a usage error (bad arguments or input: an unknown press, "
    "a value a setting does not allow, a missing file, a model that cannot be found), one line "
    "on stderr; 1 for a failure at run time (e.g. out of memory), named by its exception type; 130 "
    "when interrupted (Ctrl-C)"
)


# --------------------------------------------------------------------------- the arguments


# --------------------------------------------------------------------------- the parser and the run


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    root = _Parser(
        prog="kvdiverge",
        description="kvdiverge command line: measure how KV-cache compression changes what a model generates.",
        epilog=EXIT_STATUS,
    )
    root.add_argument("--version", action="version", version=f"kvdiverge {__version__}")
    sub = root.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "measure",
        prog=PROG,
        help="measure how presses change what a model generates",
        description="Measure how KV-cache presses change what a model generates: per press, the "
        "occurrence p_div and timing of first divergence from full-cache generation, and "
        "the mismatch fraction E[M] = p_div/T + (E[L]/T)*rho, with bootstrap intervals.",
        epilog="Example: kvdiverge measure embedded --sotu 2 -T 8 -R 2 "
        "--press SnapKVPress:compression_ratio=0.5,window_size=16 --out measure-out. " + EXIT_STATUS + ".",
    )
    _press_arguments(p)
    _prompt_arguments(p)
    _setting_arguments(p)
    _task_arguments(p)
    _teacher_arguments(p)
    _output_arguments(p)
    _cost_parser(sub)  # kvdiverge cost: kvdiverge.planning.cost
    return root


def _press_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the presses, the caches and the budget."""
    p.add_argument(
        "model",
        help=", ".join(f"'{m.argument}' ({m.label})" for m in embedded_models.EMBEDDED_MODELS)
        + ", a model directory, a .gguf file or a hub id",
    )
    p.add_argument(
        "--press",
        action="append",
        default=[],
        metavar="NAME[:param=value,...]",
        help="a kvpress class name or module:Class, with constructor parameters "
        "(int, float, true/false or text), or a press expression such as "
        "'AdaKVPress(press=SnapKVPress(compression_ratio=0.5))' (literals and press "
        "classes only); repeat for more presses",
    )
    p.add_argument(
        "--cache",
        action="append",
        default=[],
        metavar="BACKEND[:param=value,...]",
        help="a quantized KV cache (backend quanto or hqq; nbits, q_group_size, residual_length), "
        "e.g. quanto:nbits=4: measured alone and after each --press; repeat for more",
    )
    p.add_argument(
        "--backend",
        choices=["transformers", "llama_cpp"],
        default="transformers",
        help="llama_cpp: measure llama.cpp KV cache types (--cache TYPE, TYPE_K/TYPE_V, :norot for rotation off; "
        "types f16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl) against the full f16 cache, on a GGUF model "
        "(needs `pip install kvdiverge[llamacpp]`)",
    )
    p.add_argument(
        "--budget",
        type=int,
        metavar="TOKENS",
        help="keep this many prompt positions per layer and head (a per-prompt compression "
        "ratio of the press that takes one); instead of compression_ratio",
    )


def _prompt_arguments(p: argparse.ArgumentParser) -> None:
    """Where the prompts come from and how they are rendered."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompts",
        metavar="FILE",
        help="prompts: a text file (one per line), JSON lines (.jsonl) or parquet (see --field)",
    )
    src.add_argument("--sotu", type=int, metavar="N", help="N excerpts of the embedded State of the Union corpus")
    p.add_argument("--field", default="text", help="text field of a JSON-lines or parquet file (default: text)")
    p.add_argument("--id-field", help="id field of a JSON-lines or parquet file (default: prompt-<i>)")
    p.add_argument(
        "--words",
        type=int,
        nargs=2,
        default=(150, 250),
        metavar=("MIN", "MAX"),
        help="--sotu excerpt length in words (default: 150 250)",
    )
    p.add_argument(
        "--instruction",
        help=f"text appended to each prompt after a blank line (default for --sotu: {SOTU_INSTRUCTION!r})",
    )
    p.add_argument("--system", help="system message")


def _setting_arguments(p: argparse.ArgumentParser) -> None:
    """The measurement settings, the device, the frontier and the outputs."""
    p.add_argument("-T", "--max-new-tokens", type=int, default=32, help="horizon T in tokens (default: 32)")
    p.add_argument("-R", "--replicates", type=int, default=4, help="coupled replicates per prompt (default: 4)")
    for name, option in decoding_options().items():  # unset: measure()'s default (temperature: 0 with --task)
        p.add_argument(
            "--" + name.replace("_", "-"), type=option["type"], metavar=option["metavar"], help=option["help"]
        )
    p.add_argument("--seed", type=int, default=0, help="master seed (default: 0)")
    p.add_argument("-W", "--window", type=int, default=8, help="divergence-aligned window W in steps (default: 8)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default: 2000)")
    p.add_argument("--confidence", type=float, default=0.95, help="interval coverage (default: 0.95)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "auto"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: torch's choice; 1 is fastest on a busy shared machine)",
    )
    p.add_argument(
        "--batch-documents", type=int, metavar="B", help="documents per forward (default: the memory planner's choice)"
    )
    p.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        metavar="R",
        help="a frontier: run every --press at each compression ratio R in [0, 1), beside the "
        "noise floor (each --cache alone and after each press too); prints the ranked frontier "
        "table and writes frontier.png/.pdf",
    )
    p.add_argument(
        "--cache-ratios",
        type=float,
        nargs="+",
        metavar="R",
        help="with --ratios and --cache: the presses' ratios before each cache, 0 meaning the "
        "cache alone (default: 0 and every --ratios value)",
    )


def _output_arguments(p: argparse.ArgumentParser) -> None:
    """Where the tables go, and how much is printed."""
    p.add_argument("--out", metavar="DIR", help="write the tables (parquet, csv) and the survival figure here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="on an error, show the traceback instead of one line")


def _teacher_arguments(p: argparse.ArgumentParser) -> None:
    """``--screen`` and ``--teacher-tokens``: the teacher-forced pass (docs/teacher-forced.md)."""
    p.add_argument(
        "--screen",
        action="store_true",
        help="run only the teacher-forced pass (llama.cpp's KLD, PPL ratio, Same top p, RMS Δp per press, "
        "ranked by mean KLD): a frontier in a fraction of the coupled run's time",
    )
    p.add_argument(
        "--teacher-tokens",
        type=int,
        metavar="N",
        help="continuation tokens of the teacher-forced pass (default 64 with --screen); without "
        "--screen, also run the pass and add its columns to the summary",
    )
    p.add_argument(
        "--teacher-target",
        metavar="TARGET",
        help="what the teacher-forced pass scores: continuation (default) or reconstruction (each prompt's "
        "own text, fed after the instruction 'Repeat the previous context exactly.' in the model's chat "
        "template: KVzip's context reconstruction); without --screen, also run the pass",
    )


def _screen(args: argparse.Namespace, plan, model) -> int:
    """``--screen``: the plan's teacher-forced pass only; its table printed, and written with ``--out``."""
    s = plan.screen(model)
    print(s.format(), flush=True)
    if args.out:
        s.save(args.out)
        _say(args.quiet, f"{PROG}: wrote the teacher-forced tables to {args.out}")
    return 0


def _task_arguments(p: argparse.ArgumentParser) -> None:
    """``--task`` and ``--question`` (:mod:`kvdiverge.data.tasks`)."""
    p.add_argument(
        "--task",
        choices=sorted(TASKS),
        help="a task score beside the measures: RULER's single needle in each text prompt (niah), or the "
        "continuation of a quote from it (recall), answered greedily under the full cache and each press; "
        "prints accuracy, rank correlations and AUC (docs/task.md)",
    )
    p.add_argument(
        "--question",
        choices=["inside", "after"],
        help="with --task: the question inside the compressed prompt (default), or prefilled after compression",
    )


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _write(args: argparse.Namespace, m) -> None:
    """The frontier figure (``--ratios``; llama.cpp's cache types with ``--out``) and the tables and survival figure
    (``--out``)."""
    if args.ratios or (m.settings.frontier and args.out):
        where = Path(args.out or ".")
        where.mkdir(parents=True, exist_ok=True)
        for suffix in ("png", "pdf"):
            m.plot_frontier(where / f"frontier.{suffix}")
        _say(args.quiet, f"{PROG}: wrote frontier.png/.pdf to {where}")
    if args.out:
        out = Path(args.out)
        m.save(out)
        m.plot_survival(out / "survival.png")
        m.plot_survival(out / "survival.pdf")
        _say(args.quiet, f"{PROG}: wrote tables and survival.png/.pdf to {out}")


def _measure(args: argparse.Namespace) -> int:
    """Parse, plan, load, run: the plan is built and checked before the weights load."""
    # torch and kvpress: imported when a measurement runs, not for --help, --version or cost
    from kvdiverge.doors.arguments import plan_arguments

    found = plan_arguments(args)
    llama = found.gguf is not None  # llama.cpp's cache types on the model's GGUF file (doors.llamacpp)
    if args.threads is not None and not llama:
        import torch

        torch.set_num_threads(args.threads)
    _say(args.quiet, f"{PROG}: loading {found.gguf or found.name} {'in llama.cpp ' if llama else ''}...")
    if llama:
        model = require_llama_cpp().Llama(found.gguf, n_ctx=64, n_threads=args.threads or 1, verbose=False)
    else:
        model, _ = load_model(found.entry, found.name, tokenizer=found.tokenizer)
    if args.screen:
        return _screen(args, found.plan, model)
    try:
        with warnings.catch_warnings():  # the printed summary flags untouched caches
            warnings.filterwarnings("ignore", message="press .* left the cache untouched")
            m = found.plan.run(model)
    finally:
        if llama:
            model.close()
    print(m.format_summary(), flush=True)
    if m.task is not None:
        print(task_text(m.task), flush=True)
    if args.ratios or llama:  # llama.cpp's cache types are a frontier on the KV-bytes axis
        print(m.format_frontier(), flush=True)
    _write(args, m)
    return 0


def _bad_input(exc: BaseException) -> bool:
    """True for errors that report bad input (a usage error, exit code 2) rather than a failure at run time."""
    # ValueError covers InputError, CorpusError, policy and prompt-length errors
    return isinstance(exc, (ValueError, ModelNotFoundError, CompressionError))


def _cost_parser(subparsers) -> argparse.ArgumentParser:
    """Add the command ``kvdiverge cost`` to the subparsers (``ArgumentParser.add_subparsers``'s); it runs
    :func:`_cost`."""
    p = subparsers.add_parser(
        "cost",
        prog="kvdiverge cost",
        help="a config's generation cost: documents, forwards and token-steps, from the config alone",
        description=cost.__doc__.split("\n\n")[0],
        epilog="Example: kvdiverge cost config/paper.yaml --rate 5000. Exit status: 0 on success; "
        "2 for a config that cannot be read or is invalid, one line on stderr.",
    )
    p.add_argument("config", help="workflow config file, e.g. config/paper.yaml")
    p.add_argument(
        "--batch-documents",
        type=int,
        default=None,
        help="documents per forward B (default: generation.batch_documents, else 1)",
    )
    p.add_argument(
        "--rate", type=float, default=None, help="measured token-steps per second on one device: also print the hours"
    )
    p.add_argument("--gpus", type=int, default=1, help="devices in parallel for --rate (default 1)")
    return p


def _cost(args: argparse.Namespace) -> int:
    """``kvdiverge cost``: print a config's generation cost (and hours at ``--rate``); the exit code.

    The coupled runs' table, then one line per stage (:func:`kvdiverge.planning.cost.stage_costs`) and their sum. 0 on
    success; 2 when an option is out of range (one line naming it as spelled), or the config
    cannot be read or is invalid (the reasons, one line each, after the first), on stderr.
    """
    problems = _cost_problems(args)
    if problems:
        print(f"kvdiverge cost: error: {'; '.join(problems)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = load_config(args.config)
        costs = cost.study_cost(config, args.batch_documents)
        stages = cost.stage_costs(config, args.batch_documents)
    except (OSError, ValueError) as exc:  # a config error is a ValueError: its reasons follow its first line
        lines = str(exc).strip().splitlines() or [""]
        reasons = lines[1:] if isinstance(exc, ConfigError) else []
        print("\n".join([f"kvdiverge cost: error: {lines[0]}", *reasons]), file=sys.stderr)
        return EXIT_USAGE
    print(cost.format_table(costs))
    print()
    for line in cost.format_stages(stages, cost.totals(costs)):
        print(line)
    if args.rate is not None:
        print(cost.format_hours(stages, args.rate, args.gpus))
    return 0


def _cost_problems(args: argparse.Namespace) -> list[str]:
    """One sentence per ``kvdiverge cost`` option out of range, naming the option as spelled."""
    out = []
    rate = args.rate
    if rate is not None and not math.isfinite(rate):
        out.append(f"--rate: {rate!r} is not a finite number; allowed: a number > 0")
    elif rate is not None and rate <= 0:
        out.append(f"--rate: {rate!r} is not allowed; allowed: a number > 0")
    for option, value in (("--batch-documents", args.batch_documents), ("--gpus", args.gpus)):
        if value is not None and value < 1:
            out.append(f"{option}: {value!r} is not allowed; allowed: an integer >= 1")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    0 on success, 2 (:data:`EXIT_USAGE`) for bad arguments or input, 1 (:data:`EXIT_FAILURE`)
    for a failure at run time; an error is one line on stderr (the traceback with ``--debug``).
    argparse's own errors (an unknown option, ``--help``, ``--version``) raise ``SystemExit``
    with code 2 (0 for ``--help`` and ``--version``).

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments after the program name (default ``sys.argv[1:]``).
    """
    args = _parser().parse_args(argv)
    if args.command == "cost":
        return _cost(args)
    try:
        with output_guard(args.out, cwd_writes=bool(args.ratios)):  # checked and locked before any work
            return _measure(args)
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        if _bad_input(exc):
            print(f"{PROG}: error: {first}", file=sys.stderr)
            return EXIT_USAGE
        # a failure the input did not decide: named by its type
        print(f"{PROG}: error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
