"""Prefect logs a run that ended on a configuration or data error as its message, without a traceback."""

import logging
import sys

import pytest

from flows import user_errors
from flows.jobs import PipelineError
from orchestration.ray_jobs import StageConfigError, StageJobError
from rlhf_core.data.loading import DataError


def record_of(error: BaseException) -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        exc_info = sys.exc_info()
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1,
                             "Encountered exception during execution: %r", (error,), exc_info)


@pytest.mark.parametrize("error", [PipelineError("stage 'sft' is needed"), DataError("d.jsonl row 2: missing key"),
                                   StageConfigError("rlhf-sft-1", "FAILED", 2, "bad", ["x"])])
def test_user_errors_lose_the_traceback_and_keep_the_message(error):
    record = record_of(error)
    assert user_errors.NoTracebackForUserErrors().filter(record)
    assert record.exc_info is None
    assert str(error).splitlines()[0] in logging.Formatter().format(record)


@pytest.mark.parametrize("error", [RuntimeError("boom"), StageJobError("rlhf-sft-1", "FAILED", 1, "died", [])])
def test_other_errors_keep_their_traceback(error):
    record = record_of(error)
    assert user_errors.NoTracebackForUserErrors().filter(record)
    assert record.exc_info is not None
    assert "Traceback" in logging.Formatter().format(record)


def test_the_filter_sits_on_prefects_run_loggers_once():
    import flows.pipeline  # noqa: F401  (installs it)

    user_errors.install()
    for name in user_errors.PREFECT_RUN_LOGGERS:
        filters = [f for f in logging.getLogger(name).filters if isinstance(f, user_errors.NoTracebackForUserErrors)]
        assert len(filters) == 1, name
