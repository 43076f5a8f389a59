"""Spec-Bench runner: speedup and acceptance per category, side by side with transformers."""

from .data import Question, load_questions
from .methods import Method, parse_methods
from .report import aggregate, write_report
from .runner import BenchConfig, run_benchmark, save_results

__all__ = ["Question", "load_questions", "Method", "parse_methods", "aggregate", "write_report", "BenchConfig",
           "run_benchmark", "save_results"]
