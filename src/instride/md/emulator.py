"""An MD emulator: the producer of the paper's workflow, without the physics.

The paper's producers emulate a simulation with a fixed-duration sleep per MD step and, every
``stride`` steps, serialize a frame of the model's atom count. :class:`MDEmulator` does the
same: :meth:`MDEmulator.advance` sleeps ``stride / steps_per_second * time_scale`` seconds,
:meth:`MDEmulator.frame` serializes the current coordinates in the ``paper`` layout (int32 atom
id + 3 x float64 per atom, 28 B/atom, the frame sizes of Table I) as an instride frame (header
with checksums, see :mod:`instride.frames`).

Sleeping
--------
One MD step of JAC lasts 0.93 ms; scaled by a ``time_scale`` of 0.05 it is 47 µs, shorter than
the ~60 µs a ``time.sleep`` call overshoots by. So the default (``sleep="stride"``) sleeps once
per frame for the whole stride, to an absolute deadline. ``sleep="step"`` sleeps once per step
but also to absolute deadlines (step *k* ends at ``start + k * step_time``), so overshoots do
not accumulate: the stride takes the same total time, with ``stride`` wake-ups instead of one.

Examples
--------
>>> emu = MDEmulator(atoms=100, steps_per_second=1000.0, stride=10, time_scale=0.0)
>>> emu.advance()
>>> header, payload = emu.frame()
>>> len(header) + payload.nbytes
2928
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np

from ..frames import PAPER_DTYPE, encode_header, encode_payload

#: Femtoseconds of simulated time per MD step (a 2 fs time step, typical of the paper's models).
FS_PER_STEP = 2.0


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (no busy wait)."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(remaining)


class MDEmulator:
    """A fake MD simulation that sleeps like the real one and emits frames of the right size.

    Parameters
    ----------
    atoms
        Number of atoms of the model.
    steps_per_second
        MD performance to emulate (Table I).
    stride
        Steps between two frames (Table II).
    time_scale
        Multiplies every sleep (1.0 = the paper's timing; 0.0 = no sleep).
    layout
        Frame layout (``"paper"``: 28 B/atom; ``"xyz32"``: 12 B/atom).
    sleep
        ``"stride"`` (one sleep per frame) or ``"step"`` (one per MD step, absolute deadlines).
    seed
        Seed of the initial coordinates.
    """

    def __init__(
        self,
        atoms: int,
        steps_per_second: float,
        stride: int,
        *,
        time_scale: float = 1.0,
        layout: str = "paper",
        sleep: str = "stride",
        seed: int = 0,
    ) -> None:
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (atoms, stride))
        # (NaN passed these and failed later in advance(); inf overflowed there; a float
        # stride gave float steps)
        if not whole or atoms < 1 or stride < 1 or not 0 < steps_per_second < math.inf \
                or not 0 <= time_scale < math.inf:
            raise ValueError(
                "atoms and stride must be whole numbers >= 1, steps_per_second finite and > 0, "
                "time_scale finite and >= 0"
            )
        if sleep not in ("stride", "step"):
            raise ValueError(f"sleep must be 'stride' or 'step', got {sleep!r}")
        self.atoms = atoms
        self.stride = stride
        self.step_seconds = time_scale / steps_per_second
        self.layout = layout
        self.sleep = sleep
        self.step = 0
        rng = np.random.default_rng(seed)
        # Coordinates of a cube of water-like density (~0.1 atoms / Å^3), in Å.
        edge = (atoms / 0.1) ** (1 / 3)
        self.box = np.array([edge, edge, edge])
        start = rng.uniform(0.0, edge, size=(atoms, 3))
        # The payload buffer is built once; each frame updates its coordinates in place.
        self._payload = encode_payload(start, layout)
        self._xyz = self._payload["xyz"] if layout == "paper" else self._payload
        self._drift = rng.normal(0.0, 1e-3, size=3)

    @property
    def period(self) -> float:
        """Seconds of (scaled) sleep between two frames."""
        return self.stride * self.step_seconds

    def advance(self) -> None:
        """Run ``stride`` MD steps: sleep their (scaled) duration."""
        start = time.perf_counter()
        if self.sleep == "stride" or self.step_seconds == 0:
            sleep_until(start + self.period)
        else:
            for k in range(1, self.stride + 1):
                sleep_until(start + k * self.step_seconds)
        self.step += self.stride

    def frame(self) -> tuple[bytes, memoryview]:
        """Serialize the current coordinates: ``(header, payload)`` for ``writelines``."""
        self._xyz += self._drift.astype(self._xyz.dtype)  # the molecule moves a little
        payload = memoryview(self._payload).cast("B")
        header = encode_header(
            self.atoms, self.step, self.step * FS_PER_STEP / 1000.0, self.box, self.layout, payload
        )
        return header, payload

    def frames(self, count: int) -> Iterator[tuple[int, bytes, memoryview]]:
        """Advance and serialize ``count`` frames: yields ``(index, header, payload)``."""
        for index in range(count):
            self.advance()
            header, payload = self.frame()
            yield index, header, payload


__all__ = ["FS_PER_STEP", "MDEmulator", "PAPER_DTYPE", "sleep_until"]
