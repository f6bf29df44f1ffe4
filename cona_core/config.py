"""YAML run configuration: typed sections, validated before anything launches.

Every problem is reported as one line naming the file and the key, e.g.
`configs/tiny.yaml: train.lr: must be > 0`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from cona_core import pretrained
from cona_core.strategy import Strategy, StrategyError, divisibility_problems


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the file and key."""


Check = Callable[[Any], str | None]


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _fraction(v: Any) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _one_of(*choices: str) -> Check:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _precision(v: Any) -> str | None:
    if v == "fp16":
        return "fp16 needs loss scaling, which the engine does not do; use bf16"
    return _one_of("auto", "fp32", "bf16")(v)


_AUTO_BOOL = "must be auto, true or false"


def _clock_table(v: Any) -> str | None:
    if isinstance(v, dict) and (not v or any(s <= 0 for s in v.values())):
        return "must map strategies or global batches to seconds > 0"
    return None if v else "must not be empty"


WANDB_KEYS = ("project", "name", "mode")


def _wandb(v: dict[str, str]) -> str | None:
    if set(v) - set(WANDB_KEYS) or v.get("mode", "online") not in ("online", "offline", "disabled"):
        return "must be a mapping of project, name, mode (online, offline or disabled)"
    return None


def _f(default: Any = dataclasses.MISSING, check: Check | None = None) -> Any:
    return field(default=default, metadata={"check": check})


def _empty(factory: Callable[[], Any]) -> Any:
    return field(default_factory=factory, metadata={"check": None})


MODEL_FAMILIES = ("gpt", "llama", "bert")  # the families of `launch.models` (a test keeps the two in step)


@dataclass(frozen=True)
class ModelConfig:
    """A transformer of one of the registered families (`launch.models`). With `init_from`, a pretrained
    model folder gives the shape fields it leaves out (a field it states must agree) and the first
    launch's weights (`cona_core.pretrained`)."""

    n_layers: int = _f(check=_positive)
    """transformer blocks"""
    d_model: int = _f(check=_positive)
    """hidden size"""
    n_heads: int = _f(check=_positive)
    """attention heads (d_model / n_heads must be even: RoPE)"""
    ffn: int = _f(check=_positive)
    """MLP hidden size"""
    seq_len: int = _f(check=_positive)
    """tokens per sequence (context length)"""
    family: str = _f("gpt", _one_of(*MODEL_FAMILIES))
    """model family: its blocks, norms and tokenizer conventions"""
    n_kv_heads: int | None = _f(None, _positive)
    """grouped-query attention (llama)"""
    dropout: float = _f(0.0, _fraction)
    """dropout probability"""
    rope_theta: float = _f(500000.0, _positive)
    """RoPE base (llama; Llama 3's default)"""
    init_from: str | None = _f(None, lambda v: None if v else "must not be empty")
    """A Hugging Face model folder (GPT-2, Llama, BERT: config.json and safetensors) or a `cona export` folder: its
    config gives the fields above that are left out, its weights start the run (a resumed launch loads its checkpoint
    instead), its tokenizer.json becomes data.tokenizer unless that is given"""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


DATA_FORMATS = ("auto", "text", "jsonl", "bin", "npy", "megatron", "hf")  # launch.data.sources keeps the same
MAX_VOCAB = 2**32 - 1  # token arrays are uint16 up to 65536 ids, uint32 above


# A Hugging Face hub model name, `NAME` or `ORG/NAME` (its tokenizer is read from the local hub cache).
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _tokenizer(v: Any) -> str | None:
    """bpe, byte, a path (to a tokenizer.json or a tokenizer folder) or a hub name; whether it loads is
    checked before launch (`cona_cli.control.preflight`)."""
    if v and ("/" in v or v.endswith(".json") or HUB_NAME.fullmatch(v) or Path(v).expanduser().exists()):
        return None
    return "must be one of bpe, byte, a path to a tokenizer.json or a tokenizer folder, or a Hugging Face hub name"


@dataclass(frozen=True)
class DataConfig:
    """Where the training data comes from, its format and its tokenizer (docs/data.md). No `path`: a
    generated synthetic corpus."""

    path: str | None = _f(None)
    """a folder, a file, a glob or a Megatron prefix"""
    format: str = _f("auto", _one_of(*DATA_FORMATS))
    """auto: from the file names"""
    valid_path: str | None = _f(None)
    """validation data (default: files named val*/valid* in path, else a split)"""
    valid_fraction: float = _f(0.05, lambda v: None if 0 < v < 1 else "must be in (0, 1)")
    """of the documents"""
    valid_seed: int = _f(0, _non_negative)
    """the draw of the validation documents"""
    tokenizer: str = _f("bpe", _tokenizer)
    """bpe (trained on the corpus), byte, PATH (a Hugging Face tokenizer.json or a local tokenizer folder), or a hub
    name ORG/NAME (its tokenizer.json in the local Hugging Face cache, HF_HOME; never downloaded)"""
    vocab_size: int = _f(2048, lambda v: None if 260 <= v <= MAX_VOCAB else f"must be in [260, {MAX_VOCAB}]")
    """bpe: the trained vocabulary; pre-tokenized data without a tokenizer: the ids in use; and what `cona search` plans
    with before a corpus is prepared. A PATH tokenizer sets the run's own."""
    doc_separator: str = _f("blank", lambda v: None if v else "must not be empty")
    """text: what ends a document (blank: a whitespace-only line; line; file; or any other string between them)"""
    text_key: str = _f("text", lambda v: None if v else "must not be empty")
    """jsonl / hf: the text field"""
    dtype: str | None = _f(None, _one_of("uint16", "uint32", "int32"))
    """bin: the raw tokens' dtype"""
    cache_dir: str | None = _f(None)
    """where prepared token arrays are cached (default: beside the data; CONA_CACHE)"""
    synthetic_tokens: int = _f(400_000, _positive)
    """size of the generated corpus when there is no path"""


@dataclass(frozen=True)
class NodeSpec:
    """One node of a `launcher: ssh` cluster: its address (an ssh destination, `user@` allowed) and
    what differs on it."""

    host: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None

    @property
    def addr(self) -> str:
        """The address other nodes reach it at (the host without `user@`)."""
        return self.host.rpartition("@")[2]


LAUNCHERS = ("local", "ssh", "slurm")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the workers run. `nodes` in the YAML is a count (`local`, `slurm`), a list of hosts
    (`ssh`; each a string or {host, env, workdir}), or `slurm` (the hosts of the allocation: the controller
    puts their count in its place before it validates the config)."""

    nodes: int = _f(1, _positive)
    """a count, a list of hosts (ssh) or slurm (the allocation's hosts)"""
    procs_per_node: int = _f(1, _positive)
    """ranks per node (GPUs per node under nccl)"""
    backend: str = _f("auto", _one_of("auto", "gloo", "nccl"))
    """torch.distributed backend; auto: nccl where ranks have GPUs, else gloo"""
    threads_per_proc: int | None = _f(None, _positive)
    """OMP threads per rank (default $OMP_NUM_THREADS, or CPUs/ranks)"""
    launcher: str = _f("local", _one_of(*LAUNCHERS))
    """how nodes are started: local processes, ssh or srun"""
    head_addr: str | None = _f(None)
    """this machine's address on the cluster network (telemetry binds it)"""
    rdzv_endpoint: str | None = _f(None)
    """host[:port] of the c10d store; default head_addr, a free port"""
    env: dict[str, str] = _empty(dict)
    """given to every node"""
    workdir: str | None = _f(None)
    """where node commands run (default: this process's working folder)"""
    python: str | None = _f(None)
    """interpreter on the nodes (default: this one)"""
    ssh_args: list[str] = _empty(list)
    """extra ssh options, e.g. [-p, "2222", -i, key]"""
    srun_args: list[str] = _empty(list)
    """extra srun options"""
    sbatch_options: list[str] = _empty(list)
    """#SBATCH lines for `cona train --sbatch`"""
    requeue_signal_s: int = _f(300, _positive)
    """`--sbatch` scripts: Slurm sends SIGUSR1 this many seconds before the time limit; the controller checkpoints,
    requeues the job, and the requeued script resumes the run folder."""
    probe_timeout_s: float = _f(30.0, _positive)
    """how long nodes wait to see each other's probe files"""
    standby: bool = _f(True, lambda v: None if isinstance(v, bool) else "must be true or false")
    """Pre-warm the next launch while one trains, so switches skip start-up (one import per node, forkrun)."""
    startup_timeout_s: float = _f(1800.0, _positive)
    """collective timeout until the first step is through"""
    collective_timeout_s: float = _f(600.0, _positive)
    """collective timeout after the first step"""
    hosts: tuple[NodeSpec, ...] = field(default=(), metadata={"yaml": False})
    """`ssh`: from `nodes`"""

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def to_raw(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        hosts = raw.pop("hosts")
        if hosts:
            raw["nodes"] = list(hosts)
        return raw


def _node_spec(item: Any, where: str) -> NodeSpec:
    if isinstance(item, str) and item.strip():
        return NodeSpec(item.strip())
    if isinstance(item, dict) and isinstance(item.get("host"), str) and item["host"].strip():
        extra = set(item) - {"host", "env", "workdir"}
        if extra:
            raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown key (known: env, host, workdir)")
        env = item.get("env") or {}
        if not type_ok(env, dict[str, str]):
            raise ConfigError(f"{where}.env: must be a mapping of names to strings")
        workdir = item.get("workdir")
        if workdir is not None and not isinstance(workdir, str):
            raise ConfigError(f"{where}.workdir: must be a string")
        return NodeSpec(item["host"].strip(), dict(env), workdir)
    raise ConfigError(f"{where}: must be a host name or a mapping with host (and env, workdir)")


def _build_cluster(raw: Any) -> ClusterConfig:
    """The cluster section: `nodes` may be a count, a list of hosts or `slurm`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("cluster: must be a mapping")
    raw = dict(raw)
    nodes = raw.get("nodes", 1)
    hosts: tuple[NodeSpec, ...] = ()
    if isinstance(nodes, list):
        if not nodes:
            raise ConfigError("cluster.nodes: an empty list (give hosts, a count, or slurm)")
        hosts = tuple(_node_spec(item, f"cluster.nodes[{i}]") for i, item in enumerate(nodes))
        addrs = [h.addr for h in hosts]
        if len(set(addrs)) != len(addrs):
            raise ConfigError(f"cluster.nodes: {next(a for a in addrs if addrs.count(a) > 1)} is listed twice")
        raw.setdefault("launcher", "ssh")
        raw["nodes"] = len(hosts)
    elif nodes == "slurm":  # the controller puts the allocation's node count in its place first
        raise ConfigError("cluster.nodes: slurm: the controller resolves it (cona_cli.run_config.load_config)")
    elif isinstance(nodes, str):
        raise ConfigError(f"cluster.nodes: must be a count, a list of hosts, or slurm, got {nodes!r}")
    cluster = dataclasses.replace(_build_section(ClusterConfig, raw, "cluster"), hosts=hosts)
    if cluster.launcher == "ssh" and not hosts:
        raise ConfigError("cluster.nodes: launcher ssh needs a list of hosts")
    if hosts and cluster.launcher != "ssh":
        raise ConfigError(f"cluster.nodes: a list of hosts needs launcher ssh (launcher is {cluster.launcher})")
    return cluster


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule (in tokens, so it survives changes of gbs), evaluation and stop rules."""

    lr: float = _f(1e-3, _positive)
    """peak learning rate at lr_base_gbs"""
    min_lr_ratio: float = _f(0.1, lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")
    """the schedule's final LR as a fraction of lr"""
    schedule: str = _f("cosine", _one_of("constant", "cosine", "linear"))
    """LR decay after warmup (cosine, linear need decay_tokens or max_tokens)"""
    warmup_tokens: int = _f(0, _non_negative)
    """linear warmup from 0, in raw tokens under every recipe"""
    decay_tokens: int | None = _f(None, _positive)
    """tokens of the decay after warmup (default: max_tokens)"""
    lr_scaling: str = _f("adascale", _one_of("adascale", "sqrt", "linear", "none"))
    """adascale: lr·r^½ and the decay on the progress clock Σ r (launch.lr); sqrt/linear/none: on tokens"""
    lr_base_gbs: int | None = _f(None, _positive)
    """the batch lr was tuned at (default: the ladder's lowest rung)"""
    lr_calibration: bool | str = _f("auto", lambda v: None if v in ("auto", True, False) else _AUTO_BOOL)
    """After warmup, raise lr by √2 while the hypergradient says a longer step would have lowered the loss
    (launch.lr_calibration): auto (under policy cona), true or false"""
    weight_decay: float = _f(0.1, _non_negative)
    """AdamW weight decay"""
    beta1: float = _f(0.9, _fraction)
    """AdamW beta1"""
    beta2: float = _f(0.95, _fraction)
    """AdamW beta2"""
    grad_clip: float = _f(1.0, _non_negative)
    """gradient norm clip (0: off)"""
    seed: int = _f(1234, _non_negative)
    """seed of initialisation and data order"""
    eval_interval: int | None = _f(None, _positive)
    """steps between evaluations"""
    eval_interval_s: float | None = _f(None, _positive)
    """seconds between evaluations"""
    eval_tokens: int = _f(8192, _positive)
    """validation tokens per evaluation (the same slice every time)"""
    max_steps: int | None = _f(None, _positive)
    """stop rule: optimizer steps"""
    max_tokens: int | None = _f(None, _positive)
    """stop rule: training tokens"""
    max_time: float | None = _f(None, _positive)
    """stop rule: seconds of training"""
    target_ppl: float | None = _f(None, lambda v: None if v > 1 else "must be > 1")
    """stop rule: validation perplexity reached (needs evaluations)"""
    rampup_batch_size: list[int] | None = _f(None, _positive)
    """policy ramp: Megatron's --rampup-batch-size START INCREMENT SAMPLES (the batch grows from START by INCREMENT over
    SAMPLES consumed samples, up to the strategy's global batch)"""
    checkpoint_keep: int = _f(2, _positive)
    """checkpoints kept (older ones are deleted)"""
    checkpoint_interval: int | None = _f(None, _positive)
    """steps between periodic checkpoints"""
    checkpoint_interval_s: float | None = _f(600.0, _positive)
    """Periodic checkpoints every this many seconds of training (null: off). Never more than checkpoint_max_share of the
    time: each save's measured duration d stretches the wait before the next to at least d / checkpoint_max_share (a
    6 s save at 0.02: ≥ 300 s apart)."""
    checkpoint_max_share: float = _f(0.02, lambda v: None if 0 < v <= 1 else "must be in (0, 1]")
    """the most of the training time periodic checkpoints may take"""
    checkpoint_async: bool | str = _f("auto", lambda v: None if v in ("auto", True, False) else _AUTO_BOOL)
    """Periodic checkpoints written in the background (DCP async_save: training waits only for the copy to host memory;
    committed once every rank's write is done): auto (on GPUs), true or false"""
    max_restarts: int = _f(3, _non_negative)
    """relaunches after failures within restart_window_s"""
    restart_window_s: float = _f(3600.0, _positive)
    """the window max_restarts counts failures in"""
    gns: bool = _f(True)
    """measure the gradient noise scale every step"""
    gns_window: float = _f(1024.0, _positive)
    """samples of the trailing window the GNS is pooled over"""
    dp_impl: str = _f("ddp", _one_of("ddp", "fsdp"))
    """data parallelism: DDP or FSDP (sharded)"""
    pp_schedule: str = _f("1f1b", _one_of("1f1b", "gpipe"))
    """pipeline schedule"""
    tensorboard: bool = _f(False)
    """step, eval and decision metrics as TensorBoard event files too"""
    wandb: dict[str, str] | None = _f(None, _wandb)
    """the same metrics to Weights & Biases: {project, name, mode}, each optional (project: $WANDB_PROJECT or W&B's
    default; name: the run folder's; mode: online, offline or disabled, default $WANDB_MODE or online); W&B's files
    go to $WANDB_DIR, else the run folder"""
    clock: str = _f("wall", _one_of("wall", "virtual"))
    """Run time: wall (the host's) or virtual (real training; each step charged its time from clock_table, so runs do
    not depend on the host's load: `cona_core.clock`)"""
    clock_table: str | dict[str | int, float] | None = _f(None, _clock_table)
    """virtual: measured (this host's step times, calibrated once per strategy and cached), a hardware profile's name or
    YAML path (the planner's step times on that cluster), or {strategy or gbs: seconds}"""
    clock_noise: float | None = _f(None, _non_negative)
    """virtual: log std of a step's time factor (default: the calibration's measured spread; 0 for a profile or
    mapping)"""


@dataclass(frozen=True)
class SearchConfig:
    """Search space and planner settings (used by `cona search` and the online controller)."""

    hardware: str = _f("cpu-local")
    """hardware profile name or YAML path (the cost model's device)"""
    gbs_min: int | None = _f(None, _positive)
    """lowest rung of the ladder (default: gbs_static, else the world size)"""
    gbs_max: int | None = _f(None, _positive)
    """highest rung (default: 16 x the lowest)"""
    gbs_ladder: list[int] | None = _f(None, _positive)
    """the global batch rungs (default: powers of two from gbs_min to gbs_max)"""
    mbs: list[int] | None = _f(None, _positive)
    """micro-batch sizes to consider (default: all that divide)"""
    max_tp: int | None = _f(None, _positive)
    """largest tensor-parallel degree to consider"""
    tp_within_node: bool = _f(True)
    """keep each TP group inside one node"""
    gbs_static: int | None = _f(None, _positive)
    """the global batch of policy static (strategy auto) and of search"""
    precision: str = _f("auto", _precision)
    """Compute precision of training and of the cost model: bf16 (fp32 master weights, gradients and Adam moments),
    fp32, or auto: bf16 on CUDA ranks and GPU profiles with a bf16 peak, fp32 on CPUs."""
    recompute: bool = _f(False)
    """activation recomputation (less memory, a recomputed forward)"""
    memory_margin: float = _f(0.1, _fraction)
    """device memory kept free when judging a strategy feasible"""
    exhaustive_max: int = _f(64, _non_negative)
    """spaces up to this many strategies are evaluated exhaustively"""
    budget: int = _f(24, _positive)
    """Bayesian search: evaluations at most"""
    seed: int = _f(0, _non_negative)
    """Bayesian search seed (and the calibration's)"""
    n_initial: int = _f(6, _positive)
    """Bayesian search: random points before the model guides it"""
    ei_stop: float = _f(1e-4, _fraction)
    """Bayesian search stops when expected improvement (relative) falls below this"""
    # online controller (policy: cona; `control.decision`)
    confidence: float = _f(0.99, lambda v: None if 0.5 <= v < 1 else "must be in [0.5, 1)")
    """the confidence level of the Φ ratio's lower bound"""
    switch_cost_s: float = _f(5.0, _non_negative)
    """initial estimate of a cold relaunch, replaced by measured ones"""
    warm_switch_cost_s: float = _f(2.0, _non_negative)
    """the same for a hand-over to a ready standby"""
    in_place: bool = _f(True)
    """switches that keep dp, tp and pp (pp = 1) resize the running job, no relaunch"""
    decision_every: int = _f(5, _positive)
    """steps between decisions"""
    min_steps: int = _f(10, _positive)
    """timed steps of the running strategy before it is reconsidered (dwell)"""
    kappa: float = _f(1.0, _positive)
    """Φ's multiplier on the GNS: 1 is the surrogate as derived; an override only"""


@dataclass(frozen=True)
class ChainStage:
    strategy: Strategy
    steps: int | None
    """None: the last stage runs until the stop rule"""


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    data: DataConfig
    cluster: ClusterConfig
    train: TrainConfig
    search: SearchConfig
    strategy: Strategy | None
    chain: tuple[ChainStage, ...] | None
    policy: str
    source: str
    auto_strategy: bool = False
    """`strategy: auto`: the planner's fastest strategy at search.gbs_static"""

    def to_raw(self) -> dict[str, Any]:
        """The resolved config as a plain document that `config_from_dict` accepts again."""
        raw: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}
        raw["cluster"] = self.cluster.to_raw()
        raw["policy"] = self.policy
        if self.strategy is not None or self.auto_strategy:
            raw["strategy"] = str(self.strategy) if self.strategy is not None else "auto"
        if self.chain is not None:
            raw["chain"] = [{**c.strategy.to_dict(), **({"steps": c.steps} if c.steps else {})} for c in self.chain]
        return raw

    def problems(self, s: Strategy) -> list[str]:
        m = self.model
        return divisibility_problems(s, self.cluster.world, m.n_layers, m.n_heads, m.kv_heads)


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "search": SearchConfig,
}
_TOP_KEYS = set(_SECTIONS) | {"strategy", "chain", "policy"}
POLICIES = ("cona", "static", "chain", "ramp")


def type_ok(value: Any, hint: Any) -> bool:
    if get_origin(hint) is dict:
        key, item = get_args(hint)
        return isinstance(value, dict) and all(type_ok(k, key) and type_ok(v, item) for k, v in value.items())
    if get_origin(hint) is list:
        (item,) = get_args(hint)
        return isinstance(value, list) and all(type_ok(v, item) for v in value)
    args = get_args(hint)
    if args:  # Optional[...] / unions
        return any(type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) is list:
        return f"a list of {type_name(args[0])}"
    if get_origin(hint) is dict:
        return "a mapping of names to " + ("strings" if args[1] is str else type_name(args[1]))
    if args:
        return type_name(args[0])
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _build_section(cls: type, raw: Any, name: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: must be a mapping")
    hints = get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("yaml", True)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
    values = {}
    for fname, f in known.items():
        if fname not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{name}.{fname}: required" + (" (or model.init_from)" if cls is ModelConfig else ""))
            continue
        value = raw[fname]
        if hints[fname] is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not type_ok(value, hints[fname]):
            raise ConfigError(f"{name}.{fname}: must be {type_name(hints[fname])}, got {value!r}")
        check = f.metadata.get("check")
        if value is not None and check is not None:
            items = value if isinstance(value, list) else [value]
            for item in items:
                msg = check(item)
                if msg:
                    raise ConfigError(f"{name}.{fname}: {msg}")
        values[fname] = value
    return cls(**values)


def _parse_strategy(raw: Any, where: str) -> Strategy:
    try:
        if isinstance(raw, str):
            return Strategy.parse(raw)
        if isinstance(raw, dict):
            extra = set(raw) - {"dp", "tp", "pp", "mbs", "gbs"}
            if extra:
                raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown key")
            return Strategy.from_mapping(raw, where)
    except StrategyError as e:
        raise ConfigError(str(e)) from None
    raise ConfigError(f"{where}: must be a string like dp2-tp1-pp2-mbs2-gbs16 or a mapping")


def parse_chain(raw: Any, where: str = "chain") -> tuple[ChainStage, ...]:
    """A chain: a list of {dp, tp, pp, mbs, gbs, steps} (the last stage may omit steps)."""
    if isinstance(raw, dict) and set(raw) == {"chain"}:
        raw = raw["chain"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: must be a non-empty list of stages")
    stages = []
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{w}: must be a mapping with dp, tp, pp, mbs, gbs, steps")
        item = dict(item)
        steps = item.pop("steps", None)
        last = i == len(raw) - 1
        if steps is None and not last:
            raise ConfigError(f"{w}.steps: required (only the last stage may run until the stop rule)")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"{w}.steps: must be an integer >= 1")
        stages.append(ChainStage(_parse_strategy(item, w), steps))
    return tuple(stages)


def config_from_dict(raw: Any, source: str = "<config>", read_init_from: bool = True) -> Config:
    """Validate a parsed YAML document; errors name the key (without the file). `read_init_from`: fill in
    and check the fields `model.init_from`'s folder gives (a resolved config already states them all)."""
    if not isinstance(raw, dict):
        raise ConfigError("top level: must be a mapping with model, data, cluster, train sections")
    for key in raw:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(sorted(_TOP_KEYS))})")
    if "model" not in raw:
        raise ConfigError("model: required")
    if read_init_from and isinstance(raw["model"], dict) and isinstance(raw["model"].get("init_from"), str):
        try:
            raw = pretrained.resolve(raw)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    sections = {
        name: _build_cluster(raw.get(name)) if cls is ClusterConfig else _build_section(cls, raw.get(name), name)
        for name, cls in _SECTIONS.items()
    }
    auto = raw.get("strategy") == "auto"
    strategy = _parse_strategy(raw["strategy"], "strategy") if raw.get("strategy") not in (None, "auto") else None
    chain = parse_chain(raw["chain"]) if raw.get("chain") is not None else None
    policy = raw.get("policy", "chain" if chain else "static" if strategy else "cona")
    if policy not in POLICIES:
        raise ConfigError(f"policy: must be one of {', '.join(POLICIES)}")
    if auto and "policy" not in raw:
        policy = "static"
    cfg = Config(**sections, strategy=strategy, chain=chain, policy=policy, source=source, auto_strategy=auto)
    problem = cross_field_problem(cfg)
    if problem:
        raise ConfigError(problem)
    validate_strategies(cfg)
    return cfg


# Rules between two or more keys, each a check that gives `key: why` or None; the first broken one is reported.


def _heads_divide_d_model(c: Config) -> str | None:
    m = c.model
    if m.d_model % m.n_heads:
        return f"model.d_model: {m.d_model} is not divisible by model.n_heads {m.n_heads}"
    return None


def _head_size_even(c: Config) -> str | None:
    head = c.model.d_model // c.model.n_heads
    if head % 2:
        return f"model.d_model: the head size d_model / n_heads = {head} must be even (RoPE)"
    return None


def _kv_heads_divide_heads(c: Config) -> str | None:
    m = c.model
    if m.n_heads % m.kv_heads:
        return f"model.n_kv_heads: {m.kv_heads} does not divide model.n_heads {m.n_heads}"
    return None


def _grouped_query_only_llama(c: Config) -> str | None:
    m = c.model
    if m.kv_heads != m.n_heads and m.family != "llama":
        return f"model.n_kv_heads: grouped-query attention is llama's; the {m.family} family has n_heads K/V heads"
    return None


def _warmup_within_decay(c: Config) -> str | None:
    t = c.train
    if t.decay_tokens is not None and t.warmup_tokens > t.decay_tokens:
        return f"train.warmup_tokens: {t.warmup_tokens} is more than train.decay_tokens {t.decay_tokens}"
    return None


def _target_needs_evaluations(c: Config) -> str | None:
    t = c.train
    if t.target_ppl is not None and t.eval_interval is None and t.eval_interval_s is None:
        return "train.target_ppl: needs evaluations (train.eval_interval or train.eval_interval_s)"
    return None


def _gbs_max_above_lowest_rung(c: Config) -> str | None:
    s = c.search
    if s.gbs_ladder or s.gbs_max is None or s.gbs_max >= (s.gbs_min or s.gbs_static or c.cluster.world):
        return None  # (an explicit ladder wins)
    if s.gbs_min:
        below = f"search.gbs_min {s.gbs_min}"
    elif s.gbs_static:
        below = f"search.gbs_static {s.gbs_static}"
    else:
        below = f"the world size {c.cluster.world}"
    return f"search.gbs_max: {s.gbs_max} is below {below} (the ladder's lowest rung)"


def _initial_points_within_budget(c: Config) -> str | None:
    s = c.search
    if s.n_initial > s.budget:
        return f"search.n_initial: {s.n_initial} initial points exceed search.budget {s.budget}"
    return None


def _rampup_has_three_numbers(c: Config) -> str | None:
    if c.train.rampup_batch_size is not None and len(c.train.rampup_batch_size) != 3:
        return "train.rampup_batch_size: must be [START, INCREMENT, SAMPLES] (Megatron's --rampup-batch-size)"
    return None


def _cona_needs_gns(c: Config) -> str | None:
    if c.policy == "cona" and not c.train.gns:
        return "train.gns: policy cona decides on the gradient noise scale; it needs gns: true"
    return None


def _clock_settings_need_virtual(c: Config) -> str | None:
    t = c.train
    if t.clock == "wall" and (t.clock_table is not None or t.clock_noise is not None):
        return f"train.clock_{'table' if t.clock_table is not None else 'noise'}: only with train.clock: virtual"
    return None


def _ramp_needs_rampup(c: Config) -> str | None:
    if c.policy == "ramp" and c.train.rampup_batch_size is None:
        return "policy: ramp needs train.rampup_batch_size [START, INCREMENT, SAMPLES]"
    return None


CROSS_FIELD_RULES: tuple[Callable[[Config], str | None], ...] = (
    _heads_divide_d_model,
    _head_size_even,
    _kv_heads_divide_heads,
    _grouped_query_only_llama,
    _warmup_within_decay,
    _target_needs_evaluations,
    _gbs_max_above_lowest_rung,
    _initial_points_within_budget,
    _rampup_has_three_numbers,
    _cona_needs_gns,
    _clock_settings_need_virtual,
    _ramp_needs_rampup,
)


def cross_field_problem(cfg: Config) -> str | None:
    """The first of `CROSS_FIELD_RULES` that the config breaks, as `key: why` (None if none)."""
    return next((problem for rule in CROSS_FIELD_RULES if (problem := rule(cfg))), None)


def validate_strategies(cfg: Config) -> None:
    """Refuse an infeasible fixed strategy or chain stage, with the reason."""
    fixed = ([cfg.strategy] if cfg.strategy is not None else []) + [c.strategy for c in cfg.chain or ()]
    if cfg.model.dropout > 0 and any(s.tp > 1 for s in fixed):
        raise ConfigError(
            f"model.dropout: {cfg.model.dropout:g} with tp > 1 is not supported (TP ranks would share dropout masks)"
        )
    if cfg.strategy is not None:
        problems = cfg.problems(cfg.strategy)
        if problems:
            raise ConfigError(f"strategy {cfg.strategy}: {problems[0]}")
    for i, stage in enumerate(cfg.chain or ()):
        problems = cfg.problems(stage.strategy)
        if problems:
            raise ConfigError(f"chain[{i}] {stage.strategy}: {problems[0]}")
    if cfg.policy == "chain" and not cfg.chain:
        raise ConfigError("policy: chain needs a chain (in the YAML or --chain FILE)")
    if cfg.policy in ("static", "ramp") and cfg.strategy is None and not cfg.auto_strategy:
        raise ConfigError(f"policy: {cfg.policy} needs a strategy (in the YAML, `auto`, or --strategy)")


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (plain YAML keeps the last one silently, so a
    setting the user wrote higher up would not take effect)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: the mapping's own keys override the merged ones, as YAML means
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the safe loader refuses it below
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> Any:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}" if mark else ""
        what = f": {e.problem}" if isinstance(e, yaml.constructor.ConstructorError) else ""
        raise ConfigError(f"{path}: invalid YAML{where}{what}") from None
    except yaml.YAMLError:
        raise ConfigError(f"{path}: invalid YAML") from None


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> None:
    """Set `overrides` (dotted keys of any depth, as `overrides.parse_sets` gives) in `raw`, in order: each
    part but the last walks into a mapping, made where the document has none (so the value's type is then
    refused by validation, naming the key)."""
    for key, value in (overrides or {}).items():
        *path, last = key.split(".")
        node = raw
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value


def config_from_json(text: str, source: str) -> Config:
    """Rebuild a Config from `json.dumps(cfg.to_raw())` (what the workers receive; `model.init_from`'s
    folder is not read again: a resumed run does not need it)."""
    return config_from_dict(json.loads(text), source, read_init_from=False)
