"""The job spec: one YAML file, validated once by pydantic, pushed down frozen.

The package: one module per section (model, data, parallel, training, fault_policy, liveness),
``base`` (bounds, ``_Strict``), and here the job itself, its parsing and its layouts. Every
name is imported from ``services.jobspec``.

Unknown keys are rejected with their path; every user mistake becomes one line that names
the file and the field (``demo.yaml: data.seq_len: Input should be greater than 0, got -4``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from services.jobspec.base import (  # noqa: F401 (re-exported: the spec's one import path)
    FLOAT_MAX,
    I32_MAX,
    I64_MAX,
    MAX_LAYERS,
    MAX_WORLD_SIZE,
    MICRO_BATCH_TOKENS_MAX,
    MIN_BEAT_SECONDS,
    SECONDS_MAX,
    U32_MAX,
    JobSpecError,
    _Strict,
)
from services.jobspec.data import (  # noqa: F401 (re-exported: the spec's one import path)
    DATASET_PATTERN,
    DataSpec,
    FilterSpec,
    MixtureItem,
    PrefetchSpec,
)
from services.jobspec.evaluation import EvaluationJobSpec  # noqa: F401 (re-exported: the spec's one import path)
from services.jobspec.fault_policy import (  # noqa: F401 (re-exported: the spec's one import path)
    DATA_OUTAGE,
    DEFAULT_CLASS_ACTIONS,
    DEFAULT_CLASS_RESTARTS,
    DEFAULT_GRADE_ACTIONS,
    FAULT_GRADES,
    IN_PLACE_ACTIONS,
    KNOWN_FAULT_CLASSES,
    PAUSE_CLASSES,
    REBUILD_CLASSES,
    SAVE_FAULT_CLASSES,
    SLOW_RANK_ACTIONS,
    STEP_FAULT_CLASSES,
    FaultAction,
    FaultPolicySpec,
)
from services.jobspec.liveness import (  # noqa: F401 (re-exported: the spec's one import path)
    PHASE_SECONDS_MAX,
    LinksSpec,
    LivenessSpec,
    PhaseSecondsSpec,
)
from services.jobspec.model import (  # noqa: F401 (re-exported: the spec's one import path)
    InitFromSpec,
    ModelSpec,
    RopeScaling,
    block_parameter_shapes,
    frozen_parameters,
    mlp_hidden_width,
    model_parameter_shapes,
    model_parameters,
)
from services.jobspec.parallel import (  # noqa: F401 (re-exported: the spec's one import path)
    ParallelSpec,
    check_parallel,
)
from services.jobspec.training import (  # noqa: F401 (re-exported: the spec's one import path)
    WEBHOOK_PATTERN,
    WEBHOOK_URL_MAX,
    CheckpointSpec,
    EvalSpec,
    IntegritySpec,
    LossScaleSpec,
    MetricsSpec,
    NotifySpec,
    OperatorsSpec,
    OptimizerSpec,
    PrecisionSpec,
    SimulateSpec,
    WandbSpec,
)
from services.jobspec_errors import spec_error_text


def rebuild_refusal(spec: JobSpec, *, structural: bool = False) -> str:
    """Why ``spec``'s ranks cannot rebuild their group in place ("" when they can): the
    replacement of a lost rank takes its whole state from a live peer, so every rank must
    hold a whole replica (data parallelism alone: DDP, no FSDP2, TP or PP shards) and there
    must be a peer (dp >= 2). ``structural``: the plan alone (checked at submit; the dp
    size may change by an operator's resume, so dp >= 2 is the decision's to check)."""
    p = spec.parallel
    if p.tp > 1 or p.pp > 1:
        return f"needs tp = pp = 1 (a lost rank's tp/pp shard is on no live peer; this job has tp {p.tp}, pp {p.pp})"
    if p.dp > 1 and p.data_parallel != "ddp":
        return f"needs data_parallel ddp (with {p.data_parallel} a lost rank's shard is on no live peer)"
    if p.dp < 2 and not structural:
        return "needs dp >= 2 (a lost rank heals from a live peer)"
    return ""


class JobSpec(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    # The team the job belongs to (quotas, fair share, access): the caller's identity's team
    # where control maps identities to teams, this field where it does not.
    team: str = Field("default", pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    # Whether a queued job of a higher priority may preempt it (it checkpoints at a step
    # boundary, waits in the queue, and continues from that checkpoint when capacity returns).
    preemptible: bool = True
    steps: int = Field(..., gt=0)
    seed: int = Field(0, ge=0)
    model: ModelSpec = ModelSpec()
    data: DataSpec
    parallel: ParallelSpec = ParallelSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    precision: PrecisionSpec = PrecisionSpec()
    operators: OperatorsSpec = OperatorsSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec = EvalSpec()
    integrity: IntegritySpec = IntegritySpec()
    fault_policy: FaultPolicySpec = FaultPolicySpec()
    liveness: LivenessSpec = LivenessSpec()
    links: LinksSpec = LinksSpec()
    init_from: InitFromSpec | None = None
    metrics: MetricsSpec = MetricsSpec()
    notify: NotifySpec = NotifySpec()
    simulate: SimulateSpec | None = None  # the scale test bed's simulated ranks (SimulateSpec)
    evaluation: EvaluationJobSpec | None = None  # an evaluation job: trains nothing (evaluation.py)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_string(cls, value: object) -> object:
        # `precision: bf16` (the older form) is `precision: {dtype: bf16}`.
        return {"dtype": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_attention_choice(self) -> JobSpec:
        chosen = self.operators.attention
        # model.attention at its default says nothing (and a spec's JSON form carries it).
        if chosen is not None and self.model.attention != "sdpa" and chosen != self.model.attention:
            raise ValueError(
                f"operators.attention ({chosen}) and model.attention ({self.model.attention}) disagree; "
                "set operators.attention only"
            )
        return self

    @model_validator(mode="after")
    def _deadlines_can_be_met(self) -> JobSpec:
        # (Next to LivenessSpec's own rule that the silence deadline covers two beats.)
        live = self.liveness
        if live.heartbeat_interval_seconds < MIN_BEAT_SECONDS:
            raise ValueError(
                f"liveness.heartbeat_interval_seconds: {live.heartbeat_interval_seconds:g} s is shorter than a rank's "
                f"beat thread can keep and control can take from every rank (at least {MIN_BEAT_SECONDS:g} s)"
            )
        if live.stall_min_seconds < 2 * live.heartbeat_interval_seconds:
            raise ValueError(
                f"liveness.stall_min_seconds: {live.stall_min_seconds:g} s cannot be met: step progress is heard in "
                f"heartbeats, every {live.heartbeat_interval_seconds:g} s; it must be at least two of them "
                f"({2 * live.heartbeat_interval_seconds:g} s)"
            )
        return self

    @model_validator(mode="after")
    def _token_ids_in_vocabulary(self) -> JobSpec:
        vocab, d = self.model.vocab_size, self.data
        if d.pad_id >= vocab:
            raise ValueError(f"data.pad_id: {d.pad_id} is not a token id of model.vocab_size {vocab} (0..{vocab - 1})")
        outside = [t for t in d.filter.banned_tokens if t >= vocab]
        if outside:
            raise ValueError(
                f"data.filter.banned_tokens: {outside[0]} is not a token id of model.vocab_size {vocab} (0..{vocab - 1})"
            )
        return self

    @model_validator(mode="after")
    def _parallel_fits_model(self) -> JobSpec:
        # The planner's refusals, at submit time rather than when the ranks start.
        check_parallel(self.model, self.world_size, self.parallel)
        p = self.parallel
        if p.tp > 1 and p.pp > 1:  # plannable, but the pipeline stages do not take TP shards yet
            raise ValueError(f"parallel.tp: tp ({p.tp}) > 1 together with pp ({p.pp}) > 1 is not supported yet")
        if p.pp > 1 and self.operators.compile:
            raise ValueError("operators.compile: torch.compile of pipeline stages is not supported yet (pp > 1)")
        n_micro = p.microbatches or p.pp
        if p.pp > 1 and self.data.micro_batch_size % n_micro:
            raise ValueError(
                f"data.micro_batch_size: {self.data.micro_batch_size} rows must split into "
                f"parallel.microbatches ({n_micro}) pipeline micro-batches"
            )
        return self

    @model_validator(mode="after")
    def _simulated_ranks_are_data_parallel(self) -> JobSpec:
        p = self.parallel
        if self.simulate is not None and (p.tp > 1 or p.pp > 1):
            raise ValueError(
                f"simulate: simulated ranks take data parallelism only (tp {p.tp}, pp {p.pp}; need 1 and 1)"
            )
        return self

    @model_validator(mode="after")
    def _evaluation_is_one_rank_from_its_version(self) -> JobSpec:
        ev = self.evaluation
        if ev is None:
            return self
        if self.init_from is None or self.init_from.checkpoint != ev.version:
            raise ValueError(
                f"evaluation.version: {ev.version} must also be init_from.checkpoint (the weights the job loads)"
            )
        if self.world_size != 1 or self.simulate is not None:
            raise ValueError(f"evaluation: an evaluation job runs one rank (this spec asks {self.world_size})")
        return self

    @model_validator(mode="after")
    def _rebuild_fits_plan(self) -> JobSpec:
        asked = sorted((k, a) for k, a in self.fault_policy.actions.items() if a in (*IN_PLACE_ACTIONS, "replace"))
        why = rebuild_refusal(self, structural=True) if asked else ""
        if why:
            raise ValueError(f"fault_policy.actions.{asked[0][0]}: {asked[0][1]} {why}; use restart_ranks")
        return self

    @property
    def attention(self) -> str:
        """The attention kernel the job asks for: ``operators.attention``, else ``model.attention``."""
        return self.operators.attention or self.model.attention

    @property
    def world_size(self) -> int:
        """Ranks the job needs: dp * tp * pp."""
        p = self.parallel
        return p.dp * p.tp * p.pp

    @property
    def tokens_per_step(self) -> int:
        d = self.data
        return self.parallel.dp * d.micro_batch_size * d.grad_accum * d.seq_len


def parse_job_spec(text: str, source: str = "job.yaml") -> JobSpec:
    """YAML text -> JobSpec. With ``init_from.hf``, the fields of ``model:`` the text leaves
    out that describe the architecture come from that directory's config.json when it can
    be read here (services/hf_config.py ``model_from_hf``: a submit checks the directory
    in any case), and those it writes must agree with it.

    Raises:
        JobSpecError: malformed YAML, unknown key, wrong type or value; ``init_from.hf``'s
            config differing from a written model field or of an architecture Surge lacks;
            one line naming ``source`` and the field's dotted path.
    """
    raw = read_spec_mapping(text, source)
    init = raw.get("init_from")
    if isinstance(init, dict) and isinstance(init.get("hf"), str) and init["hf"].startswith("/"):
        # The model's shape from the directory's config.json, for the fields the spec leaves
        # out (a spec with no model section: all of them). Here, where every reader of a job
        # file passes (surgectl, control's SubmitJob), so both see the same model; a spec read
        # back (spec_from_json) holds the whole model and reads no directory. (Imported here:
        # services/hf_config.py builds on this module.)
        from services.hf_config import model_from_hf

        written = raw.get("model")
        model = model_from_hf(init["hf"], written, source)
        raw = raw if model is None else {**raw, "model": model}
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        if isinstance(init, dict) and isinstance(init.get("hf"), str) and init["hf"].startswith("/"):
            from services.hf_config import unread_directory

            # A directory that gave the model none of its shape is the problem to name, not
            # a default it left in place (``model.vocab_size: 256``, which the user never wrote).
            problem = unread_directory(init["hf"], written)
            if problem:
                raise JobSpecError(f"{source}: {problem}") from None
        raise JobSpecError(spec_error_text(e, source, JobSpec)) from None


def read_spec_mapping(text: str, source: str = "job.yaml") -> dict:
    """YAML text -> the raw mapping of job fields, not validated (``surgectl submit --set``
    edits it before :func:`parse_job_spec` validates it).

    Raises:
        JobSpecError: malformed YAML (a key twice included) or not a mapping; one line.
    """
    raw = yaml_value(text, source)
    if raw is None:
        raise JobSpecError(f"{source}: the file is empty (expected a mapping of job fields: name, steps, data, ...)")
    if not isinstance(raw, dict):
        kind = {list: "a list", str: "a single value", int: "a number", float: "a number", bool: "a boolean"}
        raise JobSpecError(f"{source}: expected a mapping of job fields, got {kind.get(type(raw), type(raw).__name__)}")
    return raw


def yaml_value(text: str, source: str) -> object:
    """A YAML document read as a job file is read (``1e-3`` is a float, a key twice is an
    error). Raises JobSpecError: malformed YAML, one line naming ``source``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobSpecError(f"{source}:{where}: malformed YAML: {problem}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (YAML's last-one-wins
    would silently drop what the author wrote first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats that YAML 1.1 (PyYAML) reads as strings, which the strict spec then
# refuses as "not a number": an exponent with no dot (``1e-3``, ``3E+4``: everyone writes an
# LR so) or with no sign (``5.0e5``, ``.5e6``: how rope_theta is written). YAML 1.2's core
# schema float, less what YAML 1.1 already reads (``1.0e+5``, ``.inf``).
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file. Raises JobSpecError (also for a missing file)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise JobSpecError(f"{p}: cannot read job spec: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise JobSpecError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return parse_job_spec(text, str(p))


def spec_to_json(spec: JobSpec) -> str:
    return spec.model_dump_json()


# Validation context of a spec read back (journal, checkpoint, InitJob): the freeze rule that
# needs the model's names is left to the shard loader, so a job journaled before it reloads.
STORED: dict[str, bool] = {"stored": True}


def spec_from_json(text: str) -> JobSpec:
    return JobSpec.model_validate_json(text, context=STORED)


def at_data_parallel_size(
    spec: JobSpec, dp: int, *, micro_batch_size: int = 0, grad_accum: int = 0, largest: int = 0, source: str
) -> JobSpec:
    """``spec`` at ``dp`` data-parallel ranks with the job's global batch (micro_batch_size x
    grad_accum x dp rows) kept: the data position is a cursor into one sequence of global
    batches, and the step count, schedule and losses are per global batch. Unnamed
    (0): ``micro_batch_size`` is the largest not above ``largest`` (default: the job's) that
    divides the rows per rank (no rank holds more activations than the job ran with),
    ``grad_accum`` what is left.

    Raises:
        JobSpecError: ``dp`` does not divide the global batch, or the given sizes do not
            multiply to it (one line naming ``source`` and the fields).
    """
    d = spec.data
    rows = d.micro_batch_size * d.grad_accum * spec.parallel.dp
    per_rank, left = divmod(rows, dp) if dp > 0 else (0, 1)
    if left:
        raise JobSpecError(
            f"{source}: the global batch of {rows} rows (data.micro_batch_size x data.grad_accum x parallel.dp = "
            f"{d.micro_batch_size} x {d.grad_accum} x {spec.parallel.dp}) does not split over {dp} ranks"
        )
    mbs, accum = micro_batch_size, grad_accum
    if not mbs and accum:
        mbs = per_rank // accum if per_rank % accum == 0 else 0
    if not mbs:
        mbs = max(b for b in range(1, min(largest or d.micro_batch_size, per_rank) + 1) if per_rank % b == 0)
    accum = accum or per_rank // mbs
    if mbs * accum != per_rank:
        raise JobSpecError(
            f"{source}: data.micro_batch_size x data.grad_accum must be {per_rank} rows per rank at dp {dp} "
            f"(the global batch of {rows} rows kept), not {mbs} x {accum}"
        )
    return with_layout(spec, dp=dp, micro_batch_size=mbs, grad_accum=accum, source=source)


def with_layout(spec: JobSpec, *, dp: int, micro_batch_size: int, grad_accum: int, source: str) -> JobSpec:
    """``spec`` at another data-parallel layout (``parallel.dp``, ``data.micro_batch_size``,
    ``data.grad_accum``), validated like a submitted spec. ``eval.batches`` (micro-batches per
    rank) follows, so that an evaluation reads the same held-out rows at every layout (the
    rows, batches x dp x micro_batch_size, rounded up where the new layout does not split
    them); everything else is unchanged.

    Raises:
        JobSpecError: the layout breaks a rule of the spec (one line naming ``source`` and
            the field, e.g. a pipeline's micro-batch split).
    """
    raw = json.loads(spec_to_json(spec))
    raw["parallel"]["dp"] = dp
    raw["data"]["micro_batch_size"], raw["data"]["grad_accum"] = micro_batch_size, grad_accum
    eval_rows = spec.eval.batches * spec.parallel.dp * spec.data.micro_batch_size
    raw["eval"]["batches"] = max(1, -(-eval_rows // max(dp * micro_batch_size, 1)))
    try:
        return JobSpec.model_validate_json(json.dumps(raw))
    except ValidationError as e:
        raise JobSpecError(spec_error_text(e, source, JobSpec)) from None
