"""Whole-model gradient norms under any layout, and the norms of the GNS estimator's two batches.

Every quantity here is this rank's *share*: summed over all ranks (one all-reduce, batched with the
step's other scalars) it covers the whole model exactly once, whatever dp/tp/pp layout holds it
(the clip_grad_norm_ traps under TP and PP avoided). Shares are 0-d float64 tensors on the gradients'
device: reading them is left to the step's one host sync.

The noise scale is measured on Adam-preconditioned gradients, P g with P = 1 / (√v̂ + ε) elementwise
(v̂ the bias-corrected second moment after the previous step; AdaptDL's AdamGradientNoiseScale): the
noise scale of the updates Adam takes, which is what sets the batch it can use. P is the same for both
batches of a step, so the two-batch estimator stays unbiased for |P G|² and tr(P Σ P).

The parameters indexed by token id (the family's `vocab_params`: embeddings, output heads) are left
out. A rare token's row gets a gradient in few steps, so its v̂ is tiny and P there is huge: those
rows, almost pure sampling noise, then make up nearly all of tr(P Σ P). Measured along gbs-8 runs,
WikiText-2 with 8,192 and 16,384 ids (`scripts/gns_vocab_share.py`), they put the estimate at 100 to
unbounded where the rest of the model reads 5–90 (whether |g|² is weighted by P², by P or not at all),
and 10–90 is what the token ratios of batches 8 and 32 at one LR imply (docs/switching.md).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from cona_core.gns import measurable
from launch.dtensor_pieces import counts_here, in_param_layout, local_tensor
from launch.parallelize import ParallelModel


def _sq(tensors: list[torch.Tensor]) -> torch.Tensor | float:
    if not tensors:
        return 0.0
    return _sum_sq(torch._foreach_norm(tensors))


def _sum_sq(norms: list[torch.Tensor]) -> torch.Tensor:
    """Σ n² of 0-d norms, in float64."""
    return torch.stack(norms).double().pow(2).sum()


def local_grad_sq(pm: ParallelModel) -> torch.Tensor | float:
    """This rank's share of |g|^2 of the (data-parallel reduced) gradient."""
    return _sq(pm.counted_grads(("dp", "tp")))


@torch.no_grad()
def scale_grads(pm: ParallelModel, factor: torch.Tensor) -> None:
    """Multiply every local gradient by the 0-d device tensor `factor` (no host read)."""
    grads = [local_tensor(p.grad) for p in pm.model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor.to(grads[0].dtype))


# Elements per multi-tensor pass. On GPUs it bounds the temporaries (64 MiB in fp32) while each pass
# launches a few kernels for many parameters; on CPUs each parameter is its own pass, so that its four
# passes run while it is in cache (a six-pass version over all parameters at once measured 1.4x slower there).
CHUNK_ELEMENTS = {"cuda": 1 << 24}


def _chunks(items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Consecutive runs of (second moment, gradient) pairs of about the device's `CHUNK_ELEMENTS` each."""
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    size = 0
    limit = CHUNK_ELEMENTS.get(items[0][1].device.type, 0) if items else 0
    for item in items:
        if out[-1] and size >= limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].numel()
    return out


class Preconditioner:
    """Adam's elementwise 1 / (√v̂ + ε), read from the optimizer's state when it is applied (no copy of
    v̂ is kept: one chunk's temporaries at a time)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.group = {id(p): g for g in opt.param_groups for p in g["params"]}

    @torch.no_grad()
    def norms(self, pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> list[torch.Tensor]:
        """|P g| of each (parameter, its local gradient piece in the parameter's layout) pair, as 0-d fp32
        device tensors. Multi-tensor kernels, a few launches per chunk of parameters: launched one
        parameter at a time, these kernels made a measured step of a small GPU model half as long again."""
        by_key: dict[tuple[float, float], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p, g in pairs:
            state, group = self.opt.state[p], self.group[id(p)]
            correction = 1 - group["betas"][1] ** float(state["step"])
            by_key.setdefault((correction, group["eps"]), []).append(
                (local_tensor(state["exp_avg_sq"]), local_tensor(g))
            )
        out: list[torch.Tensor] = []
        for (correction, eps), items in by_key.items():
            # g / (√(v/c) + ε) = √c · g / (√v + ε√c): three passes over the chunk and its norm
            norms: list[torch.Tensor] = []
            for chunk in _chunks(items):
                denom = torch._foreach_sqrt([v for v, _ in chunk])
                torch._foreach_add_(denom, eps * correction**0.5)
                norms += torch._foreach_norm(torch._foreach_div([g for _, g in chunk], denom))
            torch._foreach_mul_(norms, correction**0.5)
            out += norms
        return out

    def ready(self, pm: ParallelModel) -> bool:
        """Every parameter has a second moment (the optimizer has stepped; checked until it is true)."""
        self._ready = getattr(self, "_ready", False) or all(
            p in self.opt.state and "exp_avg_sq" in self.opt.state[p] for p in pm.model.parameters()
        )
        return self._ready


class NoiseNorms:
    """The two batches' squared preconditioned gradient norms of the GNS estimator, measured during a step.

    Big batch: the step's (data-parallel reduced) gradient. Small batches: dp > 1, the replicas' batches
    (gbs/dp samples each), each replica's local gradient *before* the data-parallel reduction (read in
    DDP's communication hook, or as each bucket of our own all-reduce launches); dp = 1, the step's first micro-batch
    (mbs samples), whose gradient is what the first accumulation writes into each `.grad` (read once
    that micro-batch's backward is through; under a pipeline schedule in post-accumulate hooks). Under
    FSDP (pp = 1), which reduce-scatters every micro-batch's gradient during its backward, the small batch
    is the step's first micro-batch of every replica (dp·mbs samples), read the same way from the sharded
    gradients; under FSDP with PP the schedule reduces only after the last micro-batch, and nothing is
    measured. Summed over ranks, `small_share()` / `n_small` is the mean |P G_small|^2 and `big_share()`
    is |P G_big|^2. Only 0-d device norms are queued; nothing is read on the host here.
    """

    def __init__(self, pm: ParallelModel, opt: torch.optim.Optimizer, vocab_params: tuple[str, ...]) -> None:
        self.pm = pm
        self.precond = Preconditioner(opt)
        self.active = False  # this step measures (the worker holds the estimator while v̂ settles)
        self._pending: list[torch.Tensor] = []
        self._hooks: dict[nn.Parameter, torch.utils.hooks.RemovableHandle] = {}  # pp > 1: per parameter
        named = pm.model.named_parameters(remove_duplicate=False)
        left_out = {id(p) for name, p in named if name in vocab_params}
        if any(id(t) not in left_out for t in pm.tied):
            raise ValueError("a tied parameter outside the family's vocab_params: the noise scale cannot count it")
        self.params = [p for p in pm.model.parameters() if id(p) not in left_out]
        self._measured = {id(p) for p in self.params}
        self.fsdp = isinstance(pm.model, FSDPModule)
        if isinstance(pm.wrapped, DDP):  # DDP is only built with dp > 1
            pm.wrapped.register_comm_hook(pm.wrapped.process_group, self._ddp_hook)
        if pm.averager is not None:
            pm.averager.before_reduce = self._before_reduce
        self.resize()

    def resize(self) -> None:
        """Follow the strategy's batch sizes (after an in-place resize: the layout is the same)."""
        s = self.pm.strategy
        self.available = measurable(s, "fsdp" if self.fsdp else "ddp")
        if self.fsdp:
            self.b_small, self.n_small = s.dp * s.mbs, 1
        else:
            self.b_small = s.gbs // s.dp if s.dp > 1 else s.mbs
            self.n_small = s.dp if s.dp > 1 else 1
        # The first micro-batch's gradient arrives as g_0 / m with pp = 1 (we scale the loss), as g_0
        # under pipelining (the schedule rescales after the last backward, or leaves the sum to our
        # dp average: a replica's gradient then arrives as m times its mean).
        self._first_microbatch = self.available and (s.dp == 1 or self.fsdp)
        m2 = float(s.n_microbatches) ** 2
        if self._first_microbatch:
            self._scale = m2 if s.pp == 1 else 1.0
        else:
            self._scale = 1 / m2 if s.pp > 1 else 1.0

    def begin_step(self, measure: bool) -> None:
        """`measure`: this step feeds the estimator (needs every parameter's second moment)."""
        self.active = measure and self.available and self.precond.ready(self.pm)
        self._pending.clear()
        first = self.active and self._first_microbatch
        # pp = 1: all at once after the first micro-batch's backward; under a pipeline schedule, as each
        # parameter's gradient lands (each hook removes itself after the first micro-batch).
        self.pm.after_first_backward = self._after_first_backward if first and self.pm.strategy.pp == 1 else None
        if first and self.pm.strategy.pp > 1:
            for p in self.params:
                self._hooks[p] = p.register_post_accumulate_grad_hook(self._first_microbatch_hook)

    def small_share(self) -> torch.Tensor | float:
        if not self.active or not self._pending:
            return 0.0
        share = _sum_sq(self._pending) * self._scale
        self._pending.clear()
        return share

    def big_share(self) -> torch.Tensor | float:
        """This rank's share of |P g|^2 of the reduced gradient (after the data-parallel average)."""
        if not self.active:
            return 0.0
        norms = self._precond_norms(("dp", "tp"))
        return _sum_sq(norms) if norms else 0.0

    def _counts(self, g: torch.Tensor, dims: tuple[str, ...]) -> bool:
        return counts_here(g, self.pm.coord, dims)

    def _precond_norms(self, dims: tuple[str, ...], params: list[nn.Parameter] | None = None) -> list[torch.Tensor]:
        """|P g| of the pieces this rank counts along `dims` (gradients in their parameters' layouts, so
        that each piece lines up with its second moment), over `params` (default: every measured parameter)."""
        pairs = []
        for p in self.params if params is None else params:
            if p.grad is None:
                continue
            g = in_param_layout(p, p.grad)
            if self._counts(g, dims):
                pairs.append((p, g))
        return self.precond.norms(pairs)

    def _ddp_hook(self, state, bucket):
        # Unannotated on purpose: DDP checks the annotations' objects, and postponed annotations
        # make them strings it rejects. (state: the process group; returns allreduce's future.)
        # Pure data parallelism (tp = pp = 1): every local gradient is the whole replica's.
        if self.active:
            pairs = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients()) if id(p) in self._measured]
            self._pending += self.precond.norms(pairs)
        return allreduce_hook(state, bucket)

    @torch.no_grad()
    def _before_reduce(self, params: list[nn.Parameter]) -> None:
        """A bucket of this replica's final local gradients, just before their dp all-reduce."""
        if self.active:
            self._pending += self._precond_norms(("tp",), [p for p in params if id(p) in self._measured])

    @torch.no_grad()
    def _after_first_backward(self) -> None:
        """pp = 1: every gradient now holds the first micro-batch's (dp = 1, or FSDP's, reduced over dp)."""
        self._pending += self._precond_norms(("dp", "tp"))

    @torch.no_grad()
    def _first_microbatch_hook(self, p: nn.Parameter) -> None:
        self._hooks.pop(p).remove()
        g = in_param_layout(p, p.grad)
        if self._counts(g, ("dp", "tp")):  # dp = 1, or FSDP's gradient already reduced over dp
            self._pending += self.precond.norms([(p, g)])
