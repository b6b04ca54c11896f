"""Interception: making unmodified programs take part in instride.

Three ways, one concept — paths under the managed directory are routed through instride,
every other path is untouched:

* :mod:`~instride.interception.preload` — the ``LD_PRELOAD`` library for any program
  (``instride run -- CMD``): locate ``libinstride_preload.so`` and build environments
  that load it;
* :mod:`~instride.interception.pyopen` — Python's builtin ``open`` routed through
  :func:`instride.open` inside :func:`instride.intercept`;
* ``patch_open.pth`` — installed at the top of ``site-packages``: with
  ``INSTRIDE_PATCH_OPEN=1`` it routes ``open`` of every Python process from start-up,
  for scripts that never import instride.
"""

from __future__ import annotations

from .preload import LIBRARY_NAME, preload_env, preload_path

__all__ = ["LIBRARY_NAME", "preload_env", "preload_path"]
