"""The paper's workflow benchmark: producers, consumers, backends, timers, study and report.

``instride bench run`` runs one configuration (:func:`instride.bench.workflow_run.run`);
``instride bench study`` runs the five experiments (:func:`instride.bench.study.run_study`).
See ``docs/benchmark.md``.
"""

from __future__ import annotations

from .molecules import BenchConfigError, Model, get_model, model_names
from .workflow_run import BenchRunError, RunConfig, run

__all__ = ["BenchConfigError", "BenchRunError", "Model", "RunConfig", "get_model", "model_names",
           "run"]
