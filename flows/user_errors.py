"""Errors the user must fix (bad configuration or data) are logged by Prefect as one line, not a traceback.

Prefect logs every exception that ends a flow or task run with its traceback. For a configuration
or data error the traceback points into our code and hides the one line that says what to change
(the flag, the file, the row): those records keep their message and lose the traceback. Every
other exception keeps its traceback.
"""

from __future__ import annotations

import logging

from orchestration.ray_jobs import StageConfigError
from rlhf_core.data.loading import DataError
from rlhf_core.infra.settings import ConfigError

USER_ERRORS = (ConfigError, DataError, StageConfigError)
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class NoTracebackForUserErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], USER_ERRORS):
            record.exc_info, record.exc_text = None, None
        return True


def install() -> None:
    """Add the filter to Prefect's flow- and task-run loggers (once)."""
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, NoTracebackForUserErrors) for f in logger.filters):
            logger.addFilter(NoTracebackForUserErrors())
