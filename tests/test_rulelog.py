"""The frame of the workflow's scripts (kvdiverge.jobs.rulelog.rule_log): the body's logger,
stderr into the rule's log, and a failure logged with its traceback, then raised again."""

from __future__ import annotations

import logging
import sys

import pytest

from kvdiverge.jobs.rulelog import rule_log


@pytest.fixture
def log_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # rule_log replaces it: restored after the test
    return tmp_path / "rule.log"


def test_the_body_logs_under_the_rules_name_and_stderr_goes_to_the_log(log_path, caplog):
    with caplog.at_level(logging.INFO), rule_log(str(log_path), "pool") as log:
        assert log.name == "pool"
        log.info("%d rows", 3)
        print("progress 50%", file=sys.stderr)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("pool", "3 rows")]
    assert "progress 50%" in log_path.read_text()


def test_a_failure_is_logged_with_its_traceback_then_raised(log_path, caplog):
    with pytest.raises(KeyError, match="n_docs"), caplog.at_level(logging.INFO):
        with rule_log(str(log_path), "floor", "floor comparison"):
            raise KeyError("n_docs")
    (record,) = caplog.records
    assert record.getMessage() == "floor comparison failed" and record.levelno == logging.ERROR
    assert record.exc_info[0] is KeyError


def test_the_failure_line_names_the_rule_without_a_task(log_path, caplog):
    with pytest.raises(ValueError), caplog.at_level(logging.INFO), rule_log(str(log_path), "summary"):
        raise ValueError("no table")
    assert caplog.records[-1].getMessage() == "summary failed"
