"""Reports of runs and staleness studies: ``summary.csv`` and a self-contained ``report.html``."""

from areal_async.report.build import ReportFiles, main, report_paths, write_report, write_study_report
from areal_async.report.runs import ReportInputError, RunMetrics, read_run
from areal_async.report.summary import COLUMNS, DEFAULT_METRIC, DEFAULT_THRESHOLD, DEFAULT_WINDOW, Cell, Threshold

__all__ = ["COLUMNS", "DEFAULT_METRIC", "DEFAULT_THRESHOLD", "DEFAULT_WINDOW", "Cell", "ReportFiles",
           "ReportInputError", "RunMetrics", "Threshold", "main", "read_run", "report_paths", "write_report",
           "write_study_report"]
