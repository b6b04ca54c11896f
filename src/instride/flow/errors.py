"""Typed errors of :mod:`instride.flow`.

Every error derives from :class:`instride.errors.InstrideError` (through :class:`FlowError`)
and from the builtin it refines: a bad graph is a :class:`ValueError`, a failed run a
:class:`RuntimeError`.
"""

from __future__ import annotations

from ..errors import InstrideError


class FlowError(InstrideError):
    """Root of the dataflow errors."""


class GraphError(FlowError, ValueError):
    """A graph is not valid; raised by :meth:`Graph.validate` before anything starts."""


class UnknownModuleError(GraphError, KeyError):
    """A connection or placement names a module or port the graph does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnconnectedInputError(GraphError):
    """A blocking input port has no connection: its module's ``wait()`` would block forever."""


class PortTypeError(GraphError, TypeError):
    """A connection joins ports of different message types."""


class DeadlockError(GraphError):
    """A cycle of blocking connections carries no initial token: no module in it could start."""


class UnknownNodeError(GraphError):
    """A module is placed on a node the launcher does not have."""


class UnknownRunError(FlowError, LookupError):
    """``instride top RUN`` names a run that is not recorded (never started, or ended)."""


class ModuleFailed(FlowError, RuntimeError):
    """A module instance exited with an error; the graph was stopped.

    Attributes
    ----------
    module, instance
        The failing module and instance number.
    returncode
        Its exit status (negative: killed by that signal).
    log
        The last lines of its standard error.
    """

    def __init__(self, module: str, instance: int, returncode: int | None, log: str) -> None:
        self._init_args = (module, instance, returncode, log)
        self.module = module
        self.instance = instance
        self.returncode = returncode
        self.log = log
        tail = f"\n{log}" if log else ""
        super().__init__(
            f"module {module!r} instance {instance} failed (exit status {returncode}); "
            f"the graph was stopped{tail}"
        )


class FlowTimeout(FlowError, TimeoutError):
    """The graph ran longer than the run's timeout and was stopped."""


class PortBlocked(FlowError, TimeoutError):
    """A ``put`` waited longer than the graph's ``put_timeout`` for consumers to take the
    oldest message of a full output stream (a consumer stalled or died).

    Attributes
    ----------
    module, instance, port
        The producer's output port.
    groups
        The consumer groups (``<module>.<instance>.<port>`` of each consumer) that held the
        oldest message back.
    waited
        Seconds the ``put`` waited.
    """

    def __init__(self, module: str, instance: int, port: str, groups: list[str],
                 waited: float) -> None:
        self._init_args = (module, instance, port, list(groups), waited)
        self.module, self.instance, self.port = module, instance, port
        self.groups, self.waited = list(groups), waited
        super().__init__(
            f"module {module!r} instance {instance} output {port!r}: the stream is full and "
            f"consumer group(s) {', '.join(groups) or '(none)'} did not take its oldest message "
            f"within {waited:.1f} s (a consumer stalled or died)"
        )
