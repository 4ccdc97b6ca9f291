"""An estimate of the memory one rank of a job needs, from its spec alone (`surgectl submit
--dry-run`). Arithmetic, no torch: it counts the tensors the rank holds, as Surge lays the
model out (services/compute/parallelize.py, services/engine/sharding_plan.py) and trains it.

What it counts, per rank (the pipeline stage that holds the most, when pp > 1):

* parameters: float32 always (autocast computes in bf16/fp16, the weights stay float32);
  tensor parallelism splits the projections Megatron's way (sharding_plan.tp_styles: q, k,
  v (and their biases), gate, up by column, proj and down by row; norms and embeddings
  whole); the k and v projections are n_kv_heads x head_dim wide (GQA); FSDP2 shards
  every tensor over dp (``fully_shard`` per block, then the root); a frozen parameter
  (``model.freeze``) is held but gets no gradient and no optimizer state.
* gradients: float32, one per trainable parameter, sharded like it.
* AdamW moments: ``exp_avg`` and ``exp_avg_sq``, float32 (8 bytes a trainable parameter).
* DDP buckets (ddp, dp > 1): DistributedDataParallel's flat gradient buckets, a second
  copy of the gradients (Surge leaves ``gradient_as_bucket_view`` at its default, off).
* FSDP2 all-gathered (fsdp2, dp > 1): the root's parameters (embedding, final norm, LM head:
  FSDP2 keeps the root's unsharded through backward), two blocks' (the one running and the
  one prefetched) and one block's unsharded gradients before their reduce-scatter.
* autocast weight casts (bf16 / fp16): autocast keeps a 2-byte copy of every weight a matmul
  used until backward has used it.
* activations: what autograd saves per token of a micro-batch in each block (sizes from
  services/compute/model.py; a = 2 bytes under autocast, else 4): for each of the two
  RMSNorms its input (the float32 residual stream), the normalised input and 1/rms (torch's
  RMSNorm as its composite ops save them: 8 D + 4); the inputs of q/k/v and of the MLP's first linears
  (in float32 one shared tensor of 4 D; under autocast each linear saves its own cast, a D);
  q, the attention output and its transposed copy (3 a D) and k, v (2 a G K: narrower with
  GQA; the math kernel's repeated copies are D wide), split by tp; SwiGLU's
  gate, up, silu(gate) and product (4 a F; GELU: 2 a F; split by tp); the SDPA kernel's
  log-sum-exp (4 H) or, with ``attention: math``, the softmax probabilities instead of
  the kernel's output (H T in float32, and their cast). With activation checkpointing a block keeps its input (4 D)
  and one block's are recomputed at a time. Pipeline stages hold the micro-batches in
  flight: all of them under GPipe, at most pp - stage under 1F1B.
* logits and loss: per token, the float32 logits, their log-softmax (kept for backward)
  and its gradient (3 x 4 V), and under autocast the 2-byte logits too; the final norm's
  and the LM head's saved inputs; on the last stage.

Not counted in these tensors: the process itself (Python, torch, CUDA context: hundreds of
MiB), the allocator's caching and fragmentation, communication buffers, evaluation (no
gradients, smaller), the optimizer's transient buffers. :func:`estimate_gpu_memory` adds,
for the same rank on a GPU, what CUDA brings on the device and what stays on the host (see
there: rules of thumb, named constants below, not measured: Surge has not run on a GPU).
It is an estimate; tests/cli/test_spec_tools.py checks the activations against what autograd really saves for a small model (within 1%).
Measured on the CPU (2026-12-01; n_layers 8, d_model 512, vocab 4096, 2 x 512 tokens, dp 1,
two AdamW steps, peak RSS growth from before the model is built, glibc told to return freed
memory with MALLOC_MMAP_THRESHOLD_=65536): fp32 822.4 MiB measured vs 817.9 estimated
(-0.5%), bf16 757.9 vs 759.5 (+0.2%). With glibc's defaults the peak is 938.9 MiB: the
allocator keeps freed memory (building the model alone kept 78 MiB over its 104).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.sizes import human_bytes
from services.engine.sharding_plan import block_tp_styles, stage_layer_counts, stage_of_layer
from services.jobspec import (
    JobSpec,
    block_parameter_shapes,
    check_parallel,
    frozen_parameters,
    mlp_hidden_width,
    model_parameters,
)

FLOAT32 = 4
HALF = 2  # bf16 / fp16
MiB = 2**20

# What a rank on a GPU holds beyond its tensors (estimate_gpu_memory). Rules of thumb from
# vendors' documentation and common reports, not measured here (no GPU yet; docs/LOG.md will
# hold the measurement): the CUDA context with cuBLAS / cuDNN handles and cuBLAS's workspace
# (torch 2.x, CUDA 12 loading modules lazily, a Hopper GPU: about 0.5 to 0.8 GiB);
CUDA_CONTEXT = 640 * MiB
# NCCL's buffers per communicator: NCCL_BUFFSIZE (4 MiB, its default) per channel, for each
# of a ring's two neighbours, sending and receiving, over 16 channels (NCCL opens up to 32
# on NVLink): 4 MiB x 2 x 2 x 16 = 256 MiB;
NCCL_BUFFSIZE = 4 * MiB
NCCL_CHANNELS = 16
# the caching allocator's rounding and fragmentation (torch.cuda.memory_reserved over
# memory_allocated: typically 5 to 20 % in training), as a share of the tensors;
ALLOCATOR_RESERVE = 0.10
# and, on the host, the rank process itself: Python, torch's CUDA build and the CUDA
# runtime's host side (a CPU-only torch process with Surge's modules: 0.24 GiB here).
HOST_RUNTIME = 1536 * MiB


@dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: int
    note: str


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate for the rank of pipeline stage ``stage`` (the largest of ``stages``)."""

    stage: int
    stages: int
    parameters: int  # parameters this rank holds (elements)
    total_parameters: int  # the model's (elements, a tied weight once)
    items: tuple[MemoryItem, ...]

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def checkpoint_bytes(self) -> int:
        """This rank's part of a save (float32 parameters and AdamW moments): what its
        in-memory checkpoint copy needs in the node agent's shared memory (/dev/shm)."""
        return sum(i.bytes for i in self.items if i.name in ("parameters", "AdamW moments"))

    def lines(self) -> list[str]:
        """The estimate as text lines (what `submit --dry-run` prints)."""
        where = f"pipeline stage {self.stage} of {self.stages}, the largest; " if self.stages > 1 else ""
        head = (
            f"memory per rank (an estimate: tensors only; the process's own runtime, allocator caching and "
            f"communication buffers come on top): {where}{self.parameters:,} of {self.total_parameters:,} parameters"
        )
        out = [head]
        width = max(len(i.name) for i in self.items)
        out += [f"  {i.name:<{width}}  {human_bytes(i.bytes):>10}  {i.note}" for i in self.items]
        out.append(f"  {'total':<{width}}  {human_bytes(self.total):>10}")
        return out


def estimate_memory(spec: JobSpec) -> MemoryEstimate:
    """Bytes one rank of ``spec`` holds at its peak (the module docstring says what is
    counted); for pp > 1, the stage whose rank needs the most.

    O(pp) in the model's depth: every block is alike, so a stage's blocks are one block's
    tensors times their count (a spec's ``n_layers`` may be 2^31 - 1: listing its parameters
    ran `submit --dry-run` out of memory, and control's allocator asks this for every job it
    places). Only ``model.freeze`` is matched name by name, as the spec's validation does.
    """
    m, p = spec.model, spec.parallel
    # Not the whole plan (sharding_plan.plan): its mesh lists every rank, and control's
    # allocator asks this for every queued job it tries (dp 10,000,000: 37.8 s and 2.8 GB on
    # control). A rank's memory depends on the degrees only.
    check_parallel(m, spec.world_size, p)  # the ValueError plan() raises, naming the field
    counts = stage_layer_counts(m.n_layers, p.pp)
    stages, last = len(counts), len(counts) - 1
    fsdp = p.dp > 1 and p.data_parallel == "fsdp2"  # (dp 1: "none", as the plan says)
    ddp = p.dp > 1 and p.data_parallel == "ddp"
    shard = (lambda n: math.ceil(n / p.dp)) if fsdp else (lambda n: n)
    # A column-parallel linear's bias is split with its output features; a row-parallel
    # one has none here (proj and down are bias-free).
    split = {f"{fqn}.{kind}" for fqn, _ in (block_tp_styles(m) if p.tp > 1 else ()) for kind in ("weight", "bias")}
    block = {name: math.prod(shape) // (p.tp if name in split else 1) for name, shape in block_parameter_shapes(m)}
    outer = {o: n for name, o, n in _outer_parameters(m) if name == o}  # embedding, final norm, untied LM head
    frozen = _frozen_by_stage(spec, block, outer, shard) if m.freeze else {}
    autocast = spec.precision.dtype in ("bf16", "fp16")
    a = HALF if autocast else FLOAT32
    total_parameters = sum(outer.values()) + m.n_layers * sum(math.prod(s) for _, s in block_parameter_shapes(m))

    best: MemoryEstimate | None = None
    for s in range(stages):
        layers = counts[s]
        local = {o: n for o, n in outer.items() if s == (0 if o == "tok_emb.weight" else last)}
        held = sum(shard(n) for n in local.values()) + layers * sum(shard(n) for n in block.values())
        frozen_held, frozen_whole = frozen.get(s, (0, 0))
        trainable = held - frozen_held
        items = [
            MemoryItem("parameters", FLOAT32 * held, "float32" + (f", sharded over dp {p.dp} (fsdp2)" if fsdp else "")),
            MemoryItem("gradients", FLOAT32 * trainable, "float32, trainable parameters only"),
            MemoryItem("AdamW moments", 2 * FLOAT32 * trainable, "exp_avg and exp_avg_sq, float32"),
        ]
        if ddp:
            unsharded = sum(local.values()) + layers * sum(block.values()) - frozen_whole
            items.append(MemoryItem("DDP buckets", FLOAT32 * unsharded, "a flat copy of the gradients"))
        if fsdp:
            one_block = sum(block.values()) if layers else 0
            items.append(
                MemoryItem(
                    "FSDP2 gathered",
                    FLOAT32 * (sum(local.values()) + 3 * one_block),
                    "unsharded: the root's parameters, two blocks' parameters, one block's gradients",
                )
            )
        if autocast:  # the blocks' linears, and the LM head (the embedding's lookup is no matmul)
            matmul = layers * sum(n for name, n in block.items() if name.startswith(("attn.", "mlp.")))
            if s == last:
                matmul += local.get("lm_head.weight", outer["tok_emb.weight"] if m.tie_embeddings else 0)
            items.append(MemoryItem("autocast casts", HALF * matmul, f"{spec.precision.dtype} copies of the weights"))
        items += _activations(spec, s, stages, p.microbatches or p.pp, p.pipeline_schedule, layers, a)
        est = MemoryEstimate(s, stages, held, total_parameters, tuple(items))
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def _outer_parameters(m) -> list[tuple[str, str, int]]:
    """The parameters outside the blocks, as :func:`model_parameters` lists them (the
    embedding first, then the final norm and the LM head)."""
    D, V = m.d_model, m.vocab_size
    head_owner = "tok_emb.weight" if m.tie_embeddings else "lm_head.weight"
    return [("tok_emb.weight", "tok_emb.weight", V * D), ("norm.weight", "norm.weight", D),
            ("lm_head.weight", head_owner, V * D)]  # fmt: skip


def _frozen_by_stage(spec: JobSpec, block: dict[str, int], outer: dict[str, int], shard) -> dict[int, tuple[int, int]]:
    """Stage -> (frozen elements it holds, the same unsharded by dp), ``model.freeze``'s
    patterns matched against every parameter's name (the spec's validation does the same)."""
    m, p = spec.model, spec.parallel
    owners = frozen_parameters(m.freeze, ((n, o) for n, o, _ in model_parameters(m)))
    out: dict[int, tuple[int, int]] = {}
    for owner in owners:
        if owner.startswith("blocks."):
            _, layer, name = owner.split(".", 2)
            stage, n = stage_of_layer(m.n_layers, p.pp, int(layer)), block[name]
        else:
            stage, n = (0 if owner == "tok_emb.weight" else p.pp - 1), outer[owner]  # (as estimate_memory's local)
        held, whole = out.get(stage, (0, 0))
        out[stage] = (held + shard(n), whole + n)
    return out


def _activations(
    spec: JobSpec, stage: int, stages: int, n_micro: int, schedule: str, layers: int, a: int
) -> list[MemoryItem]:
    m, p, d = spec.model, spec.parallel, spec.data
    D, F, H, T, tp = m.d_model, mlp_hidden_width(m), m.n_heads, d.seq_len, p.tp
    KV = m.kv_heads * m.head_dim  # k and v: D wide without GQA
    rows, in_flight = d.micro_batch_size, 1
    if stages > 1:  # a pipeline micro-batch is micro_batch_size / microbatches rows
        rows = d.micro_batch_size // n_micro
        in_flight = n_micro if schedule == "gpipe" else min(n_micro, stages - stage)
    rows_held = rows * in_flight
    tokens = rows_held * T
    qkv_in = FLOAT32 * D if a == FLOAT32 else 3 * a * D
    mlp_in = FLOAT32 * D if a == FLOAT32 else (2 if m.mlp == "swiglu" else 1) * a * D
    mlp_hidden = (4 if m.mlp == "swiglu" else 2) * a * F // tp
    if spec.attention == "math":  # q, k and v (repeated to H heads), the heads' output copy; the probabilities
        attention = 4 * a * D // tp + (H // tp) * T * (FLOAT32 + (a if a != FLOAT32 else 0))
    else:  # q, k, v (G heads: SDPA's enable_gqa reads them unrepeated), the kernel's output and its copy; the log-sum-exp
        attention = a * (3 * D + 2 * KV) // tp + FLOAT32 * (H // tp)
    norm = 2 * FLOAT32 * D + FLOAT32  # RMSNorm: its input, the normalised input, 1/rms
    per_layer = 2 * norm + qkv_in + attention + mlp_in + mlp_hidden
    if p.activation_checkpointing:
        blocks = FLOAT32 * D * layers * tokens + per_layer * tokens
        how = f"checkpointed: each block's input, one block recomputed at a time ({layers} blocks)"
    else:
        blocks = per_layer * layers * tokens
        how = f"{per_layer:,} bytes a token a block x {layers} blocks"
    held = f"{rows_held} rows x seq_len {T}"
    if stages > 1:
        held += f" ({in_flight} pipeline micro-batch{'es' if in_flight > 1 else ''} of {rows} rows in flight)"
    out = [MemoryItem("activations", blocks, f"{held}; {how}")]
    if stage == stages - 1:
        logits_tokens = (rows if schedule != "gpipe" else rows_held) * T  # (1F1B's last stage: one at a time)
        per_token = 3 * FLOAT32 * m.vocab_size + (a * m.vocab_size if a != FLOAT32 else 0)
        final_norm = norm + a * D  # and the LM head's input
        out.append(
            MemoryItem(
                "logits and loss",
                (per_token + final_norm) * logits_tokens,
                f"vocab_size {m.vocab_size} x {logits_tokens} tokens: logits, log-softmax and its gradient",
            )
        )
    return out


@dataclass(frozen=True)
class GpuEstimate:
    """One rank of the job on a GPU: what its device holds (``device``) and what it keeps
    in host memory beside it (``host``)."""

    device: tuple[MemoryItem, ...]
    host: tuple[MemoryItem, ...]

    @property
    def device_total(self) -> int:
        return sum(i.bytes for i in self.device)

    @property
    def host_total(self) -> int:
        return sum(i.bytes for i in self.host)

    def lines(self) -> list[str]:
        """The estimate as text lines (what `submit --dry-run` prints after the tensors')."""
        out = [
            "on a GPU, per rank (rules of thumb for CUDA's own memory, not measured; see services/memory_estimate.py):"
        ]
        width = max(len(i.name) for i in (*self.device, *self.host))
        out += [f"  {i.name:<{width}}  {human_bytes(i.bytes):>10}  {i.note}" for i in self.device]
        out.append(f"  {'GPU total':<{width}}  {human_bytes(self.device_total):>10}")
        out += [f"  {i.name:<{width}}  {human_bytes(i.bytes):>10}  {i.note}" for i in self.host]
        out.append(f"  {'host total':<{width}}  {human_bytes(self.host_total):>10}")
        return out


def estimate_gpu_memory(spec: JobSpec, tensors: MemoryEstimate | None = None) -> GpuEstimate:
    """The memory one rank of ``spec`` needs when it trains on a GPU (``tensors``: its
    :func:`estimate_memory`, computed when not given).

    Device: the tensors (the same as on the CPU: float32 weights, gradients and moments,
    autocast's bf16/fp16 weight casts, activations, logits), the CUDA context
    (``CUDA_CONTEXT``), NCCL's buffers for each communicator the rank joins (the world's
    and each parallel axis's of more than one rank, narrower than the world), the caching
    allocator's reserve (``ALLOCATOR_RESERVE`` of the tensors). Host: the process
    (``HOST_RUNTIME``) and, when the job checkpoints, the staging buffers its snapshots are
    copied into (pinned, reused between saves): the rank's float32 parameters and AdamW
    moments. Not counted: a Hugging Face import's transient host copies, the data
    service's buffers (another process), evaluation.
    """
    est = tensors or estimate_memory(spec)
    p, world = spec.parallel, spec.world_size
    axes = [n for n in (p.dp, p.tp, p.pp) if 1 < n < world]
    communicators = (1 if world > 1 else 0) + len(axes)
    nccl = communicators * NCCL_BUFFSIZE * 2 * 2 * NCCL_CHANNELS
    device = [
        MemoryItem("tensors", est.total, "the estimate above"),
        MemoryItem("CUDA context", CUDA_CONTEXT, "context, cuBLAS/cuDNN handles and workspace"),
    ]
    if nccl:
        device.append(
            MemoryItem(
                "NCCL buffers",
                nccl,
                f"{communicators} communicator(s) x {NCCL_CHANNELS} channels x 2 neighbours x 2 directions x "
                f"NCCL_BUFFSIZE {NCCL_BUFFSIZE // MiB} MiB",
            )
        )
    device.append(
        MemoryItem(
            "allocator reserve",
            round(ALLOCATOR_RESERVE * est.total),
            f"{ALLOCATOR_RESERVE:.0%} of the tensors: the caching allocator's rounding and fragmentation",
        )
    )
    host = [MemoryItem("host: rank process", HOST_RUNTIME, "Python, torch (CUDA build), the CUDA runtime's host side")]
    c = spec.checkpoint
    if c.every_steps > 0 or c.at_end:
        by_name = {i.name: i.bytes for i in est.items}
        staged = by_name["parameters"] + by_name["AdamW moments"]
        host.append(
            MemoryItem("host: snapshot staging", staged, "pinned copies of the rank's parameters and AdamW moments")
        )
    return GpuEstimate(tuple(device), tuple(host))
