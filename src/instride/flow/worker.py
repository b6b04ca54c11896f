"""Entry point of a Python module instance: ``python -m instride.flow.worker``.

The runner starts it with ``INSTRIDE_FLOW_SPEC``, ``INSTRIDE_FLOW_MODULE`` and
``INSTRIDE_FLOW_INSTANCE`` in the environment; it builds the instance's :class:`Ports`, calls
the module function ``fn(ports, **params)`` (or, for a class,
``cls(**params)(ports)``) and, when it returns (or calls ``sys.exit()`` / ``sys.exit(0)``),
ends the output streams.
An exception exits with status 1 and its traceback on stderr (the runner then stops the graph).
"""

from __future__ import annotations

import sys

from .ports import from_env
from .resolve import resolve


def main() -> int:
    """Run one module instance; return its exit status."""
    ports = from_env()
    target = ports.graph.modules[ports.module].target
    if target is None:
        raise SystemExit(f"module {ports.module!r} is a command, not a Python function")
    fn = resolve(target)
    try:
        if isinstance(fn, type):  # a ModuleBase subclass: parameters go to its constructor
            fn(**ports.params)(ports)
        else:
            fn(ports, **ports.params)
    except SystemExit as exc:
        if exc.code in (None, 0):  # sys.exit() or sys.exit(0): finished, as by returning
            ports.close()  # (else its consumers would wait for its outputs' end for ever)
        raise
    ports.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
