"""The needle task: scoring, needle placement, bad input, greedy answers from trajectory rows,
the accuracy / correlation / AUC tables on hand-made documents, and on the embedded model the
full cache's accuracy and a press keeping only the last 64 tokens failing early needles."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiverge.data.tasks import TaskError, build_task_prompts, task_settings
from kvdiverge.data.tasks.answers import greedy_pair
from kvdiverge.data.tasks.niah import (
    NEEDLE,
    Needle,
    NiahSettings,
    check_budget,
    insert_needle,
    make_needle,
    needle_depth,
    score_answer,
    string_match_all,
)
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.task import accuracy_table, auc_table, correlation_table, roc_auc


class CharTokenizer:
    """One token per character (ids are code points); enough for the budget check."""

    all_special_ids = [0]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def doc(*words_per_paragraph: int) -> str:
    return "\n\n".join(" ".join(f"w{i}" for i in range(n)) for n in words_per_paragraph)


# --- scoring (RULER's string_match_all) ---------------------------------------------------


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("The special magic number is 7311.", True),
        ("7311", True),
        ("7,311", False),  # a digit-group separator is not the value's string
        ("73110", True),  # RULER's substring test: the value occurs inside
        ("I do not know the number.", False),
        ("", False),
    ],
)
def test_score_answer_on_hand_written_answers(answer, expected):
    assert score_answer(answer, "7311") is expected


def test_string_match_all_is_the_share_of_references_found_ignoring_case():
    assert string_match_all("Alpha and BETA", ["alpha", "beta", "gamma", "delta"]) == 0.5
    with pytest.raises(TaskError, match="at least one reference"):
        string_match_all("x", [])


# --- needles ------------------------------------------------------------------------------


def test_needle_is_seeded_has_the_digits_and_takes_the_depths_in_turn():
    s = NiahSettings(depths=(0, 50, 100), digits=7, seed=3)
    a, b = make_needle(s, "doc-a", 4), make_needle(s, "doc-a", 4)
    assert a == b and len(a.value) == 7 and a.value[0] != "0" and a.depth == 50.0
    assert make_needle(s, "doc-b", 0).value != a.value or make_needle(s, "doc-b", 0).key != a.key
    assert make_needle(NiahSettings(seed=4), "doc-a", 4).value != a.value
    assert [make_needle(s, "d", i).depth for i in range(4)] == [0.0, 50.0, 100.0, 0.0]
    assert len(make_needle(NiahSettings(digits=3), "d", 0).value) == 3


def test_needle_goes_to_the_nearest_paragraph_boundary_by_words():
    text = doc(10, 30, 40, 20)  # boundaries at 0, 10, 40, 80, 100 percent of 100 words
    assert needle_depth(text, 0, 15) == (0, 0.0)
    assert needle_depth(text, 50, 15) == (2, 40.0)
    assert needle_depth(text, 100, 15) == (4, 100.0)
    haystack, at = insert_needle(text, Needle("calm-otter", "1234567", 75), 15)
    paras = haystack.split("\n\n")
    assert at == 80.0 and paras[3] == NEEDLE.format(key="calm-otter", value="1234567") and len(paras) == 5


# --- bad input: one sentence each --------------------------------------------------------


def test_document_too_short_for_a_depth_is_refused():
    with pytest.raises(TaskError, match=r"too short for needle depth 50%.*allow depths 0, 10, 100%"):
        needle_depth(doc(10, 90), 50, 15, "d1")


def test_corpus_without_paragraphs_is_refused():
    with pytest.raises(TaskError, match=r"document 'd2' has no paragraph break"):
        needle_depth("one long paragraph without any blank line", 0, 15, "d2")


def test_needle_longer_than_the_budget_is_refused():
    check_budget(CharTokenizer(), "1234567", 8)  # " 1234567": 8 tokens, fits
    with pytest.raises(TaskError, match=r"takes 8 tokens, more than the answer budget decoding.max_new_tokens = 7"):
        check_budget(CharTokenizer(), "1234567", 7)


def test_bad_task_settings_are_refused_naming_the_key():
    cases = {
        "task.question: 'before' is not allowed; allowed: one of 'inside', 'after'": {"question": "before"},
        "task.depths: [120] is not allowed; allowed: ": {"depths": [120]},
        "task.name: 'mkey' is not allowed; allowed: one of 'niah', 'multikey', 'recall'": {"name": "mkey"},
        "task.digits: not a setting of task 'recall'; its settings: answer_words, depths, phrase_words": {
            "name": "recall",
            "digits": 7,
        },
        "task.digits: 2.5 is not an integer; allowed: an integer >= 1 and <= 18": {"digits": 2.5},
        "task.digits: '7' is not allowed; allowed: an integer >= 1 and <= 18": {"digits": "7"},
        "task.depth_tolerance: nan is not a finite number; allowed: a number >= 0 and <= 100": {
            "depth_tolerance": float("nan")
        },
        "task: unknown key 'depth'; allowed: name, depths, digits": {"depth": [50]},
        "task: 1 is not a task; allowed: a task name": 1,
        "task: ['niah'] is not a task; allowed: a task name": ["niah"],
    }
    for message, block in cases.items():
        with pytest.raises(TaskError) as info:
            task_settings(block)
        assert str(info.value).startswith(message), (block, str(info.value))
    assert task_settings({"digits": 3.0})[1].digits == 3  # an integral float is the integer


# --- greedy answers from trajectory rows ---------------------------------------------------


def row(**kw):
    base = {
        "policy": "p",
        "doc_id": "d",
        "t_star": None,
        "x_star": None,
        "y_star": None,
        "branch_x": [],
        "branch_y": [],
    }
    return {**base, **kw}


def test_greedy_pair_rebuilds_both_answers_from_chain_and_branch():
    r = row(
        chain_token=[5, 6, -1, -1], tv=[0.0, 0.0, 1.0, None], t_star=3, x_star=7, y_star=8, branch_x=[9], branch_y=[4]
    )
    assert greedy_pair(r) == ([5, 6, 7, 9], [5, 6, 8, 4])
    same = row(chain_token=[5, 6, 2, 2], tv=[0.0, 0.0, 0.0, 0.0])
    assert greedy_pair(same) == ([5, 6, 2, 2], [5, 6, 2, 2])
    with pytest.raises(ValueError, match="not greedy; the task's answers need decoding.temperature 0"):
        greedy_pair(row(chain_token=[5, 6], tv=[0.0, 0.25]))


# --- tables --------------------------------------------------------------------------------


def frame(points: dict[str, list[tuple[bool, bool, float]]]) -> pl.DataFrame:
    """(correct_full, correct, E_M) per document, per policy."""
    rows = [
        {"model": "m", "split": "exploratory", "policy": p, "doc_id": f"d{i}", "correct_full": f, "correct": c}
        | {"E_M": e, "p_div": float(e > 0), "tau_first": 17.0 - 16 * e, "S_answer": 1.0 - e, "tv_max": float(e > 0)}
        for p, docs in points.items()
        for i, (f, c, e) in enumerate(docs)
    ]
    return pl.DataFrame(rows)


POINTS = {
    "none": [(True, True, 0.0), (True, True, 0.0), (False, False, 0.0), (True, True, 0.0)],
    "a@0.5": [(True, True, 0.0), (True, True, 0.1), (False, False, 0.2), (True, False, 0.5)],
    "a@0.9": [(True, False, 0.6), (True, True, 0.2), (False, True, 0.7), (True, False, 0.8)],
    "b@0.9": [(True, False, 0.9), (True, False, 0.7), (False, False, 0.9), (True, False, 1.0)],
}


def test_accuracy_table_counts_failed_broken_and_fixed_and_the_control_is_exactly_zero():
    t = {r["policy"]: r for r in accuracy_table(frame(POINTS), boot=Bootstrap(200)).iter_rows(named=True)}
    assert t["none"]["drop"] == 0.0 and t["none"]["drop_lo"] == 0.0 and t["none"]["drop_hi"] == 0.0
    assert t["none"]["tv_max"] == 0.0
    a = t["a@0.9"]
    assert (a["full_accuracy"], a["accuracy"], a["drop"]) == (0.75, 0.5, 0.25)
    assert (a["n_full_failed"], a["n_broken"], a["n_fixed"]) == (1, 2, 1)
    assert a["accuracy_kept"] == pytest.approx(1 / 3)
    assert a["E_M"] == pytest.approx(0.575)
    assert a["drop_lo"] <= a["drop"] <= a["drop_hi"]


def test_correlations_rank_the_points_and_leave_out_the_controls():
    t = correlation_table(frame(POINTS), controls=["none"], boot=Bootstrap(200))
    r = {row["measure"]: row for row in t.iter_rows(named=True)}
    # drops 0.25, 0.25, 0.75 against mean E[M] 0.2, 0.575, 0.875: one tie in the drop
    assert r["E_M"]["n_points"] == 3 and r["E_M"]["n_docs"] == 4
    assert r["E_M"]["spearman"] == pytest.approx(np.sqrt(3) / 2)
    assert r["tau_first"]["spearman"] == pytest.approx(-np.sqrt(3) / 2)
    assert r["E_M"]["spearman_lo"] <= r["E_M"]["spearman"] <= r["E_M"]["spearman_hi"]


def test_roc_auc_counts_pairs_with_ties_one_half():
    score = np.array([0.9, 0.4, 0.4, 0.1])
    broken = np.array([True, True, False, False])
    # pairs (broken, kept): (0.9,0.4) 1, (0.9,0.1) 1, (0.4,0.4) 1/2, (0.4,0.1) 1 -> 3.5 / 4
    assert roc_auc(score, broken) == 0.875
    assert np.isnan(roc_auc(score, np.zeros(4, bool)))


def test_auc_table_orients_measures_and_uses_only_documents_the_full_cache_answers():
    t = {
        r["measure"]: r for r in auc_table(frame(POINTS), controls=["none"], boot=Bootstrap(200)).iter_rows(named=True)
    }
    assert t["E_M"]["n_pairs"] == 9 and t["E_M"]["n_broken"] == 6
    # kept E[M] 0.0, 0.1, 0.2; broken 0.5, 0.6, 0.8, 0.9, 0.7, 1.0: perfect separation
    assert t["E_M"]["auc"] == 1.0 and t["S_answer"]["auc"] == 1.0 and t["tau_first"]["auc"] == 1.0


# --- the prompts table --------------------------------------------------------------------


def test_task_prompts_exclude_documents_the_task_cannot_use_with_the_reason():
    class Chat(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
            return "<u>" + messages[-1]["content"] + "</u><a>"

    docs = pl.DataFrame(
        {
            "doc_id": ["a", "b", "c"],
            "split": ["exploratory"] * 3,
            "text": [doc(40, 40, 40, 40), "no breaks here", doc(5, 95)],
        }
    )
    settings = {"task": {"depths": [50, 0, 50]}, "seed": 1, "max_new_tokens": 16, "minimums": {}}
    p = build_task_prompts(docs, Chat(), settings, context=100_000)
    reasons = dict(zip(p["doc_id"], p["exclusion_reason"]))
    assert (
        reasons["a"] is None
        and "no paragraph break" in reasons["b"]
        and "too short for needle depth 50%" in reasons["c"]
    )
    a = p.filter(pl.col("doc_id") == "a").row(0, named=True)
    text = "".join(map(chr, a["input_ids"]))
    assert f"is: {a['needle_value']}." in text and a["needle_at"] == 50.0
    assert text.endswith(" The special magic numbers for " + a["needle_key"] + " mentioned in the provided text are")
    assert a["n_question"] == 0
    after = build_task_prompts(docs, Chat(), {**settings, "task": {"depths": [50], "question": "after"}}, 100_000)
    a2 = after.filter(pl.col("doc_id") == "a").row(0, named=True)
    tail = "".join(map(chr, a2["input_ids"][-a2["n_question"] :]))
    assert tail.startswith("What are all the special magic numbers for " + a2["needle_key"])


# --- doors ---------------------------------------------------------------------------------


def test_measure_task_refuses_sampling_and_builds_documents_with_their_question():
    from kvdiverge.doors.measuring import MeasureOptions, task_inputs

    def _task_inputs(task, prompts, tokenizer, T, temperature):
        opts = MeasureOptions.checked({"temperature": temperature}, task=task, max_new_tokens=T)
        return task_inputs(opts, prompts, tokenizer)

    class Chat(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
            return "<u>" + messages[-1]["content"] + "</u><a>"

    prompts = {"a": doc(40, 40, 40, 40), "b": "no breaks here"}
    with pytest.raises(ValueError, match=r"task='niah' scores greedy answers: pass temperature=0 \(got 0.7\)"):
        _task_inputs("niah", prompts, Chat(), 16, 0.7)
    with pytest.warns(UserWarning, match="left out of the task: document 'b' has no paragraph break"):
        docs, table = _task_inputs({"name": "niah", "question": "after", "depths": [50]}, prompts, Chat(), 16, 0.0)
    assert [d.doc_id for d in docs] == ["a"] and table.height == 2
    tail = "".join(map(chr, docs[0].input_ids[docs[0].context_len :]))
    assert tail.startswith("What are all the special magic numbers for ")
    with pytest.raises(TaskError, match="no prompt takes the task: document 'b' has no paragraph break"):
        _task_inputs("niah", {"b": "no breaks here"}, Chat(), 16, 0.0)
    # an empty block is the default task, as the config's ``task: {}``: the same needles as "niah"
    docs, table = _task_inputs({}, {"a": prompts["a"]}, Chat(), 16, 0.0)
    same, _ = _task_inputs("niah", {"a": prompts["a"]}, Chat(), 16, 0.0)
    assert [d.input_ids for d in docs] == [d.input_ids for d in same] and table["needle_value"][0] is not None


# --- quote recall --------------------------------------------------------------------------

RECALL_TEXT = (
    "We met at dawn. The river rose above the old stone bridge near the mill that spring. "
    "Then it fell.\n\nIn the fall the farmers brought their grain to the market in town by cart."
)


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("near the mill that spring", True),
        ('"The river rose above the old stone bridge NEAR THE MILL', True),  # case ignored, re-quoted
        ("near, the mill", True),  # punctuation ignored
        ("near the old mill", False),  # a word between
        ("the mill near", False),  # order
        ("", False),
    ],
)
def test_recall_score_needs_the_words_in_order_next_to_each_other(answer, expected):
    from kvdiverge.data.tasks.recall import score_answer as recall_score

    assert recall_score(answer, "near the mill") is expected


def test_recall_quotes_the_askable_sentence_nearest_the_depth():
    from kvdiverge.data.tasks.recall import RecallSettings, make_needle, quoted_sentence

    s = RecallSettings(depths=(0, 100), phrase_words=4, answer_words=3)
    # 35 words; sentences start at words 0 (4 words: too short for 4 + 3 + 1), 4 (13), 17 (3), 20 (15)
    assert quoted_sentence(RECALL_TEXT, 0, s) == (4, 100 * 4 / 35)
    assert quoted_sentence(RECALL_TEXT, 100, s) == (20, 100 * 20 / 35)
    first, last = make_needle(s, "d", 0, RECALL_TEXT), make_needle(s, "d", 1, RECALL_TEXT)
    assert (first.key, first.value, first.depth) == ("The river rose above", "the old stone", 0.0)
    assert (last.key, last.value, last.depth) == ("In the fall the", "farmers brought their", 100.0)
    with pytest.raises(TaskError, match="no sentence of 18 words or more"):
        quoted_sentence(RECALL_TEXT, 50, RecallSettings(phrase_words=10, answer_words=7))
    repeated = "One two three four five six seven eight. One two three four five six seven eight."
    with pytest.raises(TaskError, match="first 4 words occur once"):
        quoted_sentence(repeated, 0, RecallSettings(phrase_words=4, answer_words=2))


def test_recall_prompts_quote_the_document_and_open_the_answer_with_the_quote():
    class Chat(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
            return "<u>" + messages[-1]["content"] + "</u><a>"

    docs = pl.DataFrame({"doc_id": ["a", "b"], "split": ["exploratory"] * 2, "text": [RECALL_TEXT, "Too short."]})
    task = {"name": "recall", "depths": [100], "phrase_words": 4, "answer_words": 3, "question": "after"}
    p = build_task_prompts(docs, Chat(), {"task": task, "seed": 1, "max_new_tokens": 64, "minimums": {}}, 10**5)
    a, b = p.row(0, named=True), p.row(1, named=True)
    text = "".join(map(chr, a["input_ids"]))
    assert text.startswith("<u>Read the text below. I will ask you to continue a quote from it.\n" + RECALL_TEXT)
    assert text.endswith(
        '\nContinue this quote from the text above, word for word: "In the fall the</u><a> "In the fall the'
    )
    assert (a["needle_key"], a["needle_value"], a["needle_at"]) == (
        "In the fall the",
        "farmers brought their",
        100 * 20 / 35,
    )
    assert "".join(map(chr, a["input_ids"][-a["n_question"] :])).startswith("Continue this quote")
    assert b["needle_value"] is None and "nothing to quote" in b["exclusion_reason"]


# --- RULER's multi-key needle ------------------------------------------------------------


def test_multikey_places_the_asked_needle_at_its_depth_and_the_distractors_elsewhere():
    from kvdiverge.data.tasks.multikey import MultikeySettings, distractors

    class Chat(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
            return "<u>" + messages[-1]["content"] + "</u><a>"

    text = doc(10, 30, 40, 20)  # boundaries at 0, 10, 40, 80, 100 percent of 100 words
    docs = pl.DataFrame({"doc_id": ["a"], "split": ["exploratory"], "text": [text]})
    task = {"name": "multikey", "depths": [75], "distractors": 3, "question": "after"}
    p = build_task_prompts(docs, Chat(), {"task": task, "seed": 1, "max_new_tokens": 64, "minimums": {}}, 10**5)
    row = p.row(0, named=True)
    settings = MultikeySettings(depths=(75,), seed=1, distractors=3)
    asked = make_needle(settings, "a", 0)
    others = distractors(settings, "a", asked)
    assert (row["needle_key"], row["needle_value"], row["needle_at"]) == (asked.key, asked.value, 80.0)
    assert len({asked.key, *(o.key for o in others)}) == 4 and all(len(o.value) == 7 for o in others)
    prompt = "".join(map(chr, row["input_ids"]))
    paras = prompt.split("</u>")[0].split("\n\n")
    needles = [p for p in paras if p.startswith("One of the special magic numbers")]
    assert len(needles) == 4 and NEEDLE.format(key=asked.key, value=asked.value) in needles
    # the asked needle follows the third paragraph (80 % of the words before it); no distractor there
    at = paras.index(NEEDLE.format(key=asked.key, value=asked.value))
    assert paras[at - 1] == " ".join(f"w{i}" for i in range(40))
    assert paras[at + 1].split("\n")[0] == " ".join(f"w{i}" for i in range(20))  # then the question
    assert prompt.endswith(f"What are all the special magic numbers for {asked.key} mentioned in the provided text?"
                           f"</u><a> The special magic numbers for {asked.key} mentioned in the provided text are")  # fmt: skip
    assert build_task_prompts(docs, Chat(), {"task": task, "seed": 1, "max_new_tokens": 64, "minimums": {}}, 10**5)[
        "input_ids"
    ].to_list() == [row["input_ids"]]  # seeded: the same needles and places


@pytest.mark.parametrize("digits, count", [(1, 3), (1, 16), (2, 16)])
def test_no_distractor_carries_the_asked_needles_value(digits, count):
    from kvdiverge.data.tasks.multikey import MultikeySettings, distractors

    settings = MultikeySettings(digits=digits, seed=2, distractors=count)
    values = set()
    for i in range(400):
        asked = make_needle(settings, f"doc-{i}", i)
        others = distractors(settings, f"doc-{i}", asked)
        assert len(others) == count and len({asked.key, *(o.key for o in others)}) == count + 1
        assert all(len(o.value) == digits and o.value != asked.value for o in others), (i, asked, others)
        again = distractors(settings, f"doc-{i}", asked)
        assert [(o.key, o.value) for o in again] == [(o.key, o.value) for o in others]  # seeded: the same draws
        values.update(o.value for o in others)
    assert len(values) == 9 * 10 ** (digits - 1)  # every value but the asked one stays possible


@pytest.mark.miniature
def test_measure_takes_an_empty_task_block_as_the_default_needle():
    import kvpress
    import torch

    import kvdiverge
    from kvdiverge.models.standins import MINIATURE, random_model

    class Chat(CharTokenizer):  # code points below the miniature's vocabulary of 512
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
            return "<u>" + messages[-1]["content"] + "</u><a>"

        def decode(self, ids, **kw):
            return "".join(map(chr, ids))

    torch.set_num_threads(1)
    model = random_model(MINIATURE["llama-3.1-8b"], seed=1)
    prompts = {"a": doc(10, 10, 10, 10), "b": doc(12, 10, 10, 10)}
    tables = {}
    for task in ({}, "niah"):
        m = kvdiverge.measure(model, Chat(), prompts, {"snap": kvpress.SnapKVPress(compression_ratio=0.5)}, task=task,
                              temperature=0, max_new_tokens=8, replicates=1, bootstrap=20, progress=False)  # fmt: skip
        tables[str(task)] = m.task["documents"]
    assert tables["{}"].height == 2 and tables["{}"].equals(tables["niah"])
