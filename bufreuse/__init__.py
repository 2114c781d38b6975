"""bufreuse: caller-owned persistent buffer rings for MoE cross-stream buffers.

The feature lives in :mod:`bufreuse.pool` (and :mod:`bufreuse.integrations` for megatron-core);
the toolkit that proves it (sweeps, snapshot reports, log comparison) is the ``bufreuse`` CLI.
Importing this package imports neither torch nor the CLI.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
