"""``scripts/deepep_output_token.py`` on a small tree shaped like DeepEP hybrid-ep's (our own text, not upstream's).

The edit ran on the real source at the pinned commit on the device (docs/megatron.md); here: where each line
lands, that a second run changes nothing, and that a source which moved on fails by name (exit 2) instead of
editing another function.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "deepep_output_token.py"

PY = """class HybridEPBuffer:
    def dispatch_with_permute(
        self,
        *,
        hidden,
        fuse_permute_dispatch: bool = False,
        use_host_meta: bool = None,
    ):
        out = self.runtime.dispatch_with_permute(
            hidden=hidden,
            with_probs=probs is not None,
        )
        return out

    def combine_with_unpermute(self, *, hidden):
        return self.runtime.combine_with_unpermute(hidden=hidden)
"""
CUH = """struct HybridEPBuffer {
  std::tuple<torch::Tensor> dispatch_with_permute(
            torch::Tensor hidden,
            bool with_probs);
  std::tuple<torch::Tensor> combine_with_unpermute(
            torch::Tensor hidden,
            bool with_probs);
};
"""
CU = """std::tuple<torch::Tensor>
HybridEPBuffer::dispatch_with_permute(
          torch::Tensor hidden,
          bool with_probs)
{
 args.local_expert_output_token =
    torch::empty({handle.num_permuted_tokens, config.hidden_dim}, torch::dtype(hidden.dtype()));
 return args.local_expert_output_token;
}

std::tuple<torch::Tensor>
HybridEPBuffer::combine_with_unpermute(
          torch::Tensor hidden,
          bool with_probs)
{
 args.local_expert_output_token =
    torch::empty({handle.num_permuted_tokens, config.hidden_dim}, torch::dtype(hidden.dtype()));
 return combined;
}
"""
BIND = """        .def("dispatch_with_permute", &HybridEPBuffer::dispatch_with_permute, py::kw_only(),
             py::arg("hidden"),
             py::arg("with_probs") = false)
        .def("combine_with_unpermute", &HybridEPBuffer::combine_with_unpermute, py::kw_only(),
             py::arg("hidden"),
             py::arg("with_probs") = false)
"""


def _tree(root: Path, **override: str) -> Path:
    files = {"deep_ep/hybrid_ep_buffer.py": PY, "csrc/hybrid_ep/hybrid_ep.cuh": CUH, "csrc/hybrid_ep/hybrid_ep.cu": CU,
             "csrc/hybrid_ep/pybind_hybrid_ep.cu": BIND}  # fmt: skip
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(override.get(p.name, text))
    return root


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)


def test_every_edit_lands_in_dispatch_with_permute_only(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    r = _run(root)
    assert r.returncode == 0, r.stderr
    py = (root / "deep_ep/hybrid_ep_buffer.py").read_text()
    disp, comb = py.split("def combine_with_unpermute")
    assert "output_token: torch.Tensor = None" in disp and "output_token=output_token" in disp
    assert "output_token" not in comb
    for name in ("hybrid_ep.cu", "hybrid_ep.cuh", "pybind_hybrid_ep.cu"):
        text = next(root.rglob(name)).read_text()
        disp, comb = text.split("combine_with_unpermute", 1)
        assert "bufreuse: output_token" in disp and "bufreuse: output_token" not in comb, name
    cu = (root / "csrc/hybrid_ep/hybrid_ep.cu").read_text().split("combine_with_unpermute")[0]
    assert cu.index("if (output_token.has_value())") < cu.index("torch::empty") < cu.index(" }\n return")
    assert _run(root).stdout.strip().endswith("already applied")  # idempotent
    assert (root / "csrc/hybrid_ep/hybrid_ep.cu").read_text().count("output_token.has_value()") == 1


@pytest.mark.parametrize(
    ("name", "drifted"),
    [
        ("hybrid_ep.cuh", CUH.replace("bool with_probs);", "bool with_probs, int extra);", 1)),
        ("hybrid_ep.cu", CU.replace("bool with_probs)\n{", "bool with_probs, int extra)\n{", 1)),
        ("pybind_hybrid_ep.cu", BIND.replace('py::arg("with_probs") = false)', 'py::arg("extra"))', 1)),
        ("hybrid_ep_buffer.py", PY.replace("fuse_permute_dispatch: bool = False,", "fused: bool = False,")),
    ],
)
def test_a_source_that_moved_on_fails_by_name_and_writes_nothing(tmp_path: Path, name: str, drifted: str) -> None:
    root = _tree(tmp_path, **{name: drifted})
    before = {p: p.read_text() for p in root.rglob("*") if p.is_file()}
    r = _run(root)
    assert r.returncode == 2 and "expected one match" in r.stderr, r.stderr
    assert {p: p.read_text() for p in root.rglob("*") if p.is_file()} == before  # no file half-edited
