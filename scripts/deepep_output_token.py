"""Add a caller-provided ``output_token`` to DeepEP hybrid-ep's ``dispatch_with_permute`` (bufreuse's own edit).

Upstream HybridEP (deepseek-ai/DeepEP, branch hybrid-ep) allocates the permuted dispatch output with
``torch::empty`` on every call; no ref takes a caller buffer. The dispatch ring needs one: megatron-core's
flex dispatcher hands DeepEP a persistent ring slot (``output_token=``) and the permute kernels write into
it. This script makes the smallest change that allows it, in a staged DeepEP source tree:

- ``deep_ep/hybrid_ep_buffer.py``: a keyword ``output_token`` on ``HybridEPBuffer.dispatch_with_permute``,
  passed on to the C++ runtime;
- ``csrc/hybrid_ep/pybind_hybrid_ep.cu``: the keyword on the binding (default ``None``);
- ``csrc/hybrid_ep/hybrid_ep.cu{h,}``: the parameter; when given, the tensor is checked (CUDA, contiguous,
  the hidden dtype, exactly ``[num_permuted_tokens, hidden]``) and used instead of the ``torch::empty``.

Every edit adds lines or extends a parameter list; each is located by the names it touches and must match
exactly once, so a DeepEP that moved on fails here by name instead of building something else. No upstream
text is kept in this repository. Combine needs no change: the expert ring hands HybridEP's combine its input
(the FC2 output), which combine only reads.

Usage: python3 scripts/deepep_output_token.py SRC_DIR   (idempotent; exit 2 when an anchor is missing)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARK = "bufreuse: output_token"

CHECKS = """\
 if (output_token.has_value()) {  // %(mark)s: the caller's buffer (a ring slot) instead of a fresh allocation
   const torch::Tensor& out = output_token.value();
   TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "output_token must be a contiguous CUDA tensor");
   TORCH_CHECK(out.scalar_type() == hidden.scalar_type(), "output_token has dtype ", out.scalar_type(),
               ", the dispatched tokens ", hidden.scalar_type());
   TORCH_CHECK(out.dim() == 2 && out.size(0) == handle.num_permuted_tokens && out.size(1) == config.hidden_dim,
               "output_token must be [", handle.num_permuted_tokens, ", ", config.hidden_dim, "], got ", out.sizes());
   args.local_expert_output_token = out;
 } else {
"""


class AnchorError(Exception):
    """An anchor matched zero or several times."""


def _once(pattern: str, text: str, where: str, flags: int = re.S) -> re.Match[str]:
    found = list(re.finditer(pattern, text, flags))
    if len(found) != 1:
        raise AnchorError(f"{where}: expected one match of {pattern!r}, found {len(found)}")
    return found[0]


def _insert(text: str, at: int, new: str) -> str:
    return text[:at] + new + text[at:]


def edit_python(text: str) -> str:
    where = "deep_ep/hybrid_ep_buffer.py"
    body = _once(r"def dispatch_with_permute\(.*?\n    def ", text, where)
    seg = body.group(0)
    sig = _once(r"\n(\s+)fuse_permute_dispatch: bool = False,\n", seg, where + " signature")
    seg = _insert(seg, sig.end(), f"{sig.group(1)}output_token: torch.Tensor = None,  # {MARK}\n")
    call = _once(
        r"self\.runtime\.dispatch_with_permute\(.*?\n(\s+)with_probs=probs is not None,\n", seg, where + " runtime call"
    )
    seg = _insert(seg, call.end(), f"{call.group(1)}output_token=output_token,  # {MARK}\n")
    return text[: body.start()] + seg + text[body.end() :]


def edit_binding(text: str) -> str:
    where = "csrc/hybrid_ep/pybind_hybrid_ep.cu"
    m = _once(r'\.def\("dispatch_with_permute"(?:(?!\.def\().)*?py::arg\("with_probs"\) = false', text, where)
    return _insert(text, m.end(), f',\n             py::arg("output_token") = c10::nullopt  // {MARK}\n            ')


def _extend_params(text: str, where: str, head: str) -> str:
    m = _once(head + r"\(([^)]*?)bool with_probs\)", text, where)  # within the one parameter list
    return _insert(text, m.end() - 1, f",\n            c10::optional<torch::Tensor> output_token /* {MARK} */")


def edit_header(text: str) -> str:
    return _extend_params(text, "csrc/hybrid_ep/hybrid_ep.cuh", r"\bdispatch_with_permute")


def edit_source(text: str) -> str:
    where = "csrc/hybrid_ep/hybrid_ep.cu"
    text = _extend_params(text, where, r"HybridEPBuffer::dispatch_with_permute")
    body = _once(r"HybridEPBuffer::dispatch_with_permute\(", text, where).end()
    close = re.search(r"\n}\n", text[body:])  # the function's closing brace: the first at column 0
    if close is None:
        raise AnchorError(f"{where}: no closing brace after dispatch_with_permute")
    end = close.end()
    alloc = _once(
        r"\n( *args\.local_expert_output_token *=\s*torch::empty\(\{handle\.num_permuted_tokens, "
        r"config\.hidden_dim\}[^;]*;)\n",
        text[body : body + end],
        where + " output allocation",
    )
    start, end = body + alloc.start(1), body + alloc.end(1)
    return text[:start] + CHECKS % {"mark": MARK} + text[start:end] + "\n }" + text[end:]


EDITS = {
    "deep_ep/hybrid_ep_buffer.py": edit_python,
    "csrc/hybrid_ep/pybind_hybrid_ep.cu": edit_binding,
    "csrc/hybrid_ep/hybrid_ep.cuh": edit_header,
    "csrc/hybrid_ep/hybrid_ep.cu": edit_source,
}


def apply(src: Path) -> list[str]:
    """Edit the DeepEP tree at ``src`` in place; returns what changed (nothing when already applied)."""
    new: dict[Path, str] = {}
    for rel, edit in EDITS.items():
        path = src / rel
        text = path.read_text()
        if MARK in text:
            continue
        new[path] = edit(text)  # every anchor is checked before any file is written
    for path, text in new.items():
        path.write_text(text)
    return [str(p.relative_to(src)) for p in new]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0], "deep_ep").is_dir():
        print("usage: deepep_output_token.py SRC_DIR  (a DeepEP hybrid-ep source tree)", file=sys.stderr)
        return 2
    try:
        changed = apply(Path(argv[0]))
    except (AnchorError, OSError) as e:
        print(f"deepep_output_token: {e}", file=sys.stderr)
        return 2
    print(f"deepep_output_token: {', '.join(changed) or 'already applied'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
