"""megatron-core integration: requirement matrix, hooks, backend adapters, the Megatron entry.

Modules (import what you need; this package imports nothing heavy):
``requirements`` (the matrix, ``check``/``validate``), ``features`` (DeepEP/TE detection),
``check_file`` (``bufreuse check-config``), ``megatron`` (``install``/``uninstall``), ``alltoall``
(NCCL path autograd Functions), ``hybridep`` and ``te`` (adapters), ``entry`` (``bufreuse-megatron``).
"""

__all__: list[str] = []
