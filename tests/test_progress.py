"""What reaches a user's terminal during long work when logging is not configured."""

import io
import logging
import sys

import pytest

from minigpt.common.progress import announce


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def quiet_logger():
    logger = logging.getLogger("minigpt.test_progress")
    logger.setLevel(logging.WARNING)  # as an unconfigured program leaves it: INFO not shown
    yield logger
    logger.setLevel(logging.NOTSET)


def test_announce_writes_to_a_terminal_when_logging_would_not_show_it(monkeypatch, quiet_logger):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    announce(quiet_logger, "compiled in %.0f s", 12.4)
    assert terminal.getvalue() == "[minigpt] compiled in 12 s\n"


def test_announce_stays_off_stderr_that_is_not_a_terminal(monkeypatch, quiet_logger):
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    announce(quiet_logger, "compiled in %.0f s", 12.4)
    assert piped.getvalue() == ""


def test_announce_goes_to_the_log_when_logging_shows_info(monkeypatch, caplog):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.INFO, logger="minigpt.test_progress"):
        announce(logging.getLogger("minigpt.test_progress"), "compiled in %.0f s", 12.4)
    assert terminal.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == ["compiled in 12 s"]
