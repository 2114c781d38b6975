"""A stand-in Megatron-LM ``megatron.training`` with the config-container contract (CPU, world size 1).

Mirrors what the entry wrapper relies on in Megatron-LM ``core_r0.19.0`` and later: the script parses
with ``arguments.parse_and_validate_args(extra_args_provider=...)`` (which calls the module-level
``parse_args``), then calls ``pretrain(cfg_container, ...)`` without ``extra_args_provider``;
``pretrain`` builds the model through the module-level ``training.setup_model_and_optimizer``.
"""

from megatron.training.arguments import get_args
from megatron.training.training import pretrain

__all__ = ["get_args", "pretrain"]
