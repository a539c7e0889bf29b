"""HLO text -> IR: a hand-written recursive-descent parser over regex tokens.

Grammar (what XLA prints; ``%`` before names is optional, ``/*...*/`` comments
are skipped where XLA writes them)::

    module      := 'HloModule' NAME (',' KEY '=' VALUE)* NL sections computation+
    sections    := (SECTION_NAME NL (LINE NL)*)*       # FileNames, StackFrames, ... kept verbatim
    computation := ['ENTRY'] NAME [signature] [',' 'execution_thread=' STRING] '{' NL
                    ... '}' [',' 'execution_thread=' STRING]   (XLA prints the thread here)
                   instruction* '}'
    instruction := ['ROOT'] NAME '=' shape OPCODE '(' operands ')' (',' KEY '=' VALUE)* NL
    operands    := [[shape] REF (',' [shape] REF)*] | LITERAL (constant) | INT (parameter)
    REF         := NAME ['#' INT]                       # NAME#k: element k of a tuple (see below)
    VALUE       := balanced text up to the next top-level ',' or end of line

Newer XLA (jaxlib >= 0.11) prints an operand that is element ``k`` of a tuple-shaped
instruction as ``%name#k`` instead of a separate ``get-tuple-element``. The parser
materialises one ``get-tuple-element`` per ``(name, k)`` and computation as XLA's own
parser does (named ``name_k``, placed right before its first user), so the IR has one
form and the printer writes the classic one, which every XLA version parses. Their
names are listed in ``HloModule.implicit_tuple_elements``: they have no line in the text.

Attribute values are kept as raw text except those naming computations
(``to_apply``, ``calls``, ...) and ``control-predecessors``, which are resolved
to IR objects. Errors raise :class:`HloParseError` with the line number, the
line and what was expected.
"""

from __future__ import annotations

import logging
import re

from hlo_passes.ir import opcodes as _ops
from hlo_passes.ir.computation import Computation
from hlo_passes.ir.errors import HloParseError
from hlo_passes.ir.instruction import Instruction
from hlo_passes.ir.module import HloModule
from hlo_passes.ir.shapes import ShapeSyntaxError, parse_shape_at

__all__ = ["parse_module"]

log = logging.getLogger(__name__)

_NAME = r"[A-Za-z_][\w.\-]*"
_WS_RE = re.compile(r"(?:\s+|/\*.*?\*/|//[^\n]*)*", re.S)
_SP_RE = re.compile(r"[ \t]*")
_SPC_RE = re.compile(r"(?:[ \t]+|/\*[^\n]*?\*/)*")  # spaces and /*index=N*/ comments
_MODULE_RE = re.compile(r"HloModule[ \t]+(" + _NAME + r")")
_SECTION_RE = re.compile(r"([A-Z][A-Za-z]*)[ \t]*\n")
_COMP_RE = re.compile(r"(ENTRY[ \t]+)?%?(" + _NAME + r")[ \t]*")
_INSTR_RE = re.compile(r"[ \t]*(ROOT[ \t]+)?%?(" + _NAME + r")[ \t]*=[ \t]*")
_OPCODE_RE = re.compile(r"[ \t]*([a-z][a-z0-9\-]*)\(")
_FAST_OPERANDS_RE = re.compile(r"(%" + _NAME + r"(?:, %" + _NAME + r")*)?\)")
_OPERAND_NAME_RE = re.compile(r"%?(" + _NAME + r"(?:#\d+)?)")
_SHAPE_START_RE = re.compile(r"[a-z][a-z0-9]*\[|\(")
_ATTR_RE = re.compile(r"[ \t]*,[ \t]*([A-Za-z_][\w\-]*)[ \t]*=[ \t]*")
_EOL_RE = re.compile(r"[ \t]*(?://[^\n]*)?(?:\n|\Z)")
_INT_RE = re.compile(r"[ \t]*(\d+)[ \t]*\)")
_CHUNK_RE = re.compile(r"[^\"'{}()\[\],\n]+")
_DSTR_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_SSTR_RE = re.compile(r"'[^'\n]*'")
_REF_LIST_RE = re.compile(r"%?(" + _NAME + r")")
_DEVICE_IDS_RE = re.compile(r"[ \t]*,[ \t]*device_ids=")
_CLOSER = {"{": "}", "(": ")", "[": "]"}


class _CompRef:
    """Placeholder for a computation reference until all computations are parsed."""

    __slots__ = ("names", "is_list", "pos")

    def __init__(self, names, is_list, pos):
        self.names, self.is_list, self.pos = names, is_list, pos


class _Parser:
    def __init__(self, text: str, source: str):
        self.text = text.replace("\r\n", "\n")
        self.source = source
        self.implicit_names: set[str] = set()  # the get-tuple-elements made for NAME#k

    # -- errors -----------------------------------------------------------------------
    def error(self, pos: int, expected: str) -> HloParseError:
        text = self.text
        pos = min(pos, len(text))
        line_no = text.count("\n", 0, pos) + 1
        start = text.rfind("\n", 0, pos) + 1
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        rest = text[pos:end]
        if pos >= len(text):
            found = "end of input"
        elif not rest.strip():
            found = "end of line"
        else:
            found = repr(rest[:24] + ("..." if len(rest) > 24 else ""))
        return HloParseError(expected, found, line_no, pos - start + 1, text[start:end],
                             self.source)

    # -- balanced raw text ----------------------------------------------------------------
    def scan(self, pos: int, *, newline_ok: bool = False, comma_stops: bool = True) -> int:
        """End of the balanced text at ``pos``: the first top-level ',' (if
        ``comma_stops``), closing bracket, newline or end of input."""
        text, n, stack = self.text, len(self.text), []
        while pos < n:
            m = _CHUNK_RE.match(text, pos)
            if m is not None:
                pos = m.end()
                if pos >= n:
                    break
            c = text[pos]
            if c == '"' or c == "'":
                m = (_DSTR_RE if c == '"' else _SSTR_RE).match(text, pos)
                if m is None:
                    raise self.error(pos, f"a closing {c} before the end of the line")
                pos = m.end()
            elif c in "{([":
                stack.append(pos)
                pos += 1
            elif c in "})]":
                if not stack:
                    return pos
                opener = text[stack[-1]]
                if _CLOSER[opener] != c:
                    raise self.error(pos, f"'{_CLOSER[opener]}' closing the '{opener}' at "
                                          f"column {stack[-1] - text.rfind(chr(10), 0, stack[-1])}")
                stack.pop()
                pos += 1
            elif c == ",":
                if not stack and comma_stops:
                    return pos
                pos += 1
            else:  # newline
                if not stack:
                    return pos
                if not newline_ok:
                    opener = text[stack[-1]]
                    raise self.error(stack[-1], f"'{_CLOSER[opener]}' closing this '{opener}' "
                                                "before the end of the line")
                pos += 1
        if stack:
            opener = text[stack[-1]]
            raise self.error(stack[-1], f"'{_CLOSER[opener]}' closing this '{opener}'")
        return pos

    def shape(self, pos: int):
        try:
            return parse_shape_at(self.text, pos)
        except ShapeSyntaxError as e:
            raise self.error(e.pos, e.expected) from None

    # -- module -------------------------------------------------------------------------------
    def module(self) -> HloModule:
        text = self.text
        pos = _WS_RE.match(text, 0).end()
        m = _MODULE_RE.match(text, pos)
        if m is None:
            raise self.error(pos, "'HloModule <name>' at the start of the module")
        module = HloModule(m.group(1))
        pos = self.attributes(m.end(), module.attrs, None)
        pos = self.end_of_line(pos)
        # Verbatim sections (FileNames, FunctionNames, FileLocations, StackFrames, ...).
        first = last = None
        while True:
            pos = _WS_RE.match(text, pos).end()
            m = _SECTION_RE.match(text, pos)
            if m is None:
                break
            first = pos if first is None else first
            end = text.find("\n\n", m.end())
            pos = last = len(text) if end < 0 else end
        module.sections = text[first:last].strip("\n") if first is not None else ""
        fixups: list[tuple[Instruction, str]] = []
        while pos < len(text):
            comp, pos = self.computation(pos, fixups)
            if comp.name in module._by_name:
                raise self.error(self._comp_pos, f"a new computation name (%{comp.name} "
                                                 "is already defined)")
            module.computations.append(comp)
            module._by_name[comp.name] = comp
            comp.module = module
            pos = _WS_RE.match(text, pos).end()
        if not module.computations:
            raise self.error(pos, "a computation")
        if not any(c.is_entry for c in module.computations):
            module.computations[-1].is_entry = True
        for inst, key in fixups:
            ref = inst.attrs[key]
            comps = []
            for name in ref.names:
                comp = module._by_name.get(name)
                if comp is None:
                    raise self.error(ref.pos, f"the name of a computation of this module "
                                              f"(%{name} is not defined)")
                comps.append(comp)
            inst.attrs[key] = comps if ref.is_list else comps[0]
        module.implicit_tuple_elements = frozenset(self.implicit_names)
        return module

    def attributes(self, pos: int, attrs: dict, fixups) -> int:
        text = self.text
        while True:
            m = _ATTR_RE.match(text, pos)
            if m is None:
                return pos
            key, start = m.group(1), m.end()
            pos = self.scan(start)
            if key == "replica_groups" and text.startswith("mesh[", start):
                d = _DEVICE_IDS_RE.match(text, pos)
                if d is not None:  # mesh[...], device_ids=(...) {...}
                    pos = self.scan(d.end())
            if pos == start:
                raise self.error(pos, f"a value for attribute '{key}'")
            value = text[start:pos].rstrip()
            if fixups is not None and (key in _ops.CALLED_COMPUTATION_ATTRS
                                       or key == "control-predecessors"):
                is_list = value.startswith("{")
                names = _REF_LIST_RE.findall(value[1:-1] if is_list else value)
                if not is_list and len(names) != 1:
                    raise self.error(start, f"one computation name after '{key}='")
                value = _CompRef(names, is_list, start)
                if key != "control-predecessors":
                    fixups.append((None, key))  # resolved by the caller
            attrs[key] = value

    def end_of_line(self, pos: int) -> int:
        m = _EOL_RE.match(self.text, pos)
        if m is None:
            raise self.error(pos, "',' followed by an attribute, or the end of the line")
        return m.end()

    # -- computation ----------------------------------------------------------------------------
    def computation(self, pos: int, fixups) -> tuple[Computation, int]:
        text = self.text
        self._comp_pos = pos
        m = _COMP_RE.match(text, pos)
        if m is None:
            raise self.error(pos, "a computation ('%name (params) -> shape {' or 'ENTRY ...')")
        comp = Computation(m.group(2), is_entry=m.group(1) is not None)
        pos = m.end()
        if text.startswith("(", pos):
            end = self.scan(pos + 1, comma_stops=False)
            if not text.startswith(")", end):
                raise self.error(end, "')' closing the parameter list")
            pos = _SP_RE.match(text, end + 1).end()
            if not text.startswith("->", pos):
                raise self.error(pos, "'->' and the result shape")
            pos = _SP_RE.match(text, pos + 2).end()
            _, pos = self.shape(pos)
        extra: dict[str, str] = {}
        pos = self.attributes(pos, extra, None)
        if "execution_thread" in extra:
            comp.execution_thread = extra.pop("execution_thread")
        if extra:
            raise self.error(pos, "'{' (unknown computation attribute "
                                  f"'{next(iter(extra))}')")
        pos = _SP_RE.match(text, pos).end()
        if not text.startswith("{", pos):
            raise self.error(pos, "'{' opening the computation body")
        pos = self.end_of_line(pos + 1)
        by_name = comp._by_name
        instructions = comp.instructions
        pending: list[tuple[Instruction, int, str, int]] = []
        root = None
        while True:
            pos = _WS_RE.match(text, pos).end()
            if text.startswith("}", pos):
                pos += 1
                # XLA prints a computation's thread after its closing brace:
                # '}, execution_thread="parallel"' (async computations of a non-main thread)
                after = self.attributes(pos, extra, None)
                if "execution_thread" in extra:
                    comp.execution_thread = extra.pop("execution_thread")
                if extra:
                    raise self.error(pos, f"a new line after the computation (unknown attribute "
                                          f"'{next(iter(extra))}')")
                pos = after
                break
            line_pos = pos
            m = _INSTR_RE.match(text, pos)
            if m is None:
                if pos >= len(text):
                    raise self.error(pos, f"'}}' closing computation %{comp.name}")
                raise self.error(pos, "an instruction '%name = shape opcode(operands)' or '}'")
            name = m.group(2)
            shape, pos = self.shape(m.end())
            o = _OPCODE_RE.match(text, pos)
            if o is None:
                raise self.error(_SP_RE.match(text, pos).end(), "an opcode followed by '('")
            opcode = o.group(1)
            pos = o.end()
            inst = Instruction(name, opcode, shape)
            if opcode == "constant":
                end = self.scan(pos, newline_ok=True, comma_stops=False)
                if not text.startswith(")", end):
                    raise self.error(end, "')' closing the constant literal")
                inst.literal = text[pos:end]
                pos = end + 1
            elif opcode == "parameter":
                p = _INT_RE.match(text, pos)
                if p is None:
                    raise self.error(pos, "a parameter number and ')'")
                inst.parameter_number = int(p.group(1))
                pos = p.end()
            else:
                pos = self.operands(pos, inst, by_name, pending)
            ref_keys = []
            pos = self.attributes(pos, inst.attrs, ref_keys)
            for _, key in ref_keys:
                fixups.append((inst, key))
            pos = self.end_of_line(pos)
            if name in by_name:
                raise self.error(line_pos, f"a new instruction name (%{name} is already "
                                           f"defined in %{comp.name})")
            inst.parent = comp
            instructions.append(inst)
            by_name[name] = inst
            if m.group(1) is not None:
                if root is not None:
                    raise self.error(line_pos, f"one ROOT per computation (%{root.name} "
                                               "already is the ROOT)")
                root = inst
        implicit: dict[str, Instruction] = {}
        for inst, index, name, use_pos in pending:
            op = by_name.get(name)
            if op is None and "#" in name:
                op = implicit.get(name) or self.tuple_element(comp, name, inst, use_pos, implicit)
            if op is None:
                raise self.error(use_pos, f"an operand defined in computation %{comp.name} "
                                          f"(%{name} is not defined)")
            inst.operands[index] = op
            if inst not in op.users:
                op.users.append(inst)
        for inst in instructions:
            ref = inst.attrs.get("control-predecessors")
            if isinstance(ref, _CompRef):
                preds = []
                for name in ref.names:
                    if name not in by_name:
                        raise self.error(ref.pos, f"a control predecessor defined in "
                                                  f"%{comp.name} (%{name} is not defined)")
                    preds.append(by_name[name])
                inst.attrs["control-predecessors"] = preds
        if not instructions:
            raise self.error(pos - 1, f"at least one instruction in %{comp.name}")
        comp.root = root if root is not None else instructions[-1]
        return comp, pos

    def tuple_element(self, comp: Computation, ref: str, user: Instruction, use_pos: int,
                      implicit: dict[str, Instruction]) -> Instruction | None:
        """The ``get-tuple-element`` that ``name#k`` stands for (created before ``user``)."""
        base, k = ref.rsplit("#", 1)
        producer = comp._by_name.get(base)
        if producer is None:
            return None
        index = int(k)
        shape = producer.shape
        if not shape.is_tuple or index >= len(shape.elements):
            raise self.error(use_pos, f"an element of a tuple (%{base} has shape {shape}, "
                                      f"no element {index})")
        name, n = f"{base}_{index}", 1
        while name in comp._by_name or name in self.implicit_names:
            name, n = f"{base}_{index}.{n}", n + 1
        gte = Instruction(name, "get-tuple-element", shape.elements[index], [producer],
                          {"index": str(index)})
        gte.parent = comp
        comp.instructions.insert(comp.instructions.index(user), gte)
        comp._by_name[name] = gte
        implicit[ref] = gte
        self.implicit_names.add(name)
        return gte

    def operands(self, pos: int, inst: Instruction, by_name, pending) -> int:
        text = self.text
        f = _FAST_OPERANDS_RE.match(text, pos)
        names_pos = []
        if f is not None:
            if f.group(1):
                start = pos
                for name in f.group(1).split(", "):
                    names_pos.append((name[1:], start))
                    start += len(name) + 2
            pos = f.end()
        else:  # general form: comments, shapes before names, names without '%'
            while True:
                pos = _WS_RE.match(text, pos).end()
                if text.startswith(")", pos):
                    pos += 1
                    break
                if _SHAPE_START_RE.match(text, pos):
                    _, pos = self.shape(pos)
                    pos = _SPC_RE.match(text, pos).end()
                n = _OPERAND_NAME_RE.match(text, pos)
                if n is None:
                    raise self.error(pos, "an operand name such as %x, or ')'")
                names_pos.append((n.group(1), pos))
                pos = _SPC_RE.match(text, n.end()).end()
                if text.startswith(",", pos):
                    pos += 1
                elif not text.startswith(")", pos):
                    raise self.error(pos, "',' or ')' after an operand")
        operands = inst.operands
        for name, use_pos in names_pos:
            op = by_name.get(name)  # None for NAME#k too: resolved with the pending names
            if op is None:
                pending.append((inst, len(operands), name, use_pos))
                operands.append(None)
                continue
            operands.append(op)
            users = op.users
            if not users or users[-1] is not inst:
                users.append(inst)
        return pos


def parse_module(text: str, source: str = "<hlo>") -> HloModule:
    """Parses HLO text (as XLA prints it) into an :class:`HloModule`.

    Args:
      text: the module text.
      source: a name for error messages (e.g. the file name).

    Returns:
      The module; computations keep their textual order, instructions theirs.

    Raises:
      HloParseError: malformed text; the message names the line and what was expected.
    """
    return _Parser(text, source).module()
