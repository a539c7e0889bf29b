"""The pass pipeline between capture and execution: parse -> verify -> passes -> emit.

Each pass is a function ``(module, options[, inputs]) -> PassOutcome`` listed by name in
``hlo_passes.registry.PASS_TABLE`` (loaded lazily into ``PASSES``); a run's data besides the
module (``PassInputs``) reaches the passes that declare ``inputs``. The pipeline verifies
the IR after parsing and after each pass (``Options.verify``), rewrites ``partition-id`` into ``replica-id`` so the
module can run as a replicated program (see ``concerto_jax.executor``), prints
the module, and checks that XLA's own parser accepts it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from concerto_jax.executor import parse_with_xla
from concerto_jax.options import Options
from concerto_jax.report import PassRecord, count_collectives
from hlo_passes.as_replicas import partition_id_to_replica_id, spmd_to_replicated
from hlo_passes.ir import HloError, HloModule, module_to_text, parse_module, verify
from hlo_passes.registry import NO_INPUTS, PASSES, PassInputs, takes_inputs
from hlo_passes.upcast import upcast_floats

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """The emitted module text and the account of how it was made."""

    text: str
    instructions: int
    collectives: dict
    passes: tuple[PassRecord, ...]
    stage_seconds: dict

    def to_json(self) -> dict:
        """A JSON-serialisable form (broadcast from the leader process)."""
        out = dataclasses.asdict(self)
        out["passes"] = [dataclasses.asdict(p) for p in self.passes]
        return out

    @classmethod
    def from_json(cls, data: dict) -> PipelineResult:
        """Inverse of ``to_json``."""
        data = dict(data)
        data["passes"] = tuple(PassRecord.from_dict(p) for p in data["passes"])
        return cls(**data)


def _replicated_text(module: HloModule) -> str:
    """The module as the executor compiles it: partitions as replicas (``spmd_to_replicated``)."""
    if module.replica_count == 1 and module.num_partitions > 1:
        spmd_to_replicated(module)
    else:  # a one-device program: nothing to translate but partition-id
        partition_id_to_replica_id(module)
    return module_to_text(module)


def wider_text(hlo_text: str) -> tuple[str, dict[str, str]]:
    """The captured module in wider precision (``hlo_passes.upcast``), ready for the executor,
    and the element-type map applied. Same arguments and output types as the original.

    Raises:
      hlo_passes.HloError: the module cannot be widened (``UpcastError`` says why) or parsed.
      concerto_jax.executor.ExecutorError: XLA's parser rejected the widened text.
    """
    module = parse_module(hlo_text, source="captured")
    mapping = upcast_floats(module)
    verify(module)
    text = _replicated_text(module)
    parse_with_xla(text)
    return text, mapping


def run(hlo_text: str, options: Options, inputs: PassInputs = NO_INPUTS) -> PipelineResult:
    """Run the pipeline on a captured post-SPMD module (``inputs``: data for the passes that
    declare it, ``hlo_passes.registry.PassInputs``).

    Raises:
      hlo_passes.HloError: the module could not be parsed, or a pass broke an invariant.
      KeyError: ``options.passes`` names a pass that is not registered.
      concerto_jax.executor.ExecutorError: XLA's parser rejected the emitted text.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    module = parse_module(hlo_text, source="captured")
    elided = [i.name for i in module.instructions()
              if i.opcode == "constant" and (i.literal or "").strip() == "{...}"]
    if elided:
        raise HloError(
            f"the captured module elides the value of {len(elided)} constants (%{elided[0]} is "
            "'{...}'); expected a dump written with xla_dump_large_constants=true (XLA prints "
            "constants of more than a few elements as '{...}' otherwise)")
    if options.verify:
        verify(module)
    timings["parse"] = time.perf_counter() - t0

    entry = module.entry
    instructions = len(entry.instructions)
    collectives = count_collectives(
        i.collective_kind for i in module.instructions() if i.is_collective)

    records = []
    t_passes = time.perf_counter()
    for name in options.passes:
        fn = PASSES[name]  # KeyError names the known passes
        t = time.perf_counter()
        outcome = fn(module, options, inputs) if takes_inputs(fn) else fn(module, options)
        if options.verify:
            verify(module)
        records.append(PassRecord(name, outcome.changed, time.perf_counter() - t, outcome.stats,
                                  outcome.tolerance, tuple(outcome.retries)))
        log.info("pass %s: changed=%s %s", name, outcome.changed, outcome.stats)
    timings["passes"] = time.perf_counter() - t_passes

    t0 = time.perf_counter()
    text = _replicated_text(module)
    timings["print"] = time.perf_counter() - t0
    if options.validate_with_xla:
        t0 = time.perf_counter()
        parse_with_xla(text)
        timings["validate"] = time.perf_counter() - t0
    return PipelineResult(text=text, instructions=instructions, collectives=collectives,
                          passes=tuple(records), stage_seconds=timings)
