"""megatron-core integration: the core, the dispatch-path adapters, the requirement matrix, the entry.

Modules (import what you need; this package imports nothing heavy): ``core`` (``Installation``,
``Held``, buffer names, the ``PathAdapter`` protocol), ``registry`` (``ADAPTERS``:
the ``hybridep``, ``te``, ``alltoall`` path adapters), ``megatron`` (``install``/``installed``), ``requirements`` (the
matrix, ``check``/``validate``), ``_compat_megatron`` (every megatron-core private API we use),
``features`` (DeepEP/TE detection), ``check_file`` (``bufreuse check-config``), ``graphs``
(full-iteration CUDA graphs), ``alltoall``/``hybridep``/``te`` (one folder per dispatch path: ``hooks`` is
the adapter, beside the helpers it owns), ``entry``
(``bufreuse-megatron``), ``preflight`` (its one-line refusals of HybridEP set-ups), ``gloo_grad_sync`` (megatron's
DDP grad sync over gloo).
"""

__all__: list[str] = []
