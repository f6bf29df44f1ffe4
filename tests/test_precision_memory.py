"""Precision resolution (planner and worker), TF32 only on CUDA ranks, the planner's FSDP + PP and foreach
AdamW memory terms, FSDP2's resharding under PP and the dropout-under-TP refusal (single process, no GPU)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

import launch.device as device_mod
import launch.parallelize as par
from cona_cli.planner.costmodel import as_array, iteration_time
from cona_cli.planner.hardware import load_hardware
from cona_cli.planner.memory import ADAM_TEMP_BYTES, STATE_BYTES, compute_precision, memory_bytes
from cona_cli.planner.workload import Workload
from cona_core.buckets import BUCKET_BYTES, IN_FLIGHT, buckets
from cona_core.config import ClusterConfig, ConfigError, config_from_dict
from cona_core.shape import ModelShape
from cona_core.strategy import Strategy
from launch.models import get_spec
from launch.precision import resolve_precision
from tests.support import TINY


def test_auto_precision_is_fp32_on_cpu_and_bf16_on_gpu_profiles() -> None:
    assert compute_precision("auto", load_hardware("cpu-local")) == "fp32"
    for gpu in ("a6000-2x8", "h100-80gb-8", "a100-80gb-8"):
        assert compute_precision("auto", load_hardware(gpu)) == "bf16"
    assert compute_precision("fp32", load_hardware("h100-80gb-8")) == "fp32"  # explicit choices stand
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_auto_precision_is_modelled_as_what_runs() -> None:
    shape = ModelShape(n_layers=4, d_model=256, n_heads=4, kv_heads=4, ffn=1024, seq_len=128, vocab=1000)
    x = as_array([Strategy(2, 1, 1, 2, 8)])
    for hw, runs in ((load_hardware("cpu-local"), "fp32"), (load_hardware("h100-80gb-8"), "bf16")):
        auto, explicit = Workload(shape, precision="auto"), Workload(shape, precision=runs)
        assert iteration_time(x, auto, hw)[0] == iteration_time(x, explicit, hw)[0]
        assert memory_bytes(x, auto, hw)[0] == memory_bytes(x, explicit)[0]
    with pytest.raises(ValueError, match="needs the hardware profile"):
        memory_bytes(x, Workload(shape, precision="auto"))


def _init_with(monkeypatch: pytest.MonkeyPatch, backend: str) -> list[str]:
    calls: list[str] = []
    place = device_mod.Placement(backend, torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu"))
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(device_mod, "placement", lambda cluster, wanted=None: place)
    monkeypatch.setattr(device_mod.torch.cuda, "set_device", lambda d: calls.append("set_device"))
    monkeypatch.setattr(device_mod.dist, "init_process_group", lambda *a, **k: calls.append(f"init {a[0]}"))
    monkeypatch.setattr(device_mod, "enable_tf32", lambda: calls.append("tf32"))
    device_mod.init_distributed(ClusterConfig())
    return calls


def test_tf32_is_enabled_on_cuda_ranks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _init_with(monkeypatch, "nccl") == ["set_device", "tf32", "init nccl"]
    assert _init_with(monkeypatch, "gloo") == ["init gloo"]


def test_enable_tf32_sets_the_cuda_matmul_and_cudnn_flags() -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        device_mod.enable_tf32()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu  # CPU matmuls untouched
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# Short sequences and a big vocabulary-free model: the optimizer step, not the activations, is the peak.
SHAPE = ModelShape(n_layers=8, d_model=512, n_heads=8, kv_heads=8, ffn=2048, seq_len=1, vocab=8)


def test_foreach_adamw_temporary_is_counted_at_the_step() -> None:
    w = Workload(SHAPE, precision="fp32")
    params = float(w.stage_params(np.array(1.0), np.array(1.0)))
    assert memory_bytes(as_array([Strategy(1, 1, 1, 1, 1)]), w)[0] == params * (STATE_BYTES + ADAM_TEMP_BYTES)
    fsdp = dataclasses.replace(w, dp_impl="fsdp")
    got = memory_bytes(as_array([Strategy(4, 1, 1, 1, 4)]), fsdp)[0]
    gathered = 2 * SHAPE.layer_params * 4
    assert got == pytest.approx(params * (STATE_BYTES + ADAM_TEMP_BYTES) / 4 + gathered)


def test_fsdp_under_pp_keeps_the_stage_gathered_with_fp32_grads_per_dp_rank() -> None:
    shape = dataclasses.replace(SHAPE, seq_len=2048, vocab=256)  # activations, not the step, are the peak
    for precision, e in (("bf16", 2), ("fp32", 4)):
        w = Workload(shape, precision=precision, dp_impl="fsdp")
        params = float(w.stage_params(np.array(1.0), np.array(2.0)))
        dp2, dp4 = memory_bytes(as_array([Strategy(2, 1, 2, 1, 8), Strategy(4, 1, 2, 1, 16)]), w)
        # Same micro-batch count (4) and so the same activations: only the sharded states differ.
        assert dp2 - dp4 == pytest.approx(params * STATE_BYTES * (1 / 2 - 1 / 4))
        ddp_like = memory_bytes(as_array([Strategy(4, 1, 2, 1, 16)]), dataclasses.replace(w, dp_impl="ddp"))[0]
        gathered = params * (e + 4)  # compute-precision parameters + fp32 accumulated gradients, whole stage
        buckets = min(params * 4, IN_FLIGHT * BUCKET_BYTES)  # the bucketed dp average's copies in flight
        activations = ddp_like - params * STATE_BYTES - (params * e if e == 2 else 0) - buckets
        assert dp4 == pytest.approx(params * STATE_BYTES / 4 + gathered + activations)


def test_fsdp_counts_unsharded_gradients_of_three_or_more_micro_batches_where_they_fit() -> None:
    shape = dataclasses.replace(SHAPE, seq_len=2048, vocab=256)  # activations, not the step, are the peak
    w = Workload(shape, precision="fp32", dp_impl="fsdp")
    params = float(w.stage_params(np.array(1.0), np.array(1.0)))
    x = as_array([Strategy(4, 1, 1, 1, 8), Strategy(4, 1, 1, 1, 12)])  # 2 and 3 micro-batches
    two, three = memory_bytes(x, w)  # without a budget: counted wherever it applies
    assert three - two == pytest.approx(params * 4)  # the local stage's fp32 gradients, not divided by dp
    room = float(three)
    assert memory_bytes(x, w, budget=room)[1] == three
    assert memory_bytes(x, w, budget=room - 1)[1] == two  # does not fit: every micro-batch reduce-scatters
    ddp = memory_bytes(x, dataclasses.replace(w, dp_impl="ddp"))
    assert ddp[0] == ddp[1]  # DDP accumulates into its buckets either way


def _tiny_model(dropout: float = 0.0) -> torch.nn.Module:
    cfg = config_from_dict({**TINY, "model": {**TINY["model"], "dropout": dropout}}, "t")
    return get_spec(cfg.model.family).build(cfg.model, 256), get_spec(cfg.model.family)


def _mesh() -> mock.MagicMock:
    mesh = mock.MagicMock()
    mesh.mesh_dim_names = ("pp", "dp", "tp")
    mesh.get_coordinate.return_value = [0, 0, 0]
    return mesh


@pytest.mark.parametrize(("pp", "reshard"), [(1, True), (2, False)])
def test_fsdp_reshards_after_forward_only_without_pp(monkeypatch: pytest.MonkeyPatch, pp: int, reshard: bool) -> None:
    model, spec = _tiny_model()
    seen: list[bool] = []
    monkeypatch.setattr(par, "fully_shard", lambda m, **kw: seen.append(kw["reshard_after_forward"]))
    monkeypatch.setattr(par, "PipelineStage", mock.MagicMock())
    monkeypatch.setattr(par, "Schedule1F1B", mock.MagicMock())
    monkeypatch.setattr(par, "tie_group", lambda mesh: None)
    spec = dataclasses.replace(spec, pipeline_split=lambda *a: None)
    strategy = Strategy(2, 1, pp, 1, 4)
    par.parallelize(model, _mesh(), strategy, spec, dp_impl="fsdp", device=torch.device("cpu"))
    assert seen == [reshard] * (len(model.layers) + 1)


def test_ddp_gradients_are_bucket_views(monkeypatch: pytest.MonkeyPatch) -> None:
    model, spec = _tiny_model()
    ddp = mock.MagicMock()
    monkeypatch.setattr(par, "DDP", ddp)
    par.parallelize(model, _mesh(), Strategy(2, 1, 1, 1, 4), spec, device=torch.device("cpu"))
    assert ddp.call_args.kwargs["gradient_as_bucket_view"] is True


def test_dropout_under_tp_is_refused_in_one_line() -> None:
    model, spec = _tiny_model(dropout=0.1)
    with pytest.raises(ConfigError, match=r"^model\.dropout: 0\.1 with tp > 1 is not supported") as e:
        par.parallelize(model, _mesh(), Strategy(1, 2, 1, 1, 1), spec, device=torch.device("cpu"))
    assert "\n" not in str(e.value)
    par.refuse_tp_dropout(_tiny_model(dropout=0.0)[0])  # dropout 0 passes


def test_gradient_buckets_keep_order_and_cap_and_the_planner_counts_the_ones_in_flight() -> None:
    assert buckets([10, 10, 10, 25, 5], cap=20) == [[0, 1], [2], [3], [4]]  # one over the cap: its own
    assert buckets([], cap=20) == []
    shape = dataclasses.replace(SHAPE, seq_len=2048, vocab=256)
    w = Workload(shape, precision="fp32")
    ddp, tp = memory_bytes(as_array([Strategy(2, 1, 2, 1, 8), Strategy(1, 1, 2, 1, 8)]), w)
    assert ddp - tp == pytest.approx(min(float(w.stage_params(np.array(1.0), np.array(2.0))) * 4, 2 * BUCKET_BYTES))
