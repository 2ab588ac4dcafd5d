"""Property-based tests of the press-expression parser: random expressions parse or raise our errors.

Random text, and random expressions built from the grammar's pieces (press names, known
and unknown parameters, literals of every Python kind, nested calls, and the constructs the
parser must refuse: names, attributes, lambdas, ``**`` unpacking, subscripts), go through
what the command line does before it loads a model: :func:`policy_entry`, then
:func:`kvdiverge.config.inputs.prepare_presses` (the press built once, refusals). Each must
either give a policy or raise :class:`PressExpressionError` or :class:`PressError`, with
one line naming the expression; never any other exception, and never run code.
"""

from __future__ import annotations

import logging
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiverge.engine.core.errors import PressError, PressExpressionError
from kvdiverge.engine.presses.expressions import policy_entry, press_spec

OURS = (PressExpressionError, PressError)
NAMES = [
    "SnapKVPress",
    "KnormPress",
    "AdaKVPress",
    "DecodingPress",
    "ComposedPress",
    "ThinKPress",
    "PyramidKVPress",
    "DMSPress",
    "FinchPress",
    "PermutationPress",
    "BasePress",
    "ScorerPress",
    "NoPress",
    "QFilterPress",
    "PrefillDecodingPress",
    "CriticalKVPress",
    "StreamingLLMPress",
    "os",
    "print",
]
PARAMS = [
    "compression_ratio",
    "window_size",
    "kernel_size",
    "press",
    "base_press",
    "presses",
    "n_sink",
    "threshold",
    "decoding",
    "compression_interval",
    "target_size",
    "key_channel_compression_ratio",
    "seed",
    "x",
    "_",
]
LITERALS = [
    "0",
    "0.5",
    "-4",
    "1",
    "1.5",
    "1e308",
    "1e999",
    "-1e999",
    "float('nan')",
    "None",
    "True",
    "'a'",
    "[0.5]",
    "{0.5}",
    "{'a': 1}",
    "(1, 2)",
    "1j",
    "b'x'",
    "...",
    "[]",
    "{}",
    "-0.0",
    "2**100",
    "x",
    "os.system",
    "lambda: 1",
    "__import__('os')",
    "[1][0]",
    "'a' * 3",
    "not 1",
]


@st.composite
def calls(draw, depth=0):
    name = draw(st.sampled_from(NAMES))
    args = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["kw", "kw", "pos", "star"] + (["call"] if depth < 2 else [])))
        value = draw(calls(depth + 1)) if kind == "call" else draw(st.sampled_from(LITERALS))
        if kind == "pos":
            args.append(value)
        elif kind == "star":
            args.append("**{'window_size': 4}")
        else:
            args.append(f"{draw(st.sampled_from(PARAMS))}={value}")
    return f"{name}({', '.join(args)})"


@st.composite
def colon_forms(draw):
    items = [
        f"{draw(st.sampled_from(PARAMS))}={draw(st.sampled_from(['0.5', '4', '-4', 'nan', 'inf', 'none', 'true', 'x', '']))}"
        for _ in range(draw(st.integers(0, 3)))
    ]
    return draw(st.sampled_from(NAMES + ["mymodule:Press", "kvpress:SnapKVPress", ":", ""])) + (
        ":" + ",".join(items) if items else ""
    )


def run_front(text, budget=None):
    """What the command line does with one --press value before loading a model."""
    from kvdiverge.config.inputs import prepare_presses

    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            entry = policy_entry(text, budget)
            return prepare_presses({text: entry})
    finally:
        logging.disable(logging.NOTSET)


def check(text, budget=None):
    try:
        run_front(text, budget)
    except OURS as exc:
        message = str(exc)
        assert repr(text) in message and "\n" not in message.strip(), message  # names the expression, one line


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls(), st.one_of(st.none(), st.integers(-2, 64)))
def test_a_random_press_call_parses_or_raises_our_errors(text, budget):
    check(text, budget)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(colon_forms())
def test_a_random_name_and_parameters_form_parses_or_raises_our_errors(text):
    check(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("SnapKVPres(),=:0.5[]{}'\"_ -*@#\\\n")), max_size=40))
def test_random_text_parses_or_raises_our_errors(text):
    try:
        press_spec(text)
    except PressExpressionError:
        pass


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('touch /tmp/kvdiverge-pwned')",
        "SnapKVPress(window_size=__import__('os').getpid())",
        "SnapKVPress(window_size=(lambda: 4)())",
        "eval('1')",
    ],
)
def test_an_expression_never_runs_code(text, tmp_path):
    with pytest.raises(PressExpressionError):
        press_spec(text)
