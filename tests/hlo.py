"""Reading compiled (optimized) HLO text: which collectives run unconditionally, which only in a branch."""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = ('all-reduce', 'all-gather', 'collective-permute', 'all-to-all', 'reduce-scatter')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$')
_CALLED = re.compile(r'(?:to_apply|calls|body|condition|true_computation|false_computation)=%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_OP = re.compile(r'^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(')  # shape, then opcode(


@dataclasses.dataclass
class Hlo:
  """Computations of an HLO module: their instructions' opcodes and the computations each one calls."""
  ops: dict[str, list[str]]
  calls: dict[str, set[str]]
  branches: list[list[str]]   # per conditional instruction, its branch computations

  def reachable(self, roots) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
      name = todo.pop()
      if name not in seen:
        seen.add(name)
        todo.extend(self.calls.get(name, ()))
    return seen

  def collectives(self, computations) -> list[str]:
    """Collective opcodes (async -start halves counted once) in the given computations."""
    out = []
    for name in computations:
      out += [op for op in self.ops.get(name, ()) if op.removesuffix('-start') in COLLECTIVES]
    return out

  @property
  def conditionals(self) -> int:
    return len(self.branches)

  def collectives_outside_conditionals(self) -> list[str]:
    """Collectives that run on every execution: not inside any conditional's branches."""
    inside = self.reachable(b for branch in self.branches for b in branch)
    return self.collectives(set(self.ops) - inside)


def parse(text: str) -> Hlo:
  ops: dict[str, list[str]] = {}
  calls: dict[str, set[str]] = {}
  branches: list[list[str]] = []
  current = None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      ops[current], calls[current] = [], set()
      continue
    if current is None or '=' not in line:
      continue
    op = _OP.search(line)
    if op:
      ops[current].append(op.group(1))
    calls[current].update(_CALLED.findall(line))
    for group in _BRANCHES.findall(line):
      names = [n.strip().lstrip('%') for n in group.split(',') if n.strip()]
      calls[current].update(names)
      branches.append(names)
  return Hlo(ops=ops, calls=calls, branches=branches)


def compiled(fn, *args) -> Hlo:
  """The optimized HLO of the jitted `fn` for `args`."""
  return parse(fn.lower(*args).compile().as_text())
