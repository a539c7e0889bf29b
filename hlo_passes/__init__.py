"""The passes over HLO, and the IR they share.

Layout::

    ir/                the IR (parse, verify, print, analyses): no pass here (hlo_passes.ir)
    registry.py        the passes by name (PASS_TABLE, PASSES), PassOutcome; imports only the IR
    options.py         PassOptions: what every pass may read of the options it is given
    as_replicas.py     fixed rewrites every emitted module gets: a per-device SPMD module
                       run as N replicas (partition ids, channels, mesh groups, header)
    cpu_compensation.py XLA:CPU's divide-by-broadcast rule (for the executor)
    upcast.py          a module's wider-precision twin (the first step's "wider" judge)
    emit.py            the scheduled form with async start/done pairs (dumps)
    schedule/          pass "schedule" (run.py: schedule_pass)
    pin/               pass "pin" (run.py: pin_pass, planned_windows; rewrite.py: the barriers)
    fuse_collectives/  pass "fuse_collectives" (run.py: fuse_pass; grouping.py: Algorithm 1 on
                       the task graph; rewrite.py: variadic collectives in the HLO)
    pipeline_loops/    pass "pipeline_loops" (run.py; decide.py; prefetch.py, rotation.py: the
                       rewrites; loop_state.py: what both share)
    decompose/         pass "decompose" (run.py: decompose_pass; critical.py, rules.py,
                       context.py, region.py, cost.py, choose.py, search.py: the decisions;
                       rewrite.py: the split; options.py: DecomposeOptions)
    replicated_reductions/
                       the collectives of replicated operands that decompose shrinks
                       (decide.py: where it pays; rewrite.py: the rewrite)

Pipeline position::

    HLO text (post-SPMD, or XLA's scheduled GPU module)
      | parse_module        text -> HloModule (ir/parser.py; HloParseError names the line)
      | verify              IR invariants (ir/verifier.py; HloVerifyError shows the instruction)
      | passes              rewrite the IR through the mutation helpers (ir/)
      | module_to_text      IR -> text that XLA's parser accepts (ir/printer.py)
      v
    xla_canonical(text)     XLA's own parse + print: the reference for equality (ir/xla.py)

This face is for users, tests and bench; library modules import from ``hlo_passes.ir``.

Public API (stable; other packages build on it):

* ``parse_module(text, source="<hlo>") -> HloModule``
* ``module_to_text(module) -> str`` (also ``str(module)``),
  ``computation_to_text(comp)``, ``instruction_to_text(inst)`` (also ``repr(inst)``)
* ``verify(module) -> HloModule`` (raises ``HloVerifyError``)
* ``xla_canonical(text) -> str``, ``xla_parse(text)`` (jaxlib ``HloModule``)
* ``HloModule``: ``name``, ``attrs`` (header, raw text), ``sections`` (verbatim
  FileNames/.../StackFrames), ``computations``, ``entry``, ``computation(name)``,
  ``instructions()``, ``num_partitions``, ``replica_count``, ``num_devices``,
  ``is_scheduled``, ``add_computation``, ``remove_computation``, ``unique_name(base)``
* ``Computation``: ``name``, ``instructions`` (order = schedule), ``root``,
  ``is_entry``, ``parameters``, ``instruction(name)``, ``post_order()``,
  ``add_instruction(inst, before=|after=)``, ``remove_instruction``,
  ``replace_all_uses(old, new)``, ``replace_instruction(old, new)``,
  ``rename(inst, name)``, ``set_order(instructions)``
* ``Instruction(name, opcode, shape, operands=(), attrs=None)``: ``operands``,
  ``users``, ``attrs`` (ordered raw text; computations/instructions for references),
  ``attr(key)``, ``set_attr(key, value)``, ``replace_operand(old|index, new)``,
  ``set_operands``, ``control_predecessors``, ``add_control_predecessor``,
  ``called_computations``, ``to_apply``, ``channel_id``, ``dimensions``,
  ``use_global_device_ids``, ``tuple_index``, ``replica_groups`` (expanded from
  list/iota/mesh forms; settable), ``source_target_pairs``, ``custom_call_target``,
  ``metadata``/``sharding``/``backend_config``/``frontend_attributes`` (raw),
  ``literal`` (constants), ``parameter_number``, ``is_collective``,
  ``collective_kind``, ``async_role``, ``async_start()``, ``async_wrapped``,
  ``collective_op`` (the op carrying a collective's groups, through wrappers),
  ``is_collective_kernel`` (XLA:GPU's Triton all-reduce kernels, any form)
* ``Shape`` (``dtype``, ``dims``, ``layout``, ``elements``, ``is_tuple``,
  ``byte_size``, ``without_layout()``), ``parse_shape(text)``
* ``parse_replica_groups(text)``, ``format_replica_groups(groups)``
* ``partition_id_to_replica_id(module)``, ``spmd_to_replicated(module)`` (run a
  per-device SPMD module as N replicas: ids, channels, mesh groups, header)
* errors: ``HloError``, ``HloParseError``, ``HloVerifyError``
"""

from hlo_passes.as_replicas import partition_id_to_replica_id, spmd_to_replicated
from hlo_passes.ir import (
    Computation,
    HloError,
    HloModule,
    HloParseError,
    HloVerifyError,
    Instruction,
    Shape,
    computation_to_text,
    format_replica_groups,
    instruction_to_text,
    module_to_text,
    parse_module,
    parse_replica_groups,
    parse_shape,
    verify,
    xla_canonical,
    xla_parse,
)

__all__ = [
    "Computation", "HloError", "HloModule", "HloParseError", "HloVerifyError",
    "Instruction", "Shape", "computation_to_text", "format_replica_groups",
    "instruction_to_text", "module_to_text", "parse_module", "parse_replica_groups",
    "parse_shape", "partition_id_to_replica_id", "spmd_to_replicated", "verify", "xla_canonical", "xla_parse",
]
