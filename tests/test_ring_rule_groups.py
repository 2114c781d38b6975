"""install() decides the unused rings (and their bounds) on the dispatcher's real group sizes, not the config's.

Real megatron-core ``MoELayer`` on CPU (gloo world of one, EP = 1). megatron-core's ``MoETokenDispatcher``
holds ``ep_size`` (from ``pg_collection.ep``) and ``tp_size`` (from ``pg_collection.expt_tp``); a custom
``pg_collection`` can make them differ from the config's fields. A mismatch is made by setting those
attributes on the real dispatcher; nothing runs a forward at EP > 1 (no second rank on CPU), so the tests
read what ``install()`` decided: the rings registered, ``Installation.unused``, the bounds, the warning.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cpu import cpu_moe_layer, moe_forward

from bufreuse.config import BufReuseConfig, static_bounds
from bufreuse.integrations.core import DISPATCH, EXPERT
from bufreuse.integrations.megatron import group_sizes, install
from bufreuse.pool import BufferPool

HIDDEN, SEQ, MBS = 32, 8, 2
TOKENS = SEQ * MBS


def _layer():
    """A real all-to-all MoELayer built at EP = ETP = 1 (config fields and process groups agree)."""
    return cpu_moe_layer(8, "alltoall", HIDDEN)


def _step(layer) -> torch.Tensor:
    """One layer call, forward and backward; returns the output."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=g).requires_grad_(True)
    y = moe_forward(layer, x, g)
    y.backward(torch.ones_like(y))
    return y.detach()


def _knobs() -> BufReuseConfig:
    # These tests are about which group sizes decide (the dispatcher's or the config's): the keep knob takes the
    # stream rule out (at EP x ETP > 1 without EP overlap nothing waits pending-free, config.pending_free_at_ep),
    # so EP / expert TP alone decide, as the EP = 1 and EP x ETP = 1 rules still do under it.
    return BufReuseConfig(
        moe_hybridep_reuse_dispatch_output_buffers=True,
        moe_hybridep_num_dispatch_output_buffers=2,
        moe_hybridep_num_expert_output_buffers=2,
        moe_bufreuse_keep_unused_rings=True,
    )


def _mismatch_warnings(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("bufreuse") and "pg_collection" in r.getMessage()
    ]


def test_agreeing_groups_leave_both_rings_unused_at_ep_1(parallel, caplog) -> None:
    layer = _layer()
    assert (layer.token_dispatcher.ep_size, layer.token_dispatcher.tp_size) == (1, 1)  # megatron's own record
    sizes = group_sizes(layer)
    assert (sizes.ep, sizes.etp, sizes.source, sizes.disagreement()) == (1, 1, "dispatcher", None)
    caplog.set_level(logging.INFO, logger="bufreuse")
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        _step(layer)
    assert pool.names() == [] and set(inst.unused) == {DISPATCH, EXPERT} and inst.layers == 0
    assert "EP = 1" in inst.unused[DISPATCH] and "EP x ETP = 1" in inst.unused[EXPERT]
    assert _mismatch_warnings(caplog) == []


def test_dispatcher_ep_2_uses_both_rings_though_the_config_says_1(parallel) -> None:
    layer = _layer()
    assert layer.config.expert_model_parallel_size == 1
    layer.token_dispatcher.ep_size = 2  # what a pg_collection with a 2-rank EP group gives megatron
    sizes = group_sizes(layer)
    assert (sizes.ep, sizes.etp, sizes.config_ep) == (2, 1, 1)
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        hooked = {b: inst.hooks("alltoall", layer, b) for b in ("dispatch", "expert")}
        names = set(pool.names())
    assert inst.unused == {} and inst.layers == 1
    assert hooked == {"dispatch": True, "expert": True} and names == {DISPATCH, EXPERT}


def test_dispatcher_etp_2_uses_the_expert_ring_at_its_etp_2_bound(parallel) -> None:
    layer = _layer()
    layer.token_dispatcher.tp_size = 2  # the expert-TP group megatron's combine reduce-scatters over
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        rows = pool.get(EXPERT).max_shape[0]
        names = set(pool.names())
    assert names == {EXPERT} and set(inst.unused) == {DISPATCH}  # EP = 1 still: the dispatch is an identity
    fields = {f: getattr(layer.config, f) for f in ("hidden_size", "num_moe_experts", "moe_router_topk",
              "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity")}  # fmt: skip
    at_etp2 = static_bounds({**fields, "expert_tensor_parallel_size": 2}, _knobs(), path="alltoall", tokens=TOKENS)
    at_config = static_bounds(fields, _knobs(), path="alltoall", tokens=TOKENS)
    assert rows == at_etp2["expert"].rows == 2 * at_config["expert"].rows  # the bound follows the group too


def test_dispatcher_ep_1_leaves_the_rings_unused_though_the_config_says_2(parallel) -> None:
    layer = _layer()
    layer.config.expert_model_parallel_size = 2  # config fields off the groups the layer was built on
    assert group_sizes(layer).ep == 1
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        _step(layer)  # the real EP = 1 layer runs as production leaves it
    assert pool.names() == [] and set(inst.unused) == {DISPATCH, EXPERT}


def test_a_dispatcher_without_group_sizes_falls_back_to_the_config_fields(parallel) -> None:
    layer = _layer()
    disp = layer.token_dispatcher
    del disp.ep_size, disp.tp_size  # a megatron-core whose dispatcher does not hold them
    sizes = group_sizes(layer)
    assert (sizes.ep, sizes.etp, sizes.source, sizes.disagreement()) == (1, 1, "config", None)
    with install(layer, BufferPool("cpu"), _knobs(), tokens=TOKENS) as inst:
        pass
    assert set(inst.unused) == {DISPATCH, EXPERT}
    # the config fields decide, both ways: EP 2 in the config makes both rings used
    layer.config.expert_model_parallel_size = 2
    sizes = group_sizes(layer)
    assert (sizes.ep, sizes.source, sizes.disagreement()) == (2, "config", None)
    pool = BufferPool("cpu")
    with install(layer, pool, _knobs(), tokens=TOKENS) as inst:
        names = set(pool.names())
    assert inst.unused == {} and names == {DISPATCH, EXPERT}
    # only one of them held: that one from the dispatcher, the other from the config
    disp.tp_size = 2
    sizes = group_sizes(layer)
    assert (sizes.ep, sizes.etp, sizes.source) == (2, 2, "EP: config, expert TP: dispatcher")


def test_a_mismatch_is_warned_once_naming_both(parallel, caplog) -> None:
    layers = torch.nn.ModuleList([_layer(), _layer()])
    for layer in layers:
        layer.token_dispatcher.ep_size = 2
    caplog.set_level(logging.WARNING, logger="bufreuse")
    with install(layers, BufferPool("cpu"), _knobs(), tokens=TOKENS) as inst:
        pass
    assert inst.layers == 2
    (record,) = _mismatch_warnings(caplog)  # one warning for two layers of the same mismatch
    text = record.getMessage()
    assert "EP 2" in text and "expert_model_parallel_size=1" in text
