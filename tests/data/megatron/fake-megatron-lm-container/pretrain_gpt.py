"""Stand-in for Megatron-LM core_r0.19's pretrain_gpt.py: parse first, then pretrain(cfg_container, ...)."""

from megatron.training import pretrain
from megatron.training.arguments import parse_and_validate_args


def script_args(parser):
    parser.add_argument("--script-flag", default=None)
    return parser


if __name__ == "__main__":
    args = parse_and_validate_args(extra_args_provider=script_args)
    pretrain({"model": "tiny-moe"}, None, None, None)
