"""The molecular models of the paper's study (Tables I and II), read from package data.

The numbers live in ``instride/data/models.json`` (with the paper's reported ratios, used by the
study report), never as constants scattered in code.

Examples
--------
>>> from instride.bench.molecules import get_model
>>> jac = get_model("JAC")
>>> jac.atoms, jac.stride, round(jac.frame_period, 2)
(23558, 880, 0.82)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ..errors import InstrideError
from ..frames import frame_size


class BenchConfigError(InstrideError, ValueError):
    """A benchmark configuration that cannot run (unknown model, bad count, wrong backend)."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"bad benchmark setting {what}: {detail}")


@cache
def paper_data() -> dict[str, Any]:
    """The parsed ``models.json``: models (Tables I/II), study settings and paper results."""
    text = resources.files("instride").joinpath("data/models.json").read_text()
    return json.loads(text)


@dataclass(frozen=True)
class Model:
    """One molecular model: Table I (atoms, frame size, steps/s) and Table II (stride).

    Attributes
    ----------
    name
        Model name (``"JAC"``, ``"ApoA1"``, ``"F1-ATPase"``, ``"STMV"`` or ``"atoms<N>"``).
    atoms
        Number of atoms.
    steps_per_second
        MD performance the paper derived from NAMD benchmarks.
    stride
        MD steps between two frames (Table II), chosen so that every model emits a frame
        every 0.82 s.
    frame_size_paper
        The frame size printed in Table I (text).
    """

    name: str
    atoms: int
    steps_per_second: float
    stride: int
    frame_size_paper: str = ""

    @property
    def step_seconds(self) -> float:
        """Seconds of one MD step (1 / steps per second)."""
        return 1.0 / self.steps_per_second

    @property
    def frame_period(self) -> float:
        """Seconds between two frames at the default stride (Table II: 0.82 s)."""
        return self.stride * self.step_seconds

    def frame_bytes(self, layout: str = "paper") -> int:
        """Bytes of one frame file (128-byte header included) in ``layout``."""
        return frame_size(self.atoms, layout)


def model_names() -> list[str]:
    """Names of the paper's models, smallest first."""
    return list(paper_data()["models"])


def get_model(name: str | None = None, *, atoms: int | None = None) -> Model:
    """Return a paper model by name, or a custom model of ``atoms`` atoms.

    A custom model takes JAC's steps per second and stride unless ``name`` is also given, in
    which case the named model's timing is used with the custom atom count.

    Raises
    ------
    BenchConfigError
        Unknown model name, or a non-positive atom count.
    """
    models = paper_data()["models"]
    base: dict[str, Any] | None = None
    if name is not None:
        match = {k.lower().replace("-", "").replace("_", ""): k for k in models}
        canon = match.get(name.lower().replace("-", "").replace("_", "").replace(" ", ""))
        if canon is None:
            raise BenchConfigError(
                "model", f"unknown model {name!r}; expected one of {list(models)}"
            )
        base = models[canon]
        name = canon
    if atoms is not None:
        if isinstance(atoms, bool) or not isinstance(atoms, int) or atoms < 1:
            raise BenchConfigError("atoms", f"expected a positive integer, got {atoms!r}")
        timing = base or models["JAC"]
        return Model(
            name=f"{name}-{atoms}atoms" if name else f"atoms{atoms}",
            atoms=atoms,
            steps_per_second=float(timing["steps_per_second"]),
            stride=int(timing["stride"]),
        )
    if base is None:
        raise BenchConfigError("model", "give a model name or an atom count")
    return Model(
        name=str(name),
        atoms=int(base["atoms"]),
        steps_per_second=float(base["steps_per_second"]),
        stride=int(base["stride"]),
        frame_size_paper=str(base["frame_size"]),
    )


__all__ = ["BenchConfigError", "Model", "get_model", "model_names", "paper_data"]
