"""The registry of dispatch-path adapters (:class:`~bufreuse.integrations.core.PathAdapter`).

``install()`` asks them in this order; ``requirements`` assembles the matrix from their rows. To
add a dispatcher backend, write ``bufreuse/integrations/<path>/hooks.py`` with an ``ADAPTER`` and list it below
(docs/architecture.md says how). Importing this package imports neither torch nor megatron-core.
"""

from __future__ import annotations

from bufreuse.integrations.alltoall import hooks as alltoall
from bufreuse.integrations.core import PathAdapter
from bufreuse.integrations.hybridep import hooks as hybridep
from bufreuse.integrations.te import hooks as te

__all__ = ["ADAPTERS", "adapter"]

ADAPTERS: tuple[PathAdapter, ...] = (hybridep.ADAPTER, te.ADAPTER, alltoall.ADAPTER)
"""Every adapter, in the order ``install()`` asks them."""


def adapter(name: str) -> PathAdapter:
    """The registered adapter called ``name`` (``alltoall``, ``hybridep``, ``te``)."""
    for a in ADAPTERS:
        if a.name == name:
            return a
    raise KeyError(f"no bufreuse adapter {name!r}; registered: {', '.join(a.name for a in ADAPTERS)}")
