"""The HLO graph IR: parse, verify, print, and the analyses every pass reads. No pass lives here.

Stages of a module through the IR::

    HLO text (post-SPMD, or XLA's scheduled GPU module)
      | parse_module        text -> HloModule (parser.py; HloParseError names the line)
      | verify              IR invariants (verifier.py; HloVerifyError shows the instruction)
      | (a pass)            rewrites through the mutation helpers of the classes below
      | module_to_text      IR -> text that XLA's parser accepts (printer.py)
      v
    xla_canonical(text)     XLA's own parse + print: the reference for equality (xla.py)

Classes (instruction.py, computation.py, module.py): attributes are kept as an
insertion-ordered dict of raw strings so that the printer reproduces what it parsed; the
attributes that name other IR objects hold objects instead (computations for
``to_apply``/``calls``/...; instructions for ``control-predecessors``), so renaming or
replacing them is safe. Typed accessors (``channel_id``, ``replica_groups``,
``dimensions``, ...) parse the raw text on demand and write it back on assignment.
Mutation goes through methods that keep ``operands``/``users`` consistent:
:meth:`Instruction.replace_operand`, :meth:`Computation.add_instruction`,
:meth:`Computation.remove_instruction`, :meth:`Computation.replace_all_uses`,
:meth:`Computation.rename`, :meth:`Computation.set_order`.

Tables and analyses: opcode tables (opcodes.py), replica groups in every textual form
(replica_groups.py), shardings as tile keys (sharding.py), control flow and while loops
(loops.py), the replication analysis (uniformity.py), buffer aliases (aliases.py), channel
ids (channels.py). The IR imports nothing of the project but ``concerto_jax.jax_compat``
(lazily, in xla.py: XLA's parser and printer).
"""

from hlo_passes.ir.aliases import alias_closure
from hlo_passes.ir.channels import channel_counter, max_channel_id
from hlo_passes.ir.computation import Computation
from hlo_passes.ir.errors import HloError, HloParseError, HloVerifyError
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.loops import (
    CASTS,
    CarriedValue,
    LoopInfo,
    analyze_while,
    control_flow_callees,
    control_flow_depths,
    loop_state_problem,
    schedulable_computations,
    side_effects,
    through_casts,
)
from hlo_passes.ir.module import HloModule
from hlo_passes.ir.opcodes import ALIAS_OPCODES, COLLECTIVE_KINDS, async_parts
from hlo_passes.ir.parser import parse_module
from hlo_passes.ir.printer import computation_to_text, instruction_to_text, module_to_text
from hlo_passes.ir.replica_groups import (
    device_groups,
    expand_iota,
    format_replica_groups,
    is_partition_of,
    parse_replica_groups,
)
from hlo_passes.ir.shapes import Shape, ShapeSyntaxError, parse_shape
from hlo_passes.ir.sharding import labels_of_groups, sharding_tile_keys
from hlo_passes.ir.source_locations import without_source_locations
from hlo_passes.ir.uniformity import Uniformity
from hlo_passes.ir.verifier import verify
from hlo_passes.ir.xla import xla_canonical, xla_parse

__all__ = [
    "ALIAS_OPCODES", "CASTS", "COLLECTIVE_KINDS", "CarriedValue", "Computation", "HloError",
    "HloModule", "HloParseError", "HloVerifyError", "Instruction", "LoopInfo", "Shape",
    "ShapeSyntaxError", "Uniformity", "alias_closure", "analyze_while", "async_parts",
    "channel_counter", "computation_to_text", "control_flow_callees", "control_flow_depths",
    "device_groups", "expand_iota", "format_replica_groups", "instruction_to_text",
    "is_partition_of", "labels_of_groups", "loop_state_problem", "max_channel_id",
    "module_to_text", "parse_module", "parse_replica_groups", "parse_shape",
    "schedulable_computations", "sharding_tile_keys", "side_effects", "through_casts", "verify",
    "xla_canonical", "xla_parse", "without_source_locations",
]
