"""``parse_args`` / ``parse_and_validate_args`` as upstream calls them (unknown arguments are errors)."""

import argparse

_ARGS = None


def get_args():
    return _ARGS


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--moe-token-dispatcher-type", default="alltoall")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args()


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):  # noqa: B006
    global _ARGS
    _ARGS = parse_args(extra_args_provider, ignore_unknown_args)
    return _ARGS
