"""Entry point of a Python module instance: ``python -m instride.flow.worker``.

The runner starts it with ``INSTRIDE_FLOW_SPEC``, ``INSTRIDE_FLOW_MODULE`` and
``INSTRIDE_FLOW_INSTANCE`` in the environment; it builds the instance's :class:`Ports`, calls
the module function ``fn(ports, **params)`` (or, for a class,
``cls(**params)(ports)``) and, when it returns (or calls ``sys.exit()`` / ``sys.exit(0)``),
ends the output streams.
An exception exits with status 1 and its traceback on stderr (the runner then stops the graph).

``python -m instride.flow.worker --end I [I ...]`` is what the runner starts, on its node and
with its environment, when a ``command=`` instance (or an ``mpi=True`` program, with each of
its ranks) has exited with status 0: it does what ``ports.close()`` does for instances ``I``
of ``INSTRIDE_FLOW_MODULE`` that did not call it (:func:`instride.flow.ports.end_instance`), and
says so on stderr (the instance's log).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .ports import end_instance, from_env
from .resolve import resolve


def main(argv: Sequence[str] | None = None) -> int:
    """Run one module instance (or, with ``--end``, end what exited instances left open);
    return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--end"]:
        return end([int(i) for i in args[1:]])
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


def end(instances: Sequence[int]) -> int:
    """For each of ``instances`` of ``$INSTRIDE_FLOW_MODULE``, exited with status 0: end the
    output streams it left open and release its inputs' consumer groups; return the exit
    status."""
    module = os.environ["INSTRIDE_FLOW_MODULE"]
    spec = json.loads(Path(os.environ["INSTRIDE_FLOW_SPEC"]).read_text())
    for i in instances:
        ended = end_instance(spec, module, i)
        if ended:
            ports = " and ".join(f"{p!r} ({n} message{'' if n == 1 else 's'})"
                                 for p, n in ended.items())
            print(f"instride flow: {module}[{i}] exited with status 0 leaving its output "
                  f"streams open (no ports.close()): ended by the runner: {ports}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
